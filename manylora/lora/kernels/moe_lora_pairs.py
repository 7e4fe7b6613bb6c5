"""LoRA on a fused MoE layer's experts by (token, expert) pair, straight from the routing:
no alignment (Punica's BGMV, Chen et al. 2023, over the (slot, expert) stacks of vLLM's
``fused_moe_lora``).

For decode-sized batches each (slot, expert) holds about one of the ``T * k`` pairs, so a
grouped launch (``fused_moe_lora_kernels``: pairs sorted by (slot, expert), a 16-row block
per group) spends a block and an alignment of its own on one row. Here pair ``p = t * k + j``
and module ``m`` are taken from the routing: with ``s = slot[t]``, ``e = e[t, j]``, ``r =
ranks[s, m]`` and the stacks ``[L, E, R, n]`` read as ``[L * E, R, n]`` at row ``s * E +
e``::

    h       = r_B(v[row(p)] @ A_m[s, e, :r]ᵀ)                          (float32, then B's dtype)
    y[p, col_m + n] = r(y[p, col_m + n] + c_p · h @ B_m[s, e, :r, n])   (float32 sum)

``v`` is the first GEMM's input (x, ``row(p) = p // k``) or the second's (the activations,
``row(p) = p``); ``y`` is the base layer's gate/up cache (``col_m = m · n_out``) or its
weighted down output; ``c_p`` is 1 or the pair's routing weight; ``r_B`` rounds to B's dtype
and ``r`` once to ``y``'s.

Two launches per GEMM side. The shrink's program ``(p, split, m)`` reduces one split of K
(``_TILES_PER_PROGRAM`` tiles) into a float32 buffer ``[splits, T * k, modules, R]``; the
expand's program ``(p, split, m)`` sums the K splits in order (deterministic, no atomics),
rounds ``h`` to B's dtype and adds one split of N. Short loops in many programs keep each
pair's bytes in flight together. A program returns before it reads anything else when ``s =
-1`` (a base-model row) or ``r = 0``; A and B rows at or past ``r`` are never read. The
products are float32 multiply-adds on the vector units (one row: no ``tl.dot``), the same on
every backend, in the interpreter too. Grids come from shapes only: no host
synchronisation, CUDA-graph capturable.

Each pair reads its own A and B, so pairs that share a (slot, expert) read them again (from
L2 when they run together); ``fused_moe_lora.moe_lora_path`` takes this path only while the
pairs are few against the (slot, expert) groups.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from manylora.lora.kernels.jit_helpers import TABLE_ARGS, pick, slot_rank
from manylora.ops.host_math import cdiv, next_power_of_2

#: Elements of one ``[BLOCK_R, BLOCK_K]`` A tile or ``[BLOCK_R, BLOCK_N]`` B tile.
_TILE = 4096
#: Tiles each program's K (shrink) or N (expand) loop walks: the rest is split over programs,
#: so that each pair's bytes are in flight at once rather than one tile after another.
_TILES_PER_PROGRAM = 2


@triton.jit
def _pair_rank_and_key(slots_ptr, ids_ptr, ranks_ptr, stride_rank, num_experts, p, m,
                       TOP_K: tl.constexpr):
    """``(r, s * E + e)`` of pair ``p`` and module ``m``: ``r = ranks[s, m]``, 0 for a base
    row (``s = -1``; the key is then not read)."""
    slot = tl.load(slots_ptr + p // TOP_K)
    rank = tl.where(slot >= 0, slot_rank(ranks_ptr, stride_rank, tl.maximum(slot, 0), m), 0)
    key = slot.to(tl.int64) * num_experts + tl.load(ids_ptr + p).to(tl.int64)
    return rank, key


@triton.jit(do_not_specialize=TABLE_ARGS)
def moe_lora_pair_shrink_kernel(
        v_ptr, a0_ptr, a1_ptr, buf_ptr, ranks_ptr, slots_ptr, ids_ptr, num_experts, K,
        num_pairs, stride_vt, stride_rank, TOP_K: tl.constexpr, V_ROW_DIV: tl.constexpr,
        R: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr,
        K_SPLITS: tl.constexpr, K_PER_SPLIT: tl.constexpr):
    """Grid ``(T * k * K_SPLITS, modules)``: ``buf[split, p, m, :] = v[row(p), split's K] @
    A_m[s, e, :r, split's K]ᵀ`` (float32, zero past the rank)."""
    p = tl.program_id(0) // K_SPLITS
    split = tl.program_id(0) % K_SPLITS
    m = tl.program_id(1)
    rank, key = _pair_rank_and_key(slots_ptr, ids_ptr, ranks_ptr, stride_rank, num_experts, p,
                                   m, TOP_K)
    if rank == 0:
        return
    offs_r = tl.arange(0, BLOCK_R)
    r_mask = offs_r < rank
    offs_k = split * K_PER_SPLIT + tl.arange(0, BLOCK_K)
    a_ptrs = (pick(m, a0_ptr, a1_ptr, a1_ptr) + key * (R * K) + offs_r[:, None] * K
              + offs_k[None, :])
    v_ptrs = v_ptr + (p // V_ROW_DIV).to(tl.int64) * stride_vt + offs_k
    part = tl.zeros((BLOCK_R, BLOCK_K), dtype=tl.float32)
    for k0 in tl.static_range(0, K_PER_SPLIT, BLOCK_K):
        k_mask = offs_k + k0 < K
        vt = tl.load(v_ptrs + k0, mask=k_mask, other=0.0).to(tl.float32)
        at = tl.load(a_ptrs + k0, mask=r_mask[:, None] & k_mask[None, :],
                     other=0.0).to(tl.float32)
        part += at * vt[None, :]
    out = buf_ptr + ((split * num_pairs + p).to(tl.int64) * tl.num_programs(1) + m) * BLOCK_R
    tl.store(out + offs_r, tl.sum(part, axis=1))


@triton.jit(do_not_specialize=TABLE_ARGS)
def moe_lora_pair_expand_kernel(
        buf_ptr, b0_ptr, b1_ptr, y_ptr, topk_w_ptr, ranks_ptr, slots_ptr, ids_ptr,
        num_experts, N, num_pairs, stride_yt, stride_rank, TOP_K: tl.constexpr,
        R: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr,
        K_SPLITS: tl.constexpr, N_SPLITS: tl.constexpr, N_PER_SPLIT: tl.constexpr,
        MUL_ROUTED_WEIGHT: tl.constexpr):
    """Grid ``(T * k * N_SPLITS, modules)``: ``h = r_B(Σ_split buf[split, p, m])`` (the
    splits summed in order), then ``y[p, m * N + split's N] = r(y + c_p · h @ B_m[s, e,
    :r, split's N])``."""
    p = tl.program_id(0) // N_SPLITS
    split = tl.program_id(0) % N_SPLITS
    m = tl.program_id(1)
    rank, key = _pair_rank_and_key(slots_ptr, ids_ptr, ranks_ptr, stride_rank, num_experts, p,
                                   m, TOP_K)
    if rank == 0:
        return
    offs_r = tl.arange(0, BLOCK_R)
    r_mask = offs_r < rank
    h = tl.zeros((BLOCK_R,), dtype=tl.float32)
    for ks in tl.static_range(K_SPLITS):
        h += tl.load(buf_ptr + ((ks * num_pairs + p).to(tl.int64) * tl.num_programs(1) + m)
                     * BLOCK_R + offs_r)
    b_base = pick(m, b0_ptr, b1_ptr, b1_ptr)
    h = h.to(b_base.dtype.element_ty).to(tl.float32)
    weight = 1.0
    if MUL_ROUTED_WEIGHT:
        weight = tl.load(topk_w_ptr + p)
    offs_n = split * N_PER_SPLIT + tl.arange(0, BLOCK_N)
    b_ptrs = b_base + key * (R * N) + offs_r[:, None] * N + offs_n[None, :]
    y_ptrs = y_ptr + p.to(tl.int64) * stride_yt + m * N + offs_n
    for n0 in tl.static_range(0, N_PER_SPLIT, BLOCK_N):
        n_mask = offs_n + n0 < N
        bt = tl.load(b_ptrs + n0, mask=r_mask[:, None] & n_mask[None, :],
                     other=0.0).to(tl.float32)
        delta = tl.sum(bt * h[:, None], axis=0) * weight
        y = tl.load(y_ptrs + n0, mask=n_mask, other=0.0)
        tl.store(y_ptrs + n0, (y.to(tl.float32) + delta).to(y.dtype), mask=n_mask)


def _split(width: int, block: int) -> tuple[int, int]:
    """``(splits, per_split)`` of a loop over ``width`` in steps of ``block``."""
    per_split = block * _TILES_PER_PROGRAM
    return cdiv(width, per_split), per_split


def moe_lora_pairs(v: torch.Tensor, y: torch.Tensor, a_stacks: tuple[torch.Tensor, ...],
                   b_stacks: tuple[torch.Tensor, ...], ranks: torch.Tensor,
                   topk_ids: torch.Tensor, token_slots: torch.Tensor, row_div: int,
                   topk_weights: torch.Tensor | None) -> None:
    """Add the LoRA terms of ``S`` modules (module docstring) into ``y`` in place: one shrink
    and one expand launch.

    Args:
        v: ``[T * k / row_div, K]`` the GEMM side's input (x: ``row_div = k``; the
            activations: 1), unit stride along ``K``.
        y: ``[T * k, S * N]`` the base GEMM's output by pair, unit stride along columns.
        a_stacks: ``S`` A stacks ``[L, E, R, K]``; b_stacks: ``S`` B stacks ``[L, E, R, N]``
            (rank-major, the scaling folded in); all contiguous, one dtype.
        ranks: int32 ``[L, S]`` view of the rank table (unit column stride).
        topk_ids: int32 / int64 ``[T, k]``; token_slots: int32 ``[T]`` (-1: base row).
        row_div: pairs per row of ``v``.
        topk_weights: float32 ``[T * k]`` to weight each pair's term by, or None.
    """
    num_pairs = topk_ids.numel()
    max_rank, k_in = a_stacks[0].shape[2:]
    n_out = b_stacks[0].shape[3]
    if num_pairs == 0 or max_rank == 0:
        return
    block_r = next_power_of_2(max_rank)
    block_k = max(16, min(_TILE // block_r, next_power_of_2(k_in)))
    block_n = max(16, min(_TILE // block_r, next_power_of_2(n_out)))
    k_splits, k_per_split = _split(k_in, block_k)
    n_splits, n_per_split = _split(n_out, block_n)
    modules = len(a_stacks)
    ids = topk_ids.reshape(-1)
    top_k = topk_ids.shape[1]
    # every (split, pair, module) row is written unless its pair is skipped, and the expand
    # reads only the rows of pairs it does not skip
    buf = torch.empty(k_splits, num_pairs, modules, block_r, dtype=torch.float32,
                      device=v.device)
    moe_lora_pair_shrink_kernel[(num_pairs * k_splits, modules)](
        v, a_stacks[0], a_stacks[-1], buf, ranks, token_slots, ids, a_stacks[0].shape[1],
        k_in, num_pairs, v.stride(0), ranks.stride(0), TOP_K=top_k, V_ROW_DIV=row_div,
        R=max_rank, BLOCK_R=block_r, BLOCK_K=block_k, K_SPLITS=k_splits,
        K_PER_SPLIT=k_per_split, num_warps=4)
    moe_lora_pair_expand_kernel[(num_pairs * n_splits, modules)](
        buf, b_stacks[0], b_stacks[-1], y, y if topk_weights is None else topk_weights,
        ranks, token_slots, ids, a_stacks[0].shape[1], n_out, num_pairs, y.stride(0),
        ranks.stride(0), TOP_K=top_k, R=max_rank, BLOCK_R=block_r, BLOCK_N=block_n,
        K_SPLITS=k_splits, N_SPLITS=n_splits, N_PER_SPLIT=n_per_split,
        MUL_ROUTED_WEIGHT=topk_weights is not None, num_warps=4)
