"""Triton kernels of LoRA on a fused MoE layer's experts: grouped shrink and expand over the
(token, expert) pairs sorted by (adapter slot, expert).

vLLM's ``fused_moe_lora`` design (the punica wrapper's ``add_lora_fused_moe``). The ``T * k``
pairs ``p = t * k + j`` of the LoRA rows (``slot[t] ≥ 0``) are aligned like the base layer's
(``manylora.ops.triton_fused_moe.align_block_size``) on the key ``slot[t] * E + e[t, j]``,
base rows left out, so that every block of ``BLOCK_M`` sorted pairs shares one (slot,
expert) and one launch handles every (token, expert, adapter) triple of a GEMM side. With the
slot stacks ``[L, E, R, n]`` read as ``[L * E, R, n]`` (the key is the row of that view),
for module ``m`` of rank ``r = ranks[slot, m]``::

    shrink:  buffer[p, m, :r] = v[row(p)] @ A_m[slot, e, :r]ᵀ                  (float32)
    expand:  y[p, col_m + n] = r(y[p, col_m + n] + c_p · buffer[p, m, :r] @ B_m[slot, e, :r, n])

with ``v`` the first GEMM's input (x, ``row(p) = p // k``) or the second's (the activations,
``row(p) = p``), ``y`` the base layer's gate/up cache (``col_m = m · I``) or its weighted
down output (``col_m = 0``), ``c_p`` 1 or the pair's routing weight (``MUL_ROUTED_WEIGHT``),
the buffer tile rounded to B's dtype before the expand's dot and ``r`` one rounding to
``y``'s dtype. A program reads its (slot, module)'s rank right after the block's key and
returns when the rank is 0 (or its rank tile starts past it), before it reads anything else;
blocks past the padded total (key -1) return at once. Nothing past a rank is read.

The loops are ``manylora.lora.kernels.jit_helpers``' ``shrink_tile`` / ``expand_tile`` (the
dense SGMV kernels' too). Launch sizes depend on shapes only: fixed worst-case grids, no host
synchronisation, CUDA-graph capturable. Under ``TRITON_INTERPRET=1`` 16-bit operands are
widened to float32 before the dot (as in the dense kernels); float32 dots run in IEEE
float32. Launch configs are shape heuristics, not tuned.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from manylora.lora.kernels.jit_helpers import (
    TABLE_ARGS,
    expand_tile,
    pick,
    shrink_tile,
    slot_rank,
)
from manylora.ops.host_math import cdiv, next_power_of_2
from manylora.ops.triton_fused_moe import align_block_size, moe_config

#: Output tile of the expand, ``k`` step of the shrink.
_BLOCK_N = 64
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


@triton.jit(do_not_specialize=[*TABLE_ARGS, *_ALIGN_PTRS])
def moe_lora_expand_kernel(
        buf_ptr, b0_ptr, b1_ptr, y_ptr, topk_w_ptr, ranks_ptr, sorted_ids_ptr, block_keys_ptr,
        num_experts, N, num_pairs, stride_bt, stride_bs, stride_yt, stride_rank,
        R: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr,
        MUL_ROUTED_WEIGHT: tl.constexpr, DOT_FP32: tl.constexpr):
    """Grid ``(blocks * n_tiles, NUM_SLICES)``: ``y[p, s * N + tile] += (w[p] ·)
    buffer[p, s] @ B_s[key]`` for the block's pairs ``p``, in float32, rounded once."""
    N_TILES = tl.cdiv(N, BLOCK_N)
    block = tl.program_id(0) // N_TILES
    pid_n = tl.program_id(0) % N_TILES
    s = tl.program_id(1)
    key = tl.load(block_keys_ptr + block)
    if key < 0:
        return
    rank = slot_rank(ranks_ptr, stride_rank, key // num_experts, s)
    if rank == 0:
        return
    pairs = tl.load(sorted_ids_ptr + block * BLOCK_M + tl.arange(0, BLOCK_M))
    m_mask = pairs < num_pairs
    rows = pairs.to(tl.int64)
    b_ptr = pick(s, b0_ptr, b1_ptr, b1_ptr)
    acc = expand_tile(buf_ptr, b_ptr, rows, m_mask, key, s, rank, N, pid_n, stride_bt,
                      stride_bs, R, BLOCK_M, BLOCK_N, BLOCK_R, DOT_FP32)
    if MUL_ROUTED_WEIGHT:
        weight = tl.load(topk_w_ptr + pairs, mask=m_mask, other=0.0)
        acc = acc * weight[:, None]
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = m_mask[:, None] & (offs_n < N)[None, :]
    y_ptrs = y_ptr + rows[:, None] * stride_yt + (s * N + offs_n)[None, :]
    y = tl.load(y_ptrs, mask=mask, other=0.0)
    tl.store(y_ptrs, (y.to(tl.float32) + acc).to(y_ptr.dtype.element_ty), mask=mask)


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


class MoELoRAPlan:
    """One step's LoRA launches over a fused MoE layer: the alignment (computed once per
    call, shared by both GEMM sides) and the launch sizes, from shapes only.

    Args:
        topk_ids: int ``[T, k]``; token_slots: int32 ``[T]``.
        num_experts, max_loras, max_rank: ``E``, ``L``, ``R``.
    """

    def __init__(self, topk_ids: torch.Tensor, token_slots: torch.Tensor, num_experts: int,
                 max_loras: int, max_rank: int):
        t, top_k = topk_ids.shape
        num_pairs = t * top_k
        # the base op's block height (from the mean pairs per expert; each expert's are
        # split further over the adapters), so its launch classes are the base op's
        self.block_m = moe_config(t, top_k, num_experts)[0]
        self.block_r = max(16, min(next_power_of_2(max_rank), 64))
        self.num_experts, self.top_k, self.num_pairs, self.max_rank = (
            num_experts, top_k, num_pairs, max_rank)
        self.sorted_ids, self.block_keys, _ = moe_lora_align(
            topk_ids, token_slots, self.block_m, num_experts, max_loras)

    def shrink(self, v: torch.Tensor, stacks: tuple[torch.Tensor, ...], ranks: torch.Tensor,
               row_div: int) -> torch.Tensor:
        """float32 ``[T k, S, R]`` buffer (only the LoRA pairs' columns below their rank
        written) of ``v [rows, K]`` through the ``S`` A stacks ``[L, E, R, K]``, ``ranks`` the
        int32 table columns of those modules (a view, unit column stride)."""
        buf = torch.empty(self.num_pairs, len(stacks), self.max_rank, dtype=torch.float32,
                          device=v.device)
        a0, a1 = stacks[0], stacks[-1]
        dot_fp32 = a0.dtype != v.dtype or (v.device.type != "cuda" and v.dtype != torch.float32)
        grid = (self.block_keys.numel() * cdiv(self.max_rank, self.block_r), len(stacks))
        moe_lora_shrink_kernel[grid](
            v, a0, a1, buf, ranks, self.sorted_ids, self.block_keys, self.num_experts,
            v.shape[1], self.num_pairs, v.stride(0), buf.stride(0), buf.stride(1),
            ranks.stride(0), A_ROW_DIV=row_div, R=self.max_rank, BLOCK_M=self.block_m,
            BLOCK_R=self.block_r, BLOCK_K=_BLOCK_K, DOT_FP32=dot_fp32, num_warps=4)
        return buf

    def expand(self, y: torch.Tensor, buf: torch.Tensor, stacks: tuple[torch.Tensor, ...],
               ranks: torch.Tensor, topk_weights: torch.Tensor | None) -> None:
        """Add ``buf @ B`` (weighted by ``topk_weights [T k]`` when given) into the columns
        ``[s N, (s + 1) N)`` of ``y [T k, S N]`` in place, the ``S`` B stacks
        ``[L, E, R, N]``."""
        b0, b1 = stacks[0], stacks[-1]
        n = b0.shape[3]
        dot_fp32 = y.device.type != "cuda" and b0.dtype != torch.float32
        grid = (self.block_keys.numel() * cdiv(n, _BLOCK_N), len(stacks))
        moe_lora_expand_kernel[grid](
            buf, b0, b1, y, y if topk_weights is None else topk_weights, ranks,
            self.sorted_ids, self.block_keys, self.num_experts, n, self.num_pairs,
            buf.stride(0), buf.stride(1), y.stride(0), ranks.stride(0), R=self.max_rank,
            BLOCK_M=self.block_m, BLOCK_N=_BLOCK_N, BLOCK_R=self.block_r,
            MUL_ROUTED_WEIGHT=topk_weights is not None, DOT_FP32=dot_fp32, num_warps=4)
