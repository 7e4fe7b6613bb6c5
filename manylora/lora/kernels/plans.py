"""Launch heuristics of the LoRA shrink/expand kernels (``manylora.lora.kernels.sgmv_kernels``).

Every launch is sized from host ints only (tensor shapes and the mapping's ``max_seg_len``),
never from tensor contents, so that the launches are CUDA-graph safe; block sizes come from
shape heuristics (no autotuning), after vLLM's punica Triton kernels. ``lora_row_cases``
enumerates every distinct plan a range of step sizes can produce (for the compile warm-up).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import NamedTuple

import torch

from manylora.ops.host_math import cdiv, next_power_of_2

#: The most slices (packed modules) one launch takes.
MAX_SLICES = 3
# Programs to aim for in one launch: ~8 per SM of an H100 (132 SMs) keep HBM busy.
_TARGET_PROGRAMS = 1024


def _split_k(k: int, block_k: int, programs: int) -> tuple[int, int]:
    """``(split_k, k_per_split)``: enough splits of ``k`` that ``programs * split_k`` reaches
    the target, each split a whole number of ``block_k`` blocks."""
    k_blocks = cdiv(k, block_k)
    split = min(k_blocks, next_power_of_2(cdiv(_TARGET_PROGRAMS, programs)))
    k_per_split = cdiv(k_blocks, split) * block_k
    return cdiv(k, k_per_split), k_per_split


def _block_n(programs: int, max_n: int, largest: int) -> int:
    """The widest output tile (64..``largest``) that still gives the target program count."""
    block_n = largest
    while block_n > 64 and programs * cdiv(max_n, block_n) < _TARGET_PROGRAMS:
        block_n //= 2
    return block_n


def interpreted_bf16(t: torch.Tensor) -> bool:
    """Whether ``tl.dot`` must take float32 operands: Triton's interpreter (CPU tensors)
    multiplies bfloat16 tiles as their raw 16-bit patterns. Upcasting is exact (a bf16 x bf16
    product is exact in float32, as in the tensor-core dot with float32 accumulation)."""
    return t.dtype == torch.bfloat16 and t.device.type != "cuda"


def _pow2_floor(n: int) -> int:
    return 1 << (max(n, 1).bit_length() - 1)


def _block_m(max_seg_len: int) -> int:
    return 16 if max_seg_len <= 16 else (32 if max_seg_len <= 32 else 64)


class LaunchPlan(NamedTuple):
    """One launch of a LoRA kernel, from host ints only.

    Attributes:
        kernel: the ``@triton.jit`` kernel's name in ``lora_kernels``.
        grid: the launch grid (up to 3 ints).
        constexprs: the compile-time constants (with ``num_warps``): what selects a compiled
            specialization, with the dtypes and the run-time ints' divisibility.
        k_per_split: shrink only: the ``in`` columns each split-K program reduces.
        n_tiles: SGMV expand only: output tiles per row tile (the grid's first axis is
            ``m_tiles * n_tiles``).
    """

    kernel: str
    grid: tuple[int, ...]
    constexprs: dict
    k_per_split: int = 0
    n_tiles: int = 0


def shrink_plan(variant: str, num_rows: int, max_seg_len: int, max_loras: int, k: int,
                max_rank: int, num_slices: int, element_size: int,
                dot_fp32: bool = False) -> LaunchPlan:
    """The launch of ``lora_shrink_op`` for ``num_rows`` rows (``max_seg_len`` the longest
    SGMV segment) of ``in = k`` over ``num_slices`` A stacks ``[max_loras, max_rank, k]`` of
    ``element_size``-byte elements (``dot_fp32``: bfloat16 under the interpreter). Block
    sizes: SGMV tiles of 16/32/64 rows by ``max_seg_len``, ranks in tiles of 16-64 (BGMV:
    up to 32), a ``k`` step whose x and A tiles fit 32 KiB (16-bit) or 16 KiB (float32);
    split-K up to ``_TARGET_PROGRAMS`` programs (``ATOMIC`` when split)."""
    if variant == "sgmv":
        block_m = _block_m(max_seg_len)
        block_r = max(16, min(next_power_of_2(max_rank), 64))
        # x and A tiles of one k step within 32 KiB (16-bit) or 16 KiB (fp32, FMA dot); the
        # pipeline keeps a few of them in shared memory.
        tile_bytes = 32768 if element_size == 2 else 16384
        block_k = max(16, min(256, _pow2_floor(tile_bytes // ((block_m + block_r) * element_size))))
        m_tiles, r_tiles = cdiv(max_seg_len, block_m), cdiv(max_rank, block_r)
        split, k_per_split = _split_k(
            k, block_k, cdiv(num_rows, block_m) * r_tiles * num_slices)
        return LaunchPlan("sgmv_shrink_kernel", (m_tiles * r_tiles, split, max_loras * num_slices),
                          dict(R=max_rank, NUM_SLICES=num_slices, BLOCK_M=block_m,
                               BLOCK_R=block_r, BLOCK_K=block_k, ATOMIC=split > 1,
                               DOT_FP32=dot_fp32, num_warps=4), k_per_split)
    block_r = min(next_power_of_2(max_rank), 32)
    block_k = max(32, min(512, 4096 // block_r))
    r_tiles = cdiv(max_rank, block_r)
    split, k_per_split = _split_k(k, block_k, num_rows * r_tiles * num_slices)
    return LaunchPlan("bgmv_shrink_kernel", (num_rows * r_tiles, split, num_slices),
                      dict(R=max_rank, BLOCK_R=block_r, BLOCK_K=block_k, ATOMIC=split > 1,
                           num_warps=4), k_per_split)


def expand_plan(variant: str, num_rows: int, max_seg_len: int, max_loras: int, max_n: int,
                max_rank: int, num_slices: int, has_dora: bool, has_shift: bool,
                dot_fp32: bool = False) -> LaunchPlan:
    """The launch of ``lora_expand_op`` for ``num_rows`` rows (``max_seg_len`` the longest
    SGMV segment) into slices at most ``max_n`` wide from rank-major B stacks ``[max_loras,
    max_rank, out_s]`` (``has_dora``: DoRA scales given; ``has_shift``: a bias too). Output
    tiles: the widest of 64..256 columns that still gives
    ``_TARGET_PROGRAMS`` programs; SGMV row tiles as ``shrink_plan``'s; the rank in one tile
    of 16-64 (BGMV: up to 32) columns."""
    flags = dict(R=max_rank, HAS_DORA=has_dora, HAS_SHIFT=has_shift, num_warps=4)
    if variant == "sgmv":
        block_m = _block_m(max_seg_len)
        block_n = _block_n(cdiv(num_rows, block_m) * num_slices, max_n,
                           256 if block_m <= 32 else 128)
        m_tiles, n_tiles = cdiv(max_seg_len, block_m), cdiv(max_n, block_n)
        return LaunchPlan("sgmv_expand_kernel", (m_tiles * n_tiles, max_loras * num_slices),
                          dict(flags, NUM_SLICES=num_slices, BLOCK_M=block_m, BLOCK_N=block_n,
                               BLOCK_R=max(16, min(next_power_of_2(max_rank), 64)),
                               DOT_FP32=dot_fp32), n_tiles=n_tiles)
    block_r = min(next_power_of_2(max_rank), 32)
    block_n = _block_n(num_rows * num_slices, max_n, min(256, max(64, 4096 // block_r)))
    return LaunchPlan("bgmv_expand_kernel", (num_rows, cdiv(max_n, block_n), num_slices),
                      dict(flags, BLOCK_N=block_n, BLOCK_R=block_r))


def lora_row_cases(max_rows: int) -> Iterator[tuple[str, int, int]]:
    """``(variant, num_rows, max_seg_len)`` covering every distinct ``shrink_plan`` /
    ``expand_plan`` launch (kernel and constexprs) of steps of 1..``max_rows`` rows, for any
    projection shape: the plans see the row count only through BGMV's ``num_rows`` and
    SGMV's row-tile count ``cdiv(num_rows, BLOCK_M)`` (with ``BLOCK_M`` from the longest
    segment), and stop changing once those reach ``_TARGET_PROGRAMS``. A padded CUDA-graph
    mapping (``max_seg_len`` = rows) is one of these cases too."""
    for n in range(1, min(max_rows, _TARGET_PROGRAMS) + 1):
        yield "bgmv", n, n
    for block_m, shortest in ((16, 1), (32, 17), (64, 33)):     # the classes of _block_m
        for tiles in range(1, min(cdiv(max_rows, block_m), _TARGET_PROGRAMS) + 1):
            n = min(tiles * block_m, max_rows)
            if n >= shortest:
                yield "sgmv", n, min(n, block_m)
