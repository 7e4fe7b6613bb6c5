"""Continuous-batching limits and the fairness policy (``SchedulerConfig``)."""

from __future__ import annotations

import math
from dataclasses import dataclass

#: ``SchedulerConfig.scheduling_policy`` values.
SCHEDULING_POLICIES = ("fair", "fcfs")


def check_fairness(scheduling_policy: str, max_group_share: float) -> None:
    """Check the fair-sharing settings (``SchedulerConfig``'s, as ``EngineArgs`` takes them).

    Raises:
        ValueError: a policy not in ``SCHEDULING_POLICIES``, or a share outside (0, 1].
    """
    if scheduling_policy not in SCHEDULING_POLICIES:
        raise ValueError(f"scheduling_policy must be one of {', '.join(SCHEDULING_POLICIES)}"
                         f", got {scheduling_policy!r}")
    if not 0.0 < max_group_share <= 1.0:
        raise ValueError(f"max_group_share must be in (0, 1], got {max_group_share}")


@dataclass(frozen=True)
class SchedulerConfig:
    """Continuous-batching limits.

    Attributes:
        max_num_seqs: requests in the running batch at once.
        max_num_batched_tokens: tokens (prefill + decode) computed in one step.
        max_loras: distinct adapters in one step (the number of device slots).
        lora_aging_steps: steps a waiting request may be passed over by requests whose
            adapters are resident before it takes the next free slot in arrival order.
        lora_new_adapters_per_step: while more adapters wait than slots are free (and the
            scheduler is given the adapter cache's residency), adapters a step may admit
            that the running batch does not use; None: as many as slots allow.
        lora_staging_slots: under the same condition, slots kept free of running adapters
            so the next adapters' copies run ahead on the side stream instead of stalling a
            step; at most ``max_loras // 4`` of them.
        scheduling_policy: ``"fair"``: waiting requests join least-running client group
            first (first-come first-served within a group), and a group holding more than
            ``max_group_share`` of ``max_num_seqs`` gives up its newest running requests
            to other groups' waiting ones when no sequence slot is free; ``"fcfs"``: strict
            arrival order, nothing preempted for fairness (vLLM's default policy).
        max_group_share: under ``"fair"``, the share (0, 1] of ``max_num_seqs`` a client
            group keeps while other groups wait (rounded up, at least one request); 1: no
            preemption for fairness, only the least-running-first order.
    """

    max_num_seqs: int
    max_num_batched_tokens: int
    max_loras: int
    lora_aging_steps: int = 64
    lora_new_adapters_per_step: int | None = 1
    lora_staging_slots: int = 1
    scheduling_policy: str = "fair"
    max_group_share: float = 0.5

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "max_num_batched_tokens", "max_loras",
                     "lora_aging_steps"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be ≥ 1, got {getattr(self, name)}")
        if self.lora_new_adapters_per_step is not None and self.lora_new_adapters_per_step < 1:
            raise ValueError(f"lora_new_adapters_per_step must be ≥ 1 or None, got "
                             f"{self.lora_new_adapters_per_step}")
        if self.lora_staging_slots < 0:
            raise ValueError(f"lora_staging_slots must be ≥ 0, got {self.lora_staging_slots}")
        check_fairness(self.scheduling_policy, self.max_group_share)

    @property
    def max_group_seqs(self) -> int:
        """The running requests a client group keeps while others wait (``"fair"``):
        ``ceil(max_group_share * max_num_seqs)``, at least 1."""
        return max(1, math.ceil(self.max_group_share * self.max_num_seqs - 1e-9))
