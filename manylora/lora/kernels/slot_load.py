"""The slot-load scatter: one launch writes a whole adapter from a staging buffer into its slot.

A slot load (``manylora.lora.slot_layout``) copies an adapter's packed host buffer into a
device staging buffer in one host → device copy; this kernel then writes every piece to its
place: the A rows and rank-major B rows of each (layer, module), cut to the tensor-parallel
rank's part, the DoRA scales, and the slot's row of the rank / DoRA table. It is a batched
strided 2-D copy over a table of entries (``desc``, int64 ``[E, DESC_COLS]``), in units of
16-bit words (every piece is a whole number of them and 16-byte aligned in the staging
buffer). For entry ``e`` with ``(src_off, src_stride, dst_addr, dst_slot_stride, dst_stride,
n, len)`` and the slot ``slot``::

    for i < n, j < len:
        dst[i * dst_stride + j] = src[src_off + i * src_stride + j]
    where  src = staging viewed as 16-bit words,
           dst = (dst_addr + slot * dst_slot_stride) as a pointer to 16-bit words

(``dst_addr`` and ``dst_slot_stride`` in bytes, the rest in words; ``n * len < 2**31``).
The destinations are ~700 separately allocated slot buffers, so each entry names its own as
an absolute device address (a ``data_ptr`` cast to a pointer in the kernel): one pointer
argument cannot reach them all (offsets from one base would only hide the same absolute
arithmetic), and the buffers are allocated once and never move, so the addresses stay
valid for the engine's life. Programs ``(e, t)`` of a ``[E, PROGRAMS_PER_ENTRY]`` grid
stride over entry ``e``'s ``n * len`` words in ``BLOCK``-word chunks. The copy is
bit-exact, so it serves any dtype (model-dtype A/B, float32 scales, int32 table rows).

Runs on CUDA, and on CPU tensors under ``TRITON_INTERPRET=1`` (host addresses). On CPU
without the interpreter ``scatter_slot`` runs ``scatter_slot_reference``, the same copies in
PyTorch. The op is registered as ``torch.ops.manylora.scatter_slot`` so that a
``TorchDispatchMode`` sees one operation per load.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from manylora.lora.kernels.triton_lora import LIBRARY

#: Columns of one descriptor row (7 used, padded to 64 bytes).
DESC_COLS = 8
#: Words per program iteration.
BLOCK = 2048
#: Programs per entry: enough to spread a large A or B over the GPU, few enough that the
#: ~700 entries of an adapter stay one wave of short programs.
PROGRAMS_PER_ENTRY = 8


@triton.jit(do_not_specialize=["slot"])
def _scatter_slot_kernel(src_ptr, desc_ptr, slot, BLOCK: tl.constexpr):
    """Program ``(e, t)``: chunks ``t, t + P, ...`` of entry ``e``'s ``n * len`` words."""
    e = tl.program_id(0)
    t = tl.program_id(1)
    step = tl.num_programs(1) * BLOCK
    d = desc_ptr + e * 8
    src_off = tl.load(d)
    src_stride = tl.load(d + 1)
    dst_addr = tl.load(d + 2) + slot.to(tl.int64) * tl.load(d + 3)
    dst_stride = tl.load(d + 4)
    row_len = tl.load(d + 6).to(tl.int32)
    total = tl.load(d + 5).to(tl.int32) * row_len        # < 2**31 (checked on the host)
    dst_ptr = dst_addr.to(tl.pointer_type(tl.int16))
    offs = tl.arange(0, BLOCK)
    for start in range(t * BLOCK, total, step):
        idx = start + offs
        mask = idx < total
        row = idx // row_len                                # int32 division
        col = (idx - row * row_len).to(tl.int64)
        row = row.to(tl.int64)
        v = tl.load(src_ptr + src_off + row * src_stride + col, mask=mask)
        tl.store(dst_ptr + row * dst_stride + col, v, mask=mask)


_INTERPRETED = not isinstance(_scatter_slot_kernel, triton.runtime.JITFunction)


def scatter_slot_reference(staging: torch.Tensor, desc: torch.Tensor, slot: int,
                           destinations: Sequence[torch.Tensor]) -> None:
    """PyTorch reference of the scatter (CPU without the interpreter; tests): the same copies,
    one ``as_strided`` copy per entry.

    Args:
        staging: the staging buffer as 16-bit words (int16 ``[W]``).
        desc: int64 ``[E, DESC_COLS]`` on any device.
        slot: the slot written.
        destinations: every tensor an entry may write into (contiguous); each entry's
            address must fall inside one of them.

    Raises:
        ValueError: an entry whose destination is in none of ``destinations``.
    """
    bases = sorted((t.data_ptr(), t.reshape(-1).view(torch.int16)) for t in destinations)
    starts = [b for b, _ in bases]
    for src_off, src_stride, addr, slot_stride, dst_stride, n, n_len, _ in desc.tolist():
        addr += slot * slot_stride
        k = bisect.bisect_right(starts, addr) - 1
        base, words = bases[k] if k >= 0 else (0, None)
        if words is None or (addr - base) // 2 + (n - 1) * dst_stride + n_len > words.numel():
            raise ValueError(f"scatter entry writes to {addr:#x}, outside every destination")
        dst = words.as_strided((n, n_len), (dst_stride, 1), (addr - base) // 2)
        dst.copy_(staging.as_strided((n, n_len), (src_stride, 1), src_off))


def scatter_slot_op(staging: torch.Tensor, desc: torch.Tensor, slot: int) -> None:
    """``manylora::scatter_slot``: the kernel over every row of ``desc`` (module docstring).

    Args:
        staging: int16 ``[W]``, the staging buffer as 16-bit words (CUDA, or CPU under the
            interpreter).
        desc: int64 ``[E, DESC_COLS]`` on ``staging``'s device (a view into the staging
            buffer is fine).
        slot: the slot to write.

    Raises:
        ValueError: tensors of another dtype, layout or device.
    """
    if staging.dtype != torch.int16 or desc.dtype != torch.int64 or desc.dim() != 2 or (
            desc.shape[1] != DESC_COLS) or not desc.is_contiguous():
        raise ValueError(f"scatter_slot: staging {staging.dtype} (int16 expected), descriptors "
                         f"{desc.dtype} {tuple(desc.shape)} (contiguous int64 [E, "
                         f"{DESC_COLS}] expected)")
    if staging.device != desc.device:
        raise ValueError(f"scatter_slot: staging on {staging.device}, descriptors on "
                         f"{desc.device}")
    if desc.shape[0]:
        _scatter_slot_kernel[(desc.shape[0], PROGRAMS_PER_ENTRY)](staging, desc, slot,
                                                                  BLOCK=BLOCK)


def _scatter_slot_fake(staging, desc, slot):
    return None


LIBRARY.define("scatter_slot(Tensor staging, Tensor desc, SymInt slot) -> ()")
LIBRARY.impl("scatter_slot", scatter_slot_op, "CompositeExplicitAutograd")
torch.library.register_fake("manylora::scatter_slot", _scatter_slot_fake, lib=LIBRARY)


def scatter_slot(staging: torch.Tensor, desc: torch.Tensor, slot: int,
                 destinations: Sequence[torch.Tensor]) -> None:
    """Write one adapter from ``staging`` into ``slot``: one launch of the scatter kernel on
    the current stream (CUDA, or CPU under ``TRITON_INTERPRET=1``), else
    ``scatter_slot_reference``.

    Args:
        staging: int16 ``[W]``, the staging buffer as 16-bit words.
        desc: int64 ``[E, DESC_COLS]``, on ``staging``'s device.
        slot: the slot to write.
        destinations: the tensors the entries write into (read only by the reference path).

    Raises:
        ValueError: as ``scatter_slot_op``.
    """
    if staging.is_cuda or _INTERPRETED:
        torch.ops.manylora.scatter_slot(staging, desc, slot)
    else:
        scatter_slot_reference(staging, desc, slot, destinations)
