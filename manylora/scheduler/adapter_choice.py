"""Which adapters' waiting requests may join a step: the adapter side of admission.

A step's waiting requests are drawn from the queues of the adapters the step may use:

* the base model and adapters the running batch already uses (no adapter slot needed);
* while fewer than ``max_loras`` adapters are in the step, new adapters, preferring those
  already resident in a device slot (no copy) over those staged in host memory, oldest
  request first (vLLM's rule: a request whose adapter would take the step past
  ``max_loras`` stays queued while others pass it). A request that has waited
  ``lora_aging_steps`` steps is aged: aged requests take free adapter slots strictly in
  arrival order, before any preference. Adapters that are not ready (still on disk) are
  passed over while the adapter cache stages them (``wanted`` tells it which).
* If an aged request finds no free adapter slot, the running adapter with the fewest running
  requests takes no new requests until it drains, so its slot goes to the aged request: no
  request starves behind adapters that are always busy.

With the adapter cache's residency (the engine's case) and more adapters waiting than
adapter slots are free, two more rules pace the copies into slots
(``benchmarks/sim_churn.py`` compares them with the rules above alone on a roofline model of
the engine):

* a step admits at most ``lora_new_adapters_per_step`` adapters that are not in the running
  batch; adapters that drain together then re-enter one per step, so their prefill and
  their copies spread over steps instead of one compute-bound step that waits on several
  copies;
* ``lora_staging_slots`` adapter slots (a quarter of ``max_loras`` at most, none below 4)
  stay free of running adapters: the adapter cache copies the next adapters (``wanted``) into them
  while steps run, so they join with no copy to wait for.

Neither rule starves a request: aged requests still take free adapter slots in arrival order
before any other adapter (and close the least busy running adapter when none is free).
No tensors here.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable

from manylora.config import SchedulerConfig
from manylora.lora_request import LoRARequest
from manylora.request import Request
from manylora.scheduler.waiting_queue import WaitingQueues


class AdapterChoice:
    """Chooses the adapters whose waiting requests may join a step (see the module doc).

    Args:
        config: ``max_loras``, ``lora_aging_steps`` and the pacing limits.
        waiting: the scheduler's waiting requests (read, never written).
        is_ready: whether a step could use an adapter without reading a disk
            (``AdapterResidency.is_ready``).
        is_resident: whether an adapter already sits in a device slot
            (``AdapterResidency.is_resident``).
        pace_copies: apply the two pacing rules (the adapter cache copies adapters into
            slots; off when the scheduler runs alone, as in tests).
    """

    def __init__(self, config: SchedulerConfig, waiting: WaitingQueues,
                 is_ready: Callable[[int], bool], is_resident: Callable[[int], bool],
                 pace_copies: bool) -> None:
        self.config = config
        self.waiting = waiting
        self.is_ready = is_ready
        self.is_resident = is_resident
        self.pace_copies = pace_copies

    def aged(self, req: Request, step: int) -> bool:
        """Whether ``req`` has waited ``lora_aging_steps`` steps by scheduler step ``step``."""
        return step - self.waiting.since[req.request_id] >= self.config.lora_aging_steps

    def new_adapter_order(self, in_step: set[int], step: int) -> list[int]:
        """Adapters with waiting requests that are not in the step, best first: aged heads
        in arrival order, then resident adapters, then the others, oldest head first."""
        queues, order = self.waiting.queues, self.waiting.order

        def key(lid: int) -> tuple:
            head = queues[lid].head()
            arrival = order[head.request_id]
            if self.aged(head, step):
                return (0, False, arrival)
            return (1, not self.is_resident(lid), arrival)

        return sorted((lid for lid, q in queues.items() if lid and q and lid not in in_step),
                      key=key)

    def wanted(self, running_adapters: set[int], limit: int, step: int) -> list[LoRARequest]:
        """The ``LoRARequest`` of the next ``limit`` adapters waiting requests will need that
        the running batch (``running_adapters``) does not use, in the order they would get
        adapter slots."""
        order = self.new_adapter_order(running_adapters, step)[:limit]
        return [self.waiting.queues[lid].any().lora_request for lid in order]

    def allowed(self, running: list[Request], step: int) -> set[int]:
        """The adapters whose waiting requests may join step ``step`` (0 = base), given the
        running batch ``running``."""
        config = self.config
        in_step = {r.lora_int_id for r in running if r.lora_int_id}
        allowed = in_step | {0}
        order = self.new_adapter_order(in_step, step)
        free = config.max_loras - len(in_step)
        admits, reserve = None, 0
        if self.pace_copies and len(order) > free:   # more adapters wait than slots are free
            admits = config.lora_new_adapters_per_step
            reserve = min(config.lora_staging_slots, config.max_loras // 4)
        for lid in order:
            aged = self.aged(self.waiting.queues[lid].head(), step)
            if free - reserve <= 0 or admits == 0:
                if aged and in_step and free - reserve <= 0:
                    counts = Counter(r.lora_int_id for r in running if r.lora_int_id)
                    allowed.discard(min(in_step, key=lambda a: (counts[a], a)))
                break
            if self.is_ready(lid):
                allowed.add(lid)
                free -= 1
                if admits is not None:
                    admits -= 1
            elif aged:
                break          # the oldest waits for its adapter: no younger one passes it
        return allowed
