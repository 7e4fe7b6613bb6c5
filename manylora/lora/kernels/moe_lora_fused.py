"""The experts' LoRA terms inside the fused MoE op's own launches: the expand in the grouped
GEMMs' epilogue, the down shrink in the activation (vLLM's ``fused_moe_lora`` semantics,
Punica's BGMV per row, Chen et al. 2023, over the (slot, expert) stacks).

With pair ``p = t * k + j`` of token ``t`` (slot ``s = slot[t]``, -1 a base row) and expert
``e = e[t, j]``, module ``m`` of rank ``r = ranks[s, m]`` (0 for a base row) and the stacks
``[L, E, R, n]`` read as ``[L * E, R, n]`` at ``key = s * E + e``:

* ``moe_lora_gemm_kernel``, one tile of the grouped GEMM (``manylora.ops.triton_fused_moe``'s
  K loop, blocks of pairs sorted by expert), then::

      c      = r(c_p · v[row(p)] @ W[e, n]ᵀ)                      (the base op's value)
      h_m    = r_B(Σ_split buf[split, p, m, :r])                   (the shrink's partials)
      C[p, n] = r(c + c_p · Σ_{i<r} h_m[i] · B_m[key, i, n - col_m])  for n in module m

  ``c_p`` is 1 or the pair's routing weight, ``r`` rounds to C's dtype, ``r_B`` to B's, the
  sums are float32 (``i`` ascending). Module ``m`` holds the columns ``[m · n_m, (m + 1) ·
  n_m)`` (gate then up; down is one module). Rows of rank 0 add nothing (``C = c``
  exactly); nothing of B at or past a rank is read, and a tile whose rows all have rank 0
  reads no B at all.
* ``moe_lora_act_kernel``, program ``(p, split)`` over a ``BLOCK`` of the intermediate
  columns::

      a[p, n] = r(r(silu(g[p, n])) · u[p, n])        (or ``a`` as given: ``SILU`` off)
      buf[split, p, 0, :r] = Σ_{n in split} a[p, n] · A_d[key, :r, n]    (float32)

  the activation of ``manylora.ops.triton_fused.silu_and_mul_triton`` bit for bit, and the
  down GEMM's shrink from the same registers.

The gate/up shrink comes before (``moe_lora_pairs``, by pair), so a layer's LoRA costs one
launch beyond the base op's: ``fused_moe_lora``'s plan for decode-sized batches. Each row
gathers its own B, which suits blocks of a few rows; large batches take the grouped plan of
``fused_moe_lora_kernels`` instead. Grids
come from shapes only: no host synchronisation, CUDA-graph capturable. Under
``TRITON_INTERPRET=1`` 16-bit GEMM operands are widened to float32 (as in the base op).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from manylora.lora.kernels.jit_helpers import TABLE_ARGS, pick
from manylora.lora.kernels.moe_lora_pairs import PAIR_TILE, pair_rank_and_key
from manylora.ops.host_math import cdiv, next_power_of_2
from manylora.ops.triton_fused import GPU_MATH, silu_mul
from manylora.ops.triton_fused_moe import (
    dot_modes,
    moe_block,
    moe_gemm_tile,
    moe_tile_position,
)

#: Ranks whose B rows the epilogue loads together (one round trip to memory for rank ≤ 16).
_RANK_CHUNK = tl.constexpr(16)


# the split stride of the shrink's partials is T k times a constant: not specialized, so that
# the launch classes are the base op's (``moe_token_cases``)
@triton.jit(do_not_specialize=[*TABLE_ARGS, "stride_hs"])
def moe_lora_gemm_kernel(
        a_ptr, w_ptr, c_ptr, topk_w_ptr, sorted_ids_ptr, expert_ids_ptr, total_ptr, h_ptr,
        b0_ptr, b1_ptr, ranks_ptr, slots_ptr, N, K, num_pairs, num_experts, n_module,
        stride_am, stride_we, stride_wn, stride_cm, stride_hs, stride_hp, stride_hm,
        stride_rank, TOP_K: tl.constexpr, A_ROW_DIV: tl.constexpr,
        MUL_ROUTED_WEIGHT: tl.constexpr, DOT_FP32: tl.constexpr, IEEE: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
        MODULES: tl.constexpr, R: tl.constexpr, H_SPLITS: tl.constexpr):
    """Grid ``(blocks * n_tiles,)``: one ``BLOCK_M × BLOCK_N`` tile of ``C`` (module
    docstring), the base op's tile order."""
    pid_m, pid_n = moe_tile_position(N, BLOCK_N)
    if pid_m * BLOCK_M >= tl.load(total_ptr):
        return
    pairs, row_mask, expert, offs_n, col_mask = moe_block(
        sorted_ids_ptr, expert_ids_ptr, pid_m, pid_n, num_pairs, N, BLOCK_M, BLOCK_N)
    # the rows' slots, keys and ranks first: their loads complete under the K loop
    slot = tl.load(slots_ptr + pairs // TOP_K, mask=row_mask, other=-1)
    live = row_mask & (slot >= 0)
    safe_slot = tl.maximum(slot, 0).to(tl.int64)
    key = safe_slot * num_experts + expert
    rank_ptrs = ranks_ptr + safe_slot * stride_rank
    rank0 = tl.load(rank_ptrs, mask=live, other=0)
    rank1 = rank0
    if MODULES == 2:
        rank1 = tl.load(rank_ptrs + 1, mask=live, other=0)
    weight = tl.full((BLOCK_M,), 1.0, dtype=tl.float32)
    if MUL_ROUTED_WEIGHT:
        weight = tl.load(topk_w_ptr + pairs, mask=row_mask, other=0.0).to(tl.float32)
    acc = moe_gemm_tile(a_ptr, w_ptr, (pairs // A_ROW_DIV).to(tl.int64), row_mask, expert,
                        offs_n, col_mask, K, stride_am, stride_we, stride_wn, DOT_FP32, IEEE,
                        BLOCK_M, BLOCK_N, BLOCK_K)
    if MUL_ROUTED_WEIGHT:
        acc = acc * weight[:, None]
    out_dtype: tl.constexpr = c_ptr.dtype.element_ty
    base = acc.to(out_dtype).to(tl.float32)
    pair_rows = pairs.to(tl.int64)
    delta = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for m in tl.static_range(MODULES):
        rank = pick(m, rank0, rank1, rank1)
        col0 = m * n_module
        in_module = (offs_n >= col0) & (offs_n < col0 + n_module) & col_mask
        hits = (pid_n * BLOCK_N < col0 + n_module) & (pid_n * BLOCK_N + BLOCK_N > col0)
        top = tl.where(hits, tl.max(rank, axis=0), 0)
        b_base = pick(m, b0_ptr, b1_ptr, b1_ptr)
        b_ptrs = b_base + key[:, None] * (R * n_module) + (offs_n - col0)[None, :]
        h_ptrs = h_ptr + pair_rows * stride_hp + m * stride_hm
        for r0 in range(0, top, _RANK_CHUNK):
            for i in tl.static_range(_RANK_CHUNK):
                r = r0 + i
                keep = r < rank
                h = tl.zeros((BLOCK_M,), dtype=tl.float32)
                for split in tl.static_range(H_SPLITS):
                    h += tl.load(h_ptrs + split * stride_hs + r, mask=keep, other=0.0)
                h = h.to(b_base.dtype.element_ty).to(tl.float32)
                b = tl.load(b_ptrs + r * n_module, mask=keep[:, None] & in_module[None, :],
                            other=0.0)
                delta += h[:, None] * b.to(tl.float32)
    c_ptrs = c_ptr + pair_rows[:, None] * stride_cm + offs_n[None, :]
    tl.store(c_ptrs, (base + delta * weight[:, None]).to(out_dtype),
             mask=row_mask[:, None] & col_mask[None, :])


@triton.jit(do_not_specialize=TABLE_ARGS)
def moe_lora_act_kernel(
        gu_ptr, act_ptr, a_ptr, h_ptr, ranks_ptr, slots_ptr, ids_ptr, num_experts, n_inter,
        num_pairs, stride_gu, stride_act, stride_rank, TOP_K: tl.constexpr,
        R: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK: tl.constexpr, SILU: tl.constexpr,
        GPU_MATH: tl.constexpr):
    """Grid ``(T * k, splits)``: ``a`` of one pair's ``BLOCK`` columns (``SILU``; else read
    from ``act``) and its down shrink partial ``buf[split, p, 0, :]`` (module docstring;
    zero past the rank, not written for rank 0)."""
    p = tl.program_id(0)
    split = tl.program_id(1)
    cols = split * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_inter
    act_row = act_ptr + p.to(tl.int64) * stride_act
    if SILU:
        gu_row = gu_ptr + p.to(tl.int64) * stride_gu
        g = tl.load(gu_row + cols, mask=mask, other=0.0).to(tl.float32)
        u = tl.load(gu_row + n_inter + cols, mask=mask, other=0.0).to(tl.float32)
        a = silu_mul(g, u, act_ptr.dtype.element_ty, GPU_MATH)
        tl.store(act_row + cols, a, mask=mask)
    else:
        a = tl.load(act_row + cols, mask=mask, other=0.0).to(tl.float32)
    rank, key = pair_rank_and_key(slots_ptr, ids_ptr, ranks_ptr, stride_rank, num_experts, p,
                                  0, TOP_K)
    if rank > 0:
        offs_r = tl.arange(0, BLOCK_R)
        a_ptrs = a_ptr + key * (R * n_inter) + offs_r[:, None] * n_inter + cols[None, :]
        at = tl.load(a_ptrs, mask=(offs_r < rank)[:, None] & mask[None, :], other=0.0)
        part = tl.sum(at.to(tl.float32) * a[None, :], axis=1)
        tl.store(h_ptr + (split * num_pairs + p).to(tl.int64) * BLOCK_R + offs_r, part)


def lora_grouped_gemm(a: torch.Tensor, w: torch.Tensor, out: torch.Tensor,
                      topk_weights: torch.Tensor | None, sorted_ids: torch.Tensor,
                      expert_ids: torch.Tensor, total: torch.Tensor, row_div: int,
                      config: tuple[int, int, int, int, int], buf: torch.Tensor,
                      b_stacks: tuple[torch.Tensor, ...], ranks: torch.Tensor,
                      token_slots: torch.Tensor, top_k: int) -> None:
    """One launch of ``moe_lora_gemm_kernel``: ``out [T k, S n]`` (``S`` modules of ``n``
    columns) from the rows of ``a`` and ``w [E, S n, K]`` on the base op's alignment and
    config, with the LoRA terms of ``buf``'s shrink through ``b_stacks``.

    Args:
        buf: float32 ``[splits, T k, S, ≥ R]`` shrink partials (any strides; unit stride
            along the rank).
        b_stacks: ``S`` B stacks ``[L, E, R, n]``, contiguous, one dtype, the scaling folded
            in.
        ranks: int32 ``[L, S]`` view of the rank table (unit column stride).
        token_slots: int32 ``[T]``; top_k: ``k``.
    """
    block_m, block_n, block_k, warps, stages = config
    num_pairs, n = out.shape
    max_loras, num_experts, max_rank, n_module = b_stacks[0].shape
    grid = (cdiv(sorted_ids.numel(), block_m) * cdiv(n, block_n),)
    dot_fp32, ieee = dot_modes(a)
    moe_lora_gemm_kernel[grid](
        a, w, out, out if topk_weights is None else topk_weights, sorted_ids, expert_ids,
        total, buf, b_stacks[0], b_stacks[-1], ranks, token_slots, n, w.shape[2], num_pairs,
        num_experts, n_module, a.stride(0), w.stride(0), w.stride(1), out.stride(0),
        buf.stride(0), buf.stride(1), buf.stride(2), ranks.stride(0), TOP_K=top_k,
        A_ROW_DIV=row_div, MUL_ROUTED_WEIGHT=topk_weights is not None, DOT_FP32=dot_fp32,
        IEEE=ieee, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, MODULES=len(b_stacks),
        R=max_rank, H_SPLITS=buf.shape[0], num_warps=warps, num_stages=stages)


def act_and_down_shrink(gate_up: torch.Tensor, act: torch.Tensor | None,
                        a_down: torch.Tensor, ranks: torch.Tensor, topk_ids: torch.Tensor,
                        token_slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(a, buf)``: the activations ``a = silu_and_mul(gate_up)`` (``act`` None) or ``act``
    as given, and the down shrink's float32 partials ``buf [splits, T k, 1, BLOCK_R]`` of
    ``a`` through ``a_down [L, E, R, I]`` (one launch).

    Args:
        gate_up: ``[T k, 2 I]`` the first GEMM's output (with its LoRA terms), unit column
            stride.
        act: None, or ``[T k, I]`` activations computed elsewhere (unit column stride).
        a_down: contiguous; ranks: int32 ``[L, 1]`` view of the down rank column.
        topk_ids: int ``[T, k]``; token_slots: int32 ``[T]``.
    """
    num_pairs, n_inter = gate_up.shape[0], gate_up.shape[1] // 2
    max_rank = a_down.shape[2]
    block_r = next_power_of_2(max_rank)
    block = max(16, min(PAIR_TILE // block_r, next_power_of_2(n_inter)))
    splits = cdiv(n_inter, block)
    silu = act is None
    if silu:
        act = torch.empty(num_pairs, n_inter, dtype=gate_up.dtype, device=gate_up.device)
    buf = torch.empty(splits, num_pairs, 1, block_r, dtype=torch.float32,
                      device=gate_up.device)
    if num_pairs:
        moe_lora_act_kernel[(num_pairs, splits)](
            gate_up, act, a_down, buf, ranks, token_slots, topk_ids.reshape(-1),
            a_down.shape[1], n_inter, num_pairs, gate_up.stride(0), act.stride(0),
            ranks.stride(0), TOP_K=topk_ids.shape[1], R=max_rank, BLOCK_R=block_r,
            BLOCK=block, SILU=silu, GPU_MATH=GPU_MATH, num_warps=4, enable_fp_fusion=False)
    return act, buf
