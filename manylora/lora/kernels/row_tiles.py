"""Row tiles of the tiled LoRA variant: each slot's rows cut into tiles of at most BLOCK_M.

The host half of ``lora/kernels/triton_lora_tiled.py``: a step's LoRA rows, grouped by slot as
Punica's SGMV segments (``lora.punica.lora_kernel_meta_arrays``), are cut into tiles of at most
``block_m`` consecutive rows of one slot, with numpy vector ops (``repeat`` / ``cumsum``; no
per-row or per-slot Python). A kernel program then owns one tile and reads its adapter's
tiles once for all of the tile's rows.

A slot of ``n`` rows gives ``ceil(n / block_m)`` tiles, so ``a`` active slots over ``N`` rows
give at most ``(N + a * (block_m - 1)) / block_m`` tiles, and never more than ``N``. With
``a <= min(max_loras, N)`` that bound, ``max_row_tiles``, depends only on the row count (and
the engine's ``max_loras`` and ``block_m``): a CUDA graph captured for a padded row count
launches that many tile programs, and the tiles past the step's own are padding (slot -1).
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np


class RowTileArrays(NamedTuple):
    """The host (numpy) tile arrays of a step.

    Attributes:
        tile_slot: int32 ``[num_tiles]``, each tile's slot; -1 for padding tiles.
        tile_start: int32 ``[num_tiles]``, the tile's first index into ``sorted_rows``
            (0 for padding tiles).
        tile_len: int32 ``[num_tiles]``, the tile's rows, 1..``block_m`` (0 for padding).
        num_real: tiles that hold rows (the rest is padding).
    """

    tile_slot: np.ndarray
    tile_start: np.ndarray
    tile_len: np.ndarray
    num_real: int


def max_row_tiles(num_rows: int, max_loras: int, block_m: int) -> int:
    """The most tiles of ``block_m`` rows that ``num_rows`` rows over at most ``max_loras``
    slots can need: ``min(N, (N + min(L, N) * (block_m - 1)) // block_m)``.

    Raises:
        ValueError: a negative count or a ``block_m`` below 1.
    """
    if num_rows < 0 or max_loras < 0 or block_m < 1:
        raise ValueError(f"max_row_tiles: rows {num_rows}, max_loras {max_loras}, "
                         f"block_m {block_m}")
    active = min(max_loras, num_rows)
    return min(num_rows, (num_rows + active * (block_m - 1)) // block_m)


def row_tiles(active_slots: np.ndarray, seg_start: np.ndarray, seg_len: np.ndarray,
              block_m: int, pad_to: int | None = None) -> RowTileArrays:
    """Cut each active slot's rows (its segment of ``sorted_rows``) into tiles of at most
    ``block_m`` rows, in segment order.

    Args:
        active_slots, seg_start, seg_len: int ``[max_loras]`` each, as
            ``LoRAKernelMetaArrays`` holds them (active slots first, then -1 / 0).
        block_m: the most rows of a tile.
        pad_to: pad the arrays to this many tiles (slot -1, start 0, length 0); None: the
            exact count.

    Returns:
        The ``RowTileArrays``.

    Raises:
        ValueError: ``block_m`` below 1, or more tiles than ``pad_to``.
    """
    if block_m < 1:
        raise ValueError(f"row tiles of {block_m} rows")
    lens = np.asarray(seg_len, dtype=np.int64)
    num_active = int(np.count_nonzero(lens))
    lens = lens[:num_active]
    per_seg = -(-lens // block_m)
    num_real = int(per_seg.sum())
    total = num_real if pad_to is None else pad_to
    if num_real > total:
        raise ValueError(f"{num_real} row tiles of {block_m} rows do not fit the {total} "
                         f"tiles of the padded mapping")
    seg = np.repeat(np.arange(num_active), per_seg)
    first_tile = np.cumsum(per_seg) - per_seg
    offset = (np.arange(num_real) - first_tile[seg]) * block_m
    tile_slot = np.full(total, -1, dtype=np.int32)
    tile_start = np.zeros(total, dtype=np.int32)
    tile_len = np.zeros(total, dtype=np.int32)
    tile_slot[:num_real] = np.asarray(active_slots)[:num_active][seg]
    tile_start[:num_real] = np.asarray(seg_start)[:num_active][seg] + offset
    tile_len[:num_real] = np.minimum(block_m, lens[seg] - offset)
    return RowTileArrays(tile_slot, tile_start, tile_len, num_real)
