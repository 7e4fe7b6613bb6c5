"""Split-K in one launch: programs that share an output tile each sum a range of K, and the
last of them to finish sums the partials and writes the tile (the "fix-up" of Stream-K,
arXiv 2301.03598, with the partials reduced in split order).

Each program stores its float32 partial ``P[s]`` (``[BLOCK_M, BLOCK_N]``) to a workspace
``ws [S, M, N]``, then adds one to the tile's arrival counter (acquire-release, GPU scope).
The program that finds ``S − 1`` there reads ``P[0] .. P[S − 1]`` back from L2 and writes::

    y[m, n] = round( Σ_{s = 0 .. S−1} P[s][m, n]  (+ b[n]) )

then resets the counter to zero, so the counters are zero between launches: no memset, no
host synchronisation, CUDA-graph safe. The sum order is fixed, so results do not depend on
which program finishes last. Two split launches must not run concurrently on one device
(they share its counters).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

#: Arrival counters per device: the most output tiles one split launch may have.
MAX_SPLIT_TILES = 1 << 14

_counters: dict[torch.device, torch.Tensor] = {}


def arrival_counters(device: torch.device) -> torch.Tensor:
    """The device's int32 ``[MAX_SPLIT_TILES]`` arrival counters, allocated zero on first
    use (before any CUDA-graph capture: the linear methods' warm-ups call it)."""
    if device not in _counters:
        _counters[device] = torch.zeros(MAX_SPLIT_TILES, dtype=torch.int32, device=device)
    return _counters[device]


@triton.jit
def store_split(acc, ws_ptr, count_ptr, b_ptr, y_ptr, offs_m, offs_n, M, N, stride_ym,
                tile, HAS_BIAS: tl.constexpr, SPLIT: tl.constexpr):
    """Write a program's ``acc [BLOCK_M, BLOCK_N]`` (float32) for the output tile numbered
    ``tile``: directly (``SPLIT`` false; ``+ b``, rounded to y's dtype), or as split
    ``program_id(1)`` of ``num_programs(1)`` by the module's protocol."""
    out_mask = (offs_m < M)[:, None] & (offs_n < N)[None, :]
    y_ptrs = y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :]
    if SPLIT:
        splits = tl.num_programs(1)
        tile_ws = offs_m[:, None] * N + offs_n[None, :]
        tl.store(ws_ptr + tl.program_id(1) * M * N + tile_ws, acc, mask=out_mask)
        tl.debug_barrier()
        arrived = tl.atomic_add(count_ptr + tile, 1, sem="acq_rel", scope="gpu")
        if arrived == splits - 1:
            tl.debug_barrier()
            total = tl.zeros_like(acc)
            for part in range(0, splits):
                total += tl.load(ws_ptr + part * M * N + tile_ws, mask=out_mask, other=0.0,
                                 cache_modifier=".cg")
            if HAS_BIAS:
                total += tl.load(b_ptr + offs_n, mask=offs_n < N,
                                 other=0.0).to(tl.float32)[None, :]
            tl.store(y_ptrs, total.to(y_ptr.dtype.element_ty), mask=out_mask)
            tl.atomic_xchg(count_ptr + tile, 0, sem="relaxed", scope="gpu")
    else:
        if HAS_BIAS:
            acc += tl.load(b_ptr + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)[None, :]
        tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=out_mask)


def split_workspace(splits: int, m: int, n: int, y: torch.Tensor
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(workspace, counters)`` for a launch of ``splits`` splits writing ``y [m, n]``:
    float32 ``[splits, m, n]`` and the device's counters, or ``(y, y)`` (unused) for one
    split."""
    if splits == 1:
        return y, y
    ws = torch.empty(splits, m, n, dtype=torch.float32, device=y.device)
    return ws, arrival_counters(y.device)


def whole_step_splits(steps: int, splits: int) -> tuple[int, int]:
    """``(steps per split, splits)`` for ``steps`` K steps asked to split ``splits`` ways:
    each split a whole number of steps (its start a multiple of the step, which the kernel
    sees as aligned), and no split left empty."""
    per_split = triton.cdiv(steps, splits)
    return per_split, triton.cdiv(steps, per_split)


def split_count(tiles: int, steps: int, programs_per_sm: int, device: torch.device) -> int:
    """Splits of K for ``tiles`` output tiles over ``steps`` K steps: enough programs for
    ``programs_per_sm`` per streaming multiprocessor (one split on CPU or past
    ``MAX_SPLIT_TILES`` tiles), at most one per step."""
    if device.type != "cuda" or tiles > MAX_SPLIT_TILES:
        return 1
    return max(1, min(steps, triton.cdiv(programs_per_sm * _sm_count(device), tiles)))


@functools.cache
def _sm_count(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count
