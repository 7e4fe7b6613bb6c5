"""The tensor-parallel group a rank belongs to, and the two collectives the model needs.

Tensor parallelism follows Megatron-LM (Shoeybi et al. 2019) as vLLM applies it: every rank
holds a slice of each projection and the activations are put back together with an
all-reduce (after a row-parallel projection, the vocabulary-parallel embedding) or an
all-gather (the LM head's logits, the shrink buffer of fully sharded LoRA). A group of size 1
does no communication at all and works without ``torch.distributed`` being initialized, so
single-GPU code paths pay nothing.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

#: How a projection is split over a tensor-parallel group: not split, output rows split
#: (Megatron-LM's ColumnParallelLinear), input columns split (RowParallelLinear).
PARALLEL_MODES = (None, "column", "row")


@dataclass(frozen=True)
class TPGroup:
    """This process's place in a tensor-parallel group.

    Attributes:
        rank: this process's index in the group, in ``[0, size)``.
        size: the number of ranks the model is split over.
        group: the ``torch.distributed`` process group (None: the default, world group).

    Collectives must be entered by every rank of the group, in the same order, with tensors
    of the same shape and dtype (``torch.distributed``'s contract). Constructing a group
    needs no initialized ``torch.distributed`` (a rank's shard can be built and loaded
    without one); only collectives at ``size > 1`` do.

    Raises:
        ValueError: ``size < 1`` or ``rank`` outside ``[0, size)``.
    """

    rank: int = 0
    size: int = 1
    group: Any = None

    def __post_init__(self) -> None:
        if self.size < 1:
            raise ValueError(f"tensor-parallel size must be ≥ 1, got {self.size}")
        if not 0 <= self.rank < self.size:
            raise ValueError(f"tensor-parallel rank {self.rank} is outside [0, {self.size})")

    @classmethod
    def single(cls) -> TPGroup:
        """The group of one rank: no sharding, collectives are identities."""
        return cls(0, 1, None)

    @classmethod
    def from_process_group(cls, group: Any = None) -> TPGroup:
        """This process's rank and the size of ``group`` (None: the world group).

        Raises:
            RuntimeError: ``torch.distributed`` is not initialized.
        """
        if not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError("torch.distributed is not initialized: call "
                               "init_process_group before building a tensor-parallel group")
        return cls(dist.get_rank(group), dist.get_world_size(group), group)

    @property
    def is_single(self) -> bool:
        return self.size == 1

    def _check(self) -> None:
        if not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError(f"a collective of a tensor-parallel group of {self.size} ranks "
                               "needs torch.distributed, which is not initialized")

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        """Sum ``t`` over the ranks, in place; returns ``t`` (unchanged at size 1).

        A non-contiguous ``t`` is reduced through a contiguous copy written back into it.

        Raises:
            RuntimeError: ``size > 1`` and ``torch.distributed`` is not initialized.
        """
        if self.size == 1:
            return t
        self._check()
        if t.is_contiguous():
            dist.all_reduce(t, group=self.group)
        else:
            buf = t.contiguous()
            dist.all_reduce(buf, group=self.group)
            t.copy_(buf)
        return t

    def all_gather(self, t: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Every rank's ``t`` concatenated along ``dim`` in rank order: shape ``t.shape`` with
        ``dim`` multiplied by ``size`` (``t`` itself at size 1). All ranks' tensors must have
        the same shape.

        Raises:
            RuntimeError: ``size > 1`` and ``torch.distributed`` is not initialized.
        """
        if self.size == 1:
            return t
        self._check()
        t = t.contiguous()
        if dist.get_backend(self.group) == "nccl":
            out = torch.empty((self.size * t.shape[0], *t.shape[1:]), dtype=t.dtype,
                              device=t.device)
            dist.all_gather_into_tensor(out, t, group=self.group)
            parts = out.chunk(self.size, dim=0)
        else:
            parts = [torch.empty_like(t) for _ in range(self.size)]
            dist.all_gather(parts, t, group=self.group)
        return torch.cat(parts, dim=dim)

    def even_range(self, total: int, what: str = "dimension") -> tuple[int, int]:
        """This rank's ``[start, stop)`` of ``total`` split evenly over the ranks.

        Raises:
            ValueError: ``total`` is not divisible by ``size`` (``what`` names it).
        """
        if total % self.size:
            raise ValueError(f"{what} of {total} cannot be split evenly over "
                             f"{self.size} tensor-parallel ranks")
        part = total // self.size
        return self.rank * part, (self.rank + 1) * part
