"""A one-shot all-reduce through symmetric memory, for the small all-reduces of decode steps.

A decode step at batch 1-128 all-reduces a few KiB to 1 MiB after every row-parallel
projection (two per layer). NCCL's ring spends about 19 us on each inside a CUDA graph
(measured on two H200s over NVLink, torch 2.11); a one-shot all-reduce, where every rank
reads its peers' buffers directly over NVLink and sums them, spends about 7.5 us. vLLM's
``custom_all_reduce`` and SGLang's ``torch_symm_mem`` communicator make the same trade.

The buffers come from ``torch.distributed._symmetric_memory``: ``empty`` allocates one
buffer per rank, ``rendezvous`` maps the peers' buffers into every rank, and the op
``torch.ops.symm_mem.one_shot_all_reduce(buf, "sum", group_name)`` computes

    out[i] = sum over ranks r of buf_r[i]

behind a barrier on every rank's signal pad (so a buffer is never overwritten while a peer
still reads it). It uses peer-to-peer loads only, never NVLink multicast. It is captured by
CUDA graphs like any kernel.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)

#: Largest all-reduce (bytes) that takes the one-shot path; larger ones (prefill) use NCCL,
#: whose ring wins once the transfer, not the latency, dominates.
DEFAULT_MAX_BYTES = 1 << 20

#: The dtypes torch's one-shot kernel sums (``AT_DISPATCH_FLOAT_AND_BFLOAT16``).
SUPPORTED_DTYPES = (torch.bfloat16, torch.float32)

# Whether this process has entered a rendezvous. torch numbers a process's symmetric-memory store
# exchanges from 0 over its whole life, so once rank 0 has made one, the fresh worker
# processes of a later group wait for keys it has long passed (seen on two H200s, torch
# 2.11: a 300 s hang in the second engine of a process). Hence one group per process.
_rendezvous_entered = False


def available_in_process() -> bool:
    """Whether this process may still build a ``SymmetricAllReduce``: it has entered no
    symmetric-memory rendezvous yet (see ``_rendezvous_entered``)."""
    return not _rendezvous_entered


class SymmetricAllReduce:
    """Sums tensors of one dtype over a process group with torch's one-shot kernel.

    Build it with ``create`` (a collective: every rank of the group calls it at the same
    point); use it for a tensor when ``applies(t)``, NCCL otherwise.

    Args:
        buffer: this rank's symmetric buffer, ``dtype``, ``[max_bytes // itemsize]``.
        group_name: the process group's name, as ``rendezvous`` registered it.

    Attributes:
        dtype: the one dtype it reduces (the model's).
        max_numel: the most elements one call may reduce.
    """

    def __init__(self, buffer: torch.Tensor, group_name: str) -> None:
        self.buffer = buffer
        self.group_name = group_name
        self.dtype = buffer.dtype
        self.max_numel = buffer.numel()

    @classmethod
    def create(cls, group: Any, device: torch.device, dtype: torch.dtype,
               max_bytes: int = DEFAULT_MAX_BYTES) -> SymmetricAllReduce | None:
        """The one-shot all-reduce of ``group`` on ``device`` for ``dtype``, or None where it
        cannot be had (not CUDA, a dtype it does not sum, no symmetric memory in this torch,
        or its allocation, rendezvous or self-check failed on any rank: the ranks agree, so
        all take the same path). Every rank of ``group`` must call it, each in a process
        where ``available_in_process()`` held (the caller decides for all ranks at once:
        see ``WorkerSpec.one_shot_all_reduce``).

        The self-check sums ``rank + 1`` over the ranks and compares with
        ``size * (size + 1) / 2`` on every element.
        """
        if device.type != "cuda" or dtype not in SUPPORTED_DTYPES:
            return None
        global _rendezvous_entered
        _rendezvous_entered = True
        try:
            import torch.distributed._symmetric_memory as symm_mem

            name = (group or dist.group.WORLD).group_name
            buffer = symm_mem.empty(max_bytes // dtype.itemsize, dtype=dtype, device=device)
            symm_mem.rendezvous(buffer, name)
            found = cls(buffer, name)
        except Exception as exc:       # any failure means NCCL's path, on every rank
            logger.warning("no one-shot all-reduce (%s); using NCCL's", exc)
            found = None
        if not _all_agree(found is not None, group, device):
            return None
        size, rank = dist.get_world_size(group), dist.get_rank(group)
        probe = torch.full((4096,), float(rank + 1), dtype=dtype, device=device)
        right = bool((found(probe) == size * (size + 1) / 2).all())
        if not right:
            logger.warning("the one-shot all-reduce summed wrongly; using NCCL's")
        return found if _all_agree(right, group, device) else None

    def applies(self, t: torch.Tensor) -> bool:
        """Whether ``t`` takes this path: on CUDA, this dtype, at most ``max_numel``."""
        return t.is_cuda and t.dtype == self.dtype and t.numel() <= self.max_numel

    def __call__(self, t: torch.Tensor) -> torch.Tensor:
        """Sum ``t`` (any shape, ``applies(t)``) over the ranks, in place; returns ``t``."""
        n = t.numel()
        staged = self.buffer[:n]
        staged.copy_(t.reshape(-1))
        out = torch.ops.symm_mem.one_shot_all_reduce(staged, "sum", self.group_name)
        t.copy_(out.view(t.shape))
        return t


def _all_agree(ok: bool, group: Any, device: torch.device) -> bool:
    """Whether ``ok`` holds on every rank of ``group`` (a MIN all-reduce through NCCL)."""
    flag = torch.tensor([int(ok)], dtype=torch.int32, device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=group)
    return bool(flag.item())
