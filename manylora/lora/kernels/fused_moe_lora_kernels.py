"""The grouped gate/up shrink of LoRA on a fused MoE layer's experts: the (token, expert)
pairs sorted by (adapter slot, expert).

vLLM's ``fused_moe_lora`` design (the punica wrapper's ``add_lora_fused_moe``). The ``T * k``
pairs ``p = t * k + j`` of the LoRA rows (``slot[t] ≥ 0``) are aligned like the base layer's
(``manylora.ops.triton_fused_moe.align_block_size``) on the key ``slot[t] * E + e[t, j]``,
base rows left out, so that every block of ``BLOCK_M`` sorted pairs shares one (slot,
expert) and reads its A once for all its pairs (large batches, prefill). With the slot stacks
``[L, E, R, K]`` read as ``[L * E, R, K]`` (the key is the row of that view), for module
``m`` of rank ``r = ranks[slot, m]``::

    buffer[p, m, :r] = v[row(p)] @ A_m[slot, e, :r]ᵀ                  (float32)

with ``v`` the first GEMM's input (x, ``row(p) = p // k``) or the activations (``row(p) =
p``). ``moe_lora_fused``'s GEMM epilogue consumes the buffer (the expand). A program reads
its (slot, module)'s rank right after the block's key and returns when the rank is 0 (or its
rank tile starts past it), before it reads anything else; blocks past the padded total (key
-1) return at once. Nothing past a rank is read, and columns at or past it are not written.

The loop is ``manylora.lora.kernels.jit_helpers``' ``shrink_tile`` (the dense SGMV kernels'
too). Launch sizes depend on shapes only: fixed worst-case grids, no host synchronisation,
CUDA-graph capturable. Under ``TRITON_INTERPRET=1`` 16-bit operands are widened to float32
before the dot (as in the dense kernels); float32 dots run in IEEE float32. Launch configs
are shape heuristics, not tuned.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from manylora.lora.kernels.jit_helpers import TABLE_ARGS, pick, shrink_tile, slot_rank
from manylora.ops.host_math import cdiv, next_power_of_2
from manylora.ops.triton_fused_moe import align_block_size, moe_config

#: ``k`` step of the shrink.
_BLOCK_K = 64
_ALIGN_PTRS = ["sorted_ids_ptr", "block_keys_ptr"]


@triton.jit(do_not_specialize=[*TABLE_ARGS, *_ALIGN_PTRS])
def moe_lora_shrink_kernel(
        x_ptr, a0_ptr, a1_ptr, out_ptr, ranks_ptr, sorted_ids_ptr, block_keys_ptr,
        num_experts, K, num_pairs, stride_xt, stride_ot, stride_os, stride_rank,
        A_ROW_DIV: tl.constexpr, R: tl.constexpr, BLOCK_M: tl.constexpr,
        BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, DOT_FP32: tl.constexpr):
    """Grid ``(blocks * r_tiles, NUM_SLICES)``: ``buffer[p, s, tile] = x[p // A_ROW_DIV] @
    A_s[key]ᵀ`` for the block's pairs ``p`` (module ``s``: A ``a0`` or ``a1``)."""
    R_TILES: tl.constexpr = (R + BLOCK_R - 1) // BLOCK_R
    block = tl.program_id(0) // R_TILES
    pid_r = tl.program_id(0) % R_TILES
    s = tl.program_id(1)
    key = tl.load(block_keys_ptr + block)
    if key < 0:
        return
    rank = slot_rank(ranks_ptr, stride_rank, key // num_experts, s)
    if pid_r * BLOCK_R >= rank:
        return
    pairs = tl.load(sorted_ids_ptr + block * BLOCK_M + tl.arange(0, BLOCK_M))
    m_mask = pairs < num_pairs
    rows = (pairs // A_ROW_DIV).to(tl.int64)
    a_ptr = pick(s, a0_ptr, a1_ptr, a1_ptr)
    acc = shrink_tile(x_ptr, a_ptr, rows, m_mask, key, rank, pid_r, 0, K, K, stride_xt, 1,
                      R, BLOCK_M, BLOCK_R, BLOCK_K, DOT_FP32)
    offs_r = pid_r * BLOCK_R + tl.arange(0, BLOCK_R)
    out_ptrs = (out_ptr + pairs.to(tl.int64)[:, None] * stride_ot + s * stride_os
                + offs_r[None, :])
    tl.store(out_ptrs, acc, mask=m_mask[:, None] & (offs_r < rank)[None, :])


def moe_lora_align(topk_ids: torch.Tensor, token_slots: torch.Tensor, block_m: int,
                   num_experts: int, max_loras: int
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The LoRA rows' (token, expert) pairs sorted by ``(slot, expert)``, each run padded to
    ``block_m``, base rows left out (vLLM's ``moe_lora_align_block_size``).

    Args:
        topk_ids: int32 / int64 ``[T, k]`` expert ids in ``[0, num_experts)``.
        token_slots: int32 ``[T]``, slots in ``[0, max_loras)`` or -1 (not checked).
        block_m: rows of one block, ≥ 1.
        num_experts, max_loras: ``E``, ``L``.

    Returns:
        ``(sorted_ids, block_keys, total)`` as ``align_block_size``'s over the keys
        ``slot * E + e``; ``sorted_ids`` has the worst-case length
        ``T k + min(L E, T k) (block_m - 1)``.
    """
    num_pairs = topk_ids.numel()
    num_keys = max_loras * num_experts
    slots = token_slots.long()[:, None]
    keys = torch.where(slots >= 0, slots * num_experts + topk_ids.long(), num_keys)
    max_padded = num_pairs + min(num_keys, num_pairs) * (block_m - 1)
    return align_block_size(keys.reshape(-1), block_m, num_keys, max_padded)


def moe_lora_grouped_shrink(v: torch.Tensor, stacks: tuple[torch.Tensor, ...],
                            ranks: torch.Tensor, topk_ids: torch.Tensor,
                            token_slots: torch.Tensor, row_div: int) -> torch.Tensor:
    """float32 ``buf [1, T k, S, R]`` (one split; only the LoRA pairs' columns below their
    rank written) of ``v [rows, K]`` through the ``S`` A stacks ``[L, E, R, K]``: the
    alignment by (slot, expert) and one launch.

    Args:
        v: unit stride along ``K``; stacks: contiguous, one dtype (v's or float32).
        ranks: int32 ``[L, S]`` view of the rank table (unit column stride).
        topk_ids: int ``[T, k]``; token_slots: int32 ``[T]``; row_div: pairs per row of v.
    """
    t, top_k = topk_ids.shape
    max_loras, num_experts, max_rank, _ = stacks[0].shape
    num_pairs = t * top_k
    # the base op's block height (from the mean pairs per expert; each expert's are split
    # further over the adapters), so its launch classes are the base op's
    block_m = moe_config(t, top_k, num_experts)[0]
    block_r = max(16, min(next_power_of_2(max_rank), 64))
    sorted_ids, block_keys, _ = moe_lora_align(topk_ids, token_slots, block_m, num_experts,
                                               max_loras)
    buf = torch.empty(1, num_pairs, len(stacks), max_rank, dtype=torch.float32,
                      device=v.device)
    a0, a1 = stacks[0], stacks[-1]
    dot_fp32 = a0.dtype != v.dtype or (v.device.type != "cuda" and v.dtype != torch.float32)
    grid = (block_keys.numel() * cdiv(max_rank, block_r), len(stacks))
    moe_lora_shrink_kernel[grid](
        v, a0, a1, buf, ranks, sorted_ids, block_keys, num_experts, v.shape[1], num_pairs,
        v.stride(0), buf.stride(1), buf.stride(2), ranks.stride(0), A_ROW_DIV=row_div,
        R=max_rank, BLOCK_M=block_m, BLOCK_R=block_r, BLOCK_K=_BLOCK_K, DOT_FP32=dot_fp32,
        num_warps=4)
    return buf
