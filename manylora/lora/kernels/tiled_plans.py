"""Launch heuristics of the tiled LoRA kernels (``lora/kernels/tiled_kernels.py``).

Every launch is sized from host ints only (the tile count, ``BLOCK_M`` and the tensor
shapes), never from tensor contents, so that the launches are CUDA-graph safe; block sizes
come from shape heuristics (no autotuning). ``tiled_row_cases`` enumerates every distinct plan
the steps of an engine can produce (for the compile warm-up).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import NamedTuple

from manylora.lora.kernels.plans import _TARGET_PROGRAMS, _pow2_floor, _split_k
from manylora.lora.kernels.row_tiles import max_row_tiles
from manylora.ops.host_math import cdiv, next_power_of_2

#: Row-tile heights the tiled variant uses. 16 is the smallest ``tl.dot`` M on tensor cores;
#: a shorter tile costs the same memory traffic (masked rows are not loaded).
TILE_BLOCK_MS = (16, 32, 64)


class TiledPlan(NamedTuple):
    """One launch of a tiled LoRA kernel, from host ints only.

    Attributes:
        grid: the launch grid.
        constexprs: the compile-time constants (with ``num_warps``): what selects a compiled
            specialization, with the dtypes and the run-time ints' divisibility; the
            shrink's ``K_PER_SPLIT`` (the ``in`` columns each split-K program reduces).
        n_tiles: expand only: output tiles per row tile.
    """

    grid: tuple[int, ...]
    constexprs: dict
    n_tiles: int = 0


def _block_r(max_rank: int) -> int:
    return max(16, min(next_power_of_2(max_rank), 64))


def tiled_shrink_plan(num_tiles: int, block_m: int, k: int, max_rank: int, num_slices: int,
                      element_size: int, dot_fp32: bool = False) -> TiledPlan:
    """The launch of ``lora_shrink_tiled`` over ``num_tiles`` row tiles of ``block_m`` rows,
    ``in = k``, A stacks ``[max_loras, max_rank, k]`` of ``element_size``-byte elements
    (``dot_fp32``: bfloat16 under the interpreter). Ranks in tiles of 16-64; a ``k`` step
    whose x and A tiles fit 32 KiB (16-bit) or 16 KiB (float32); split-K up to
    ``_TARGET_PROGRAMS`` programs (``ATOMIC`` when split).

    Raises:
        ValueError: ``block_m`` not in ``TILE_BLOCK_MS``.
    """
    if block_m not in TILE_BLOCK_MS:
        raise ValueError(f"tiled LoRA: BLOCK_M {block_m} is not one of {TILE_BLOCK_MS}")
    block_r = _block_r(max_rank)
    tile_bytes = 32768 if element_size == 2 else 16384
    block_k = max(16, min(256, _pow2_floor(tile_bytes // ((block_m + block_r) * element_size))))
    r_tiles = cdiv(max_rank, block_r)
    split, k_per_split = _split_k(k, block_k, max(num_tiles, 1) * r_tiles * num_slices)
    return TiledPlan((num_tiles * r_tiles, split, num_slices),
                     dict(K_PER_SPLIT=k_per_split, R=max_rank, BLOCK_M=block_m, BLOCK_R=block_r,
                          BLOCK_K=block_k, ATOMIC=split > 1, DOT_FP32=dot_fp32, num_warps=4))


def tiled_expand_plan(num_tiles: int, block_m: int, max_n: int, max_rank: int,
                      num_slices: int, has_dora: bool, has_shift: bool,
                      dot_fp32: bool = False) -> TiledPlan:
    """The launch of ``lora_expand_tiled`` over ``num_tiles`` row tiles of ``block_m`` rows
    into slices at most ``max_n`` wide: the widest output tile of 64..256 columns (128 for
    64-row tiles) that still gives ``_TARGET_PROGRAMS`` programs; the rank in tiles of
    16-64.

    Raises:
        ValueError: ``block_m`` not in ``TILE_BLOCK_MS``.
    """
    if block_m not in TILE_BLOCK_MS:
        raise ValueError(f"tiled LoRA: BLOCK_M {block_m} is not one of {TILE_BLOCK_MS}")
    programs = max(num_tiles, 1) * num_slices
    block_n = 256 if block_m <= 32 else 128
    while block_n > 64 and programs * cdiv(max_n, block_n) < _TARGET_PROGRAMS:
        block_n //= 2
    n_tiles = cdiv(max_n, block_n)
    return TiledPlan((num_tiles * n_tiles, num_slices),
                     dict(R=max_rank, BLOCK_M=block_m, BLOCK_N=block_n,
                          BLOCK_R=_block_r(max_rank), DOT_FP32=dot_fp32, HAS_DORA=has_dora,
                          HAS_SHIFT=has_shift, num_warps=4), n_tiles=n_tiles)


def tiled_row_cases(max_rows: int, max_loras: int) -> Iterator[tuple[int, int]]:
    """``(num_tiles, block_m)`` covering every distinct ``tiled_shrink_plan`` /
    ``tiled_expand_plan`` launch of steps of 1..``max_rows`` rows over ``max_loras`` slots:
    the plans see the step only through the tile count (at most ``max_row_tiles``) and
    ``block_m``, and stop changing once the tiles reach ``_TARGET_PROGRAMS``."""
    for block_m in TILE_BLOCK_MS:
        most = max_row_tiles(max_rows, max_loras, block_m)
        for num_tiles in range(1, min(most, _TARGET_PROGRAMS) + 1):
            yield num_tiles, block_m
