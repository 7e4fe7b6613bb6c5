"""Triton kernel: a token bitmask on the logits of the constrained rows
(``ops.token_bitmask``'s formula)::

    logits[bitmask[r, 0], j] = -inf   if (bitmask[r, 1 + j // 32] >> (j % 32)) & 1 == 0

One program per (constrained row, ``BLOCK`` tokens): it loads ``BLOCK / 32`` words, expands
their bits and stores ``-inf`` where a bit is clear; allowed tokens are never written. No
host synchronisation; the row count is the grid only (one compile per vocabulary).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 4096


@triton.jit
def _token_bitmask_kernel(logits_ptr, packed_ptr, vocab, stride_logits, stride_packed,
                          BLOCK: tl.constexpr):
    r = tl.program_id(0)
    start = tl.program_id(1) * BLOCK
    row = tl.load(packed_ptr + r * stride_packed).to(tl.int64)
    words = start // 32 + tl.arange(0, BLOCK // 32)
    bitmask = tl.load(packed_ptr + r * stride_packed + 1 + words,
                     mask=words < (vocab + 31) // 32, other=-1)
    bits = (bitmask[:, None] >> tl.arange(0, 32)[None, :]) & 1
    banned = tl.reshape(bits == 0, (BLOCK,))
    offs = start + tl.arange(0, BLOCK)
    tl.store(logits_ptr + row * stride_logits + offs, float("-inf"),
             mask=banned & (offs < vocab))


def apply_token_bitmask_triton(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
    """Launch ``_token_bitmask_kernel`` over ``bitmask``'s rows (shapes as
    ``ops.token_bitmask.apply_token_bitmask_``; ``logits``' rows contiguous)."""
    num_rows, vocab = bitmask.shape[0], logits.shape[1]
    grid = (num_rows, triton.cdiv(vocab, BLOCK))
    _token_bitmask_kernel[grid](logits, bitmask, vocab, logits.stride(0),
                                bitmask.stride(0), BLOCK=BLOCK)
