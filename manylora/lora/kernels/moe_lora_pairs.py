"""The gate/up shrink of the experts' LoRA by (token, expert) pair, straight from the routing:
no alignment (Punica's BGMV, Chen et al. 2023, over the (slot, expert) stacks of vLLM's
``fused_moe_lora``).

For decode-sized batches each (slot, expert) holds about one of the ``T * k`` pairs, so a
grouped launch (``fused_moe_lora_kernels``: pairs sorted by (slot, expert), a 16-row block
per group) spends a block and an alignment of its own on one row. Here pair ``p = t * k + j``
and module ``m`` are taken from the routing: with ``s = slot[t]``, ``e = e[t, j]``, ``r =
ranks[s, m]`` and the stacks ``[L, E, R, K]`` read as ``[L * E, R, K]`` at row ``s * E +
e``::

    buf[split, p, m, :] = v[row(p), split's K] @ A_m[s, e, :r, split's K]ᵀ    (float32)

zero past the rank; ``v`` is the first GEMM's input (``row(p) = p // k``) or the
activations (``row(p) = p``). Program ``(p, split, m)`` reduces one split of K
(``_TILES_PER_PROGRAM`` tiles of ``PAIR_TILE`` elements): short loops in many programs keep
each pair's bytes in flight together. The consumer sums the splits in order
(``moe_lora_fused``'s GEMM epilogue). A program returns before it reads anything else when
``s = -1`` (a base-model row) or ``r = 0``, and then writes nothing; A rows at or past ``r``
are never read. The products are float32 multiply-adds on the vector units (one row: no
``tl.dot``), the same on every backend, in the interpreter too. Grids come from shapes only:
no host synchronisation, CUDA-graph capturable.

Each pair reads its own A, so pairs that share a (slot, expert) read it again (from L2 when
they run together); ``fused_moe_lora.moe_lora_path`` takes this path only while the pairs are
few against the (slot, expert) groups.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from manylora.lora.kernels.jit_helpers import TABLE_ARGS, pick, slot_rank
from manylora.ops.host_math import cdiv, next_power_of_2

#: Elements of one ``[BLOCK_R, BLOCK_K]`` A tile.
PAIR_TILE = 4096
#: Tiles each program's K loop walks: the rest is split over programs, so that each pair's
#: bytes are in flight at once rather than one tile after another.
_TILES_PER_PROGRAM = 2


@triton.jit
def pair_rank_and_key(slots_ptr, ids_ptr, ranks_ptr, stride_rank, num_experts, p, m,
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
    rank, key = pair_rank_and_key(slots_ptr, ids_ptr, ranks_ptr, stride_rank, num_experts, p,
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


def _split(width: int, block: int) -> tuple[int, int]:
    """``(splits, per_split)`` of a loop over ``width`` in steps of ``block``."""
    per_split = block * _TILES_PER_PROGRAM
    return cdiv(width, per_split), per_split


def moe_lora_pair_shrink(v: torch.Tensor, a_stacks: tuple[torch.Tensor, ...],
                         ranks: torch.Tensor, topk_ids: torch.Tensor,
                         token_slots: torch.Tensor, row_div: int) -> torch.Tensor:
    """float32 ``buf [splits, T k, S, BLOCK_R]``: the shrink partials of ``S`` modules
    (module docstring; rows of skipped pairs are not written), one launch.

    Args:
        v: ``[T * k / row_div, K]`` the GEMM side's input, unit stride along ``K``.
        a_stacks: ``S`` A stacks ``[L, E, R, K]``, contiguous, one dtype.
        ranks: int32 ``[L, S]`` view of the rank table (unit column stride).
        topk_ids: int32 / int64 ``[T, k]``; token_slots: int32 ``[T]`` (-1: base row).
        row_div: pairs per row of ``v``.
    """
    num_pairs = topk_ids.numel()
    max_rank, k_in = a_stacks[0].shape[2:]
    block_r = next_power_of_2(max_rank)
    block_k = max(16, min(PAIR_TILE // block_r, next_power_of_2(k_in)))
    k_splits, k_per_split = _split(k_in, block_k)
    modules = len(a_stacks)
    buf = torch.empty(k_splits, num_pairs, modules, block_r, dtype=torch.float32,
                      device=v.device)
    if num_pairs:
        moe_lora_pair_shrink_kernel[(num_pairs * k_splits, modules)](
            v, a_stacks[0], a_stacks[-1], buf, ranks, token_slots, topk_ids.reshape(-1),
            a_stacks[0].shape[1], k_in, num_pairs, v.stride(0), ranks.stride(0),
            TOP_K=topk_ids.shape[1], V_ROW_DIV=row_div, R=max_rank, BLOCK_R=block_r,
            BLOCK_K=block_k, K_SPLITS=k_splits, K_PER_SPLIT=k_per_split, num_warps=4)
    return buf
