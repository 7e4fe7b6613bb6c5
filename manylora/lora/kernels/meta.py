"""The per-step LoRA kernel metadata every LoRA-aware layer reads (Punica's indices; vLLM
calls it ``LoRAKernelMeta``): which adapter slot each token row uses.

Built once per step by the model runner (vLLM's ``token_lora_mapping``) and passed,
unchanged, to every LoRA-aware linear of the forward pass. It carries both views the
kernels need:

* the gather view (BGMV): ``token_lora_indices[t]``, the slot of every row;
* the segment view (SGMV): the LoRA rows sorted by slot (``sorted_rows``), and for the
  ``i``-th slot present in the step ``active_slots[i]``, its rows
  ``sorted_rows[seg_start[i] : seg_start[i] + seg_len[i]]``.

* the tile view (the tiled variant, ``lora/kernels/triton_lora_tiled.py``): each slot's rows cut
  into tiles of at most ``block_m`` rows (``lora/kernels/row_tiles.py``), so a kernel program reads
  its adapter once per tile.

Ranks and DoRA flags are not part of it: they are per (slot, layer, module), in the model's
``SlotTable``, which the kernels read as data (a captured CUDA graph stays valid when
adapters are swapped in and out of slots). An eager step's mapping carries, on the host,
which table columns any of its slots uses (``used_columns``), so that a projection no row
needs launches nothing.

All index tensors are int32 on the model's device and are built from one host buffer with
a single copy (numpy vector ops: a stable ``argsort`` and a ``bincount``, no per-row
Python). A mapping built with ``pad_to`` has the fixed shapes a CUDA graph captures:
padding rows are base rows, ``max_seg_len`` is the padded batch size, and the tile arrays
have ``max_row_tiles(pad_to, max_loras, block_m)`` entries.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import numpy as np
import torch

from manylora.lora.kernels.cost_model import LoRAVariantModel, graph_block_m
from manylora.lora.kernels.row_tiles import max_row_tiles, row_tiles
from manylora.lora.kernels.tiled_plans import TILE_BLOCK_MS

#: The kernel variants a mapping may carry (``lora/kernels/cost_model.py`` picks one per step).
LORA_VARIANTS = ("bgmv", "sgmv", "tiled")


class SlotSegment(NamedTuple):
    """The rows of one adapter slot in this step (host view, for the PyTorch reference).

    Attributes:
        slot: device slot index in ``[0, max_loras)``.
        rows: int32 ``[n]`` indices into the flat token batch, on the model's device (a view
            of ``LoRAKernelMeta.sorted_rows``).
    """

    slot: int
    rows: torch.Tensor


class LoRAKernelMeta(NamedTuple):
    """Which adapter slot each token row uses in this step.

    Attributes:
        token_lora_indices: int32 ``[T]``, the slot of every token row, -1 for base rows.
        sorted_rows: int32 ``[T]``, the rows with an adapter grouped by slot (ascending slot,
            ascending row within a slot), then the base rows.
        active_slots: int32 ``[max_loras]``, the slots present in the step in ascending
            order, then -1.
        seg_start: int32 ``[max_loras]``, where ``active_slots[i]``'s rows start in
            ``sorted_rows`` (0 past the active ones).
        seg_len: int32 ``[max_loras]``, how many rows ``active_slots[i]`` has (0 past them).
        max_seg_len: host int, an upper bound on ``seg_len`` (kernels size their grid by it).
        variant: ``"sgmv"`` (segments), ``"bgmv"`` (per-row gather) or ``"tiled"`` (row
            tiles), the kernel variant.
        has_lora: host bool, whether any row uses an adapter (if not, layers launch nothing).
        segments: one ``SlotSegment`` per slot present (host view; empty when padded).
        tile_slot: int32 ``[num_tiles]``, each row tile's slot, -1 for padding tiles
            (``lora.row_tiles.row_tiles``; empty unless the variant is ``"tiled"``).
        tile_start: int32 ``[num_tiles]``, the tile's first index into ``sorted_rows``.
        tile_len: int32 ``[num_tiles]``, the tile's rows (0 for padding tiles).
        block_m: host int, the most rows of a tile (0 without tiles).
        used_columns: host, per ``SlotTable`` column, whether its LoRA kernels launch: on an
            eager step, whether any slot of the step has a nonzero rank there
            (``used_columns``); on a CUDA-graph step, whether the column's projection kind is
            in the mask the graph is captured for (``SlotTable.mask_columns``). None: every
            LoRA projection launches (its kernels exit early on rank 0).
    """

    token_lora_indices: torch.Tensor
    sorted_rows: torch.Tensor
    active_slots: torch.Tensor
    seg_start: torch.Tensor
    seg_len: torch.Tensor
    max_seg_len: int
    variant: str
    has_lora: bool
    segments: tuple[SlotSegment, ...]
    tile_slot: torch.Tensor
    tile_start: torch.Tensor
    tile_len: torch.Tensor
    block_m: int
    used_columns: tuple[bool, ...] | None = None


class LoRAKernelMetaArrays(NamedTuple):
    """The host (numpy) index arrays of a ``LoRAKernelMeta`` (see its fields), before they are
    copied to the device.

    Attributes:
        token_lora_indices: int32 ``[total]``, each row's slot, -1 for base and padding rows.
        sorted_rows: int32 ``[total]``, LoRA rows by ascending slot (stable), then the base
            rows, then the padding rows.
        active_slots, seg_start, seg_len: int32 ``[max_loras]`` each (-1 / 0 past the
            active slots).
        max_seg_len: the most rows any slot has (0: no LoRA row).
        num_lora_rows: rows with an adapter.
    """

    token_lora_indices: np.ndarray
    sorted_rows: np.ndarray
    active_slots: np.ndarray
    seg_start: np.ndarray
    seg_len: np.ndarray
    max_seg_len: int
    num_lora_rows: int


def lora_kernel_meta_arrays(token_slots: np.ndarray, max_loras: int,
                            total: int | None = None) -> LoRAKernelMetaArrays:
    """Group a step's rows by adapter slot with numpy vector ops (a stable ``argsort`` and
    a ``bincount``; no per-row Python), as Punica's SGMV segments.

    Args:
        token_slots: integer ``[T]``, the slot of every row (-1: the base model).
        max_loras: the number of slots.
        total: pad to this many rows (padding rows are base rows); None: ``T``.

    Returns:
        The ``LoRAKernelMetaArrays``.

    Raises:
        IndexError: a slot outside ``[-1, max_loras)``.
        ValueError: ``total`` below ``T``.
    """
    slots = np.asarray(token_slots, dtype=np.int64).reshape(-1)
    num_rows = slots.size
    total = num_rows if total is None else total
    if total < num_rows:
        raise ValueError(f"pad_to={total} is below the step's {num_rows} rows")
    if num_rows and (slots.min() < -1 or slots.max() >= max_loras):
        bad = slots[(slots < -1) | (slots >= max_loras)][0]
        raise IndexError(f"slot {bad} is outside the {max_loras} adapter slots")
    indices = np.full(total, -1, dtype=np.int32)
    indices[:num_rows] = slots
    key = np.where(indices >= 0, indices, max_loras)          # base and padding rows last
    sorted_rows = np.argsort(key, kind="stable").astype(np.int32)
    counts = np.bincount(slots[slots >= 0], minlength=max_loras)[:max_loras]
    active = np.nonzero(counts)[0]
    num_active = active.size
    active_slots = np.full(max_loras, -1, dtype=np.int32)
    active_slots[:num_active] = active
    seg_len = np.zeros(max_loras, dtype=np.int32)
    seg_len[:num_active] = counts[active]
    seg_start = np.zeros(max_loras, dtype=np.int32)
    if num_active > 1:
        np.cumsum(seg_len[:num_active - 1], out=seg_start[1:num_active])
    num_lora_rows = int(seg_len.sum())
    return LoRAKernelMetaArrays(indices, sorted_rows, active_slots, seg_start, seg_len,
                                int(seg_len.max()) if max_loras else 0, num_lora_rows)


def default_variant(seg_len: np.ndarray, max_loras: int, *, padded_rows: int | None = None,
                     model: LoRAVariantModel | None = None) -> tuple[str, int]:
    """``(variant, block_m)`` for a step whose active slots hold ``seg_len`` rows each: the
    variant of least modelled time (``ops.lora_cost_model.choose_variant``; ``block_m`` 0
    except for ``"tiled"``). A padded (CUDA-graph) step of ``padded_rows`` rows chooses
    between BGMV and tiles of ``graph_block_m(padded_rows, max_loras)`` rows (what its graphs
    are captured with).

    Args:
        seg_len: int ``[n]``, rows per active slot (zeros ignored).
        max_loras: slots.
        padded_rows: a graph step's padded row count; None: an eager step.
        model: the projections, rank and GPU the choice is for; None:
            ``LoRAVariantModel.default()``.
    """
    model = LoRAVariantModel.default() if model is None else model
    return model.choose(seg_len, max_loras, padded_rows=padded_rows,
                        graph_block_m=None if padded_rows is None
                        else graph_block_m(padded_rows, max_loras))


def lora_segment_size(total: int, max_loras: int, num_tiles: int) -> int:
    """int32 elements of a mapping's device buffer (``lora_kernel_meta_from_buffer``'s layout)."""
    return 2 * total + 3 * max_loras + 3 * num_tiles


def fill_lora_segment(out: np.ndarray, arrays: LoRAKernelMetaArrays, block_m: int,
                      num_tiles: int | None = None) -> int:
    """Write a mapping's host buffer (``lora_kernel_meta_from_buffer``'s layout) into ``out``,
    numpy vector ops only; returns the tile count written.

    Args:
        out: int32 ``[>= lora_segment_size(...)]``, written from 0.
        arrays: the step's ``LoRAKernelMetaArrays``.
        block_m: the tile height, 0: no tiles (BGMV / SGMV).
        num_tiles: pad the tile arrays to this many (a graph step: ``max_row_tiles``); None:
            the exact count.

    Raises:
        ValueError: more tiles than ``num_tiles``.
    """
    m = arrays.active_slots.size
    parts = [arrays.token_lora_indices, arrays.sorted_rows, arrays.active_slots,
             arrays.seg_start, arrays.seg_len]
    if block_m:
        tiles = row_tiles(arrays.active_slots, arrays.seg_start, arrays.seg_len, block_m,
                          num_tiles)
        parts += [tiles.tile_slot, tiles.tile_start, tiles.tile_len]
    n = sum(p.size for p in parts)
    np.concatenate(parts, out=out[:n])
    return (n - 2 * arrays.token_lora_indices.size - 3 * m) // 3


def used_columns(ranks_host: np.ndarray, active_slots: np.ndarray) -> tuple[bool, ...]:
    """Which ``SlotTable`` columns any of a step's slots uses (a nonzero rank), one numpy
    reduction over the table's host mirror.

    Args:
        ranks_host: int ``[max_loras, E]``, ``SlotTable.ranks_host``.
        active_slots: int ``[max_loras]``, the step's slots then -1
            (``LoRAKernelMetaArrays.active_slots``).

    Returns:
        ``E`` bools.
    """
    active = active_slots[active_slots >= 0]
    return tuple((ranks_host[active] != 0).any(axis=0).tolist())


def build_lora_kernel_meta(token_slots: Sequence[int], max_loras: int, device: torch.device, *,
                           pad_to: int | None = None, variant: str | None = None,
                           ranks_host: np.ndarray | None = None, block_m: int | None = None,
                           model: LoRAVariantModel | None = None,
                           columns: tuple[bool, ...] | None = None) -> LoRAKernelMeta:
    """Build the step's mapping from the per-token slots (``lora_kernel_meta_arrays``).

    Args:
        token_slots: length ``T``, the slot of every token row (-1 = base model).
        max_loras: the number of adapter slots.
        device: where the index tensors live.
        pad_to: pad to this many rows (base rows) and give the mapping fixed shapes for a
            CUDA graph: ``max_seg_len = pad_to``, no host ``segments``, ``has_lora`` True,
            ``max_row_tiles(pad_to, max_loras, block_m)`` tiles.
        variant: force one of ``LORA_VARIANTS``; by default ``default_variant`` (with
            ``model``).
        ranks_host: ``SlotTable.ranks_host``, for ``used_columns`` (not with ``pad_to``);
            None: no eager skip.
        block_m: the tiled variant's tile height; None: the modelled choice (eager) or
            ``graph_block_m(pad_to, max_loras)`` (padded).
        model: what ``default_variant`` models; None: its default.
        columns: with ``pad_to``, the ``used_columns`` of the mapping (a graph's projection
            mask, ``SlotTable.mask_columns``); None: every column.

    Returns:
        The ``LoRAKernelMeta``; its int32 tensors come from one host → device copy (pinned and
        non-blocking on CUDA).

    Raises:
        IndexError: a slot outside ``[-1, max_loras)``.
        ValueError: ``pad_to`` below the number of rows, a ``ranks_host`` of another slot
            count, an unknown ``variant``, or a ``block_m`` the tiled kernels do not take.
    """
    if variant not in (None, *LORA_VARIANTS):
        raise ValueError(f"unknown LoRA kernel variant {variant!r}: use one of "
                         f"{LORA_VARIANTS}")
    if ranks_host is not None and ranks_host.shape[0] != max_loras:
        raise ValueError(f"a rank table of {ranks_host.shape[0]} slots for {max_loras}")
    arrays = lora_kernel_meta_arrays(np.asarray(token_slots, dtype=np.int64), max_loras, pad_to)
    total = arrays.token_lora_indices.size
    if variant is None:
        variant, chosen = default_variant(arrays.seg_len, max_loras, padded_rows=pad_to,
                                            model=model)
        block_m = chosen if block_m is None else block_m
    if variant != "tiled":
        block_m = 0
    elif block_m is None:
        block_m = (graph_block_m(pad_to, max_loras) if pad_to is not None
                   else default_variant(arrays.seg_len, max_loras, model=model)[1] or 16)
    if variant == "tiled" and block_m not in TILE_BLOCK_MS:
        raise ValueError(f"tiled LoRA: block_m {block_m} is not one of {TILE_BLOCK_MS}")
    bound = max_row_tiles(total, max_loras, block_m) if block_m else 0
    host = torch.empty(lora_segment_size(total, max_loras, bound), dtype=torch.int32,
                       pin_memory=torch.device(device).type == "cuda")
    written = fill_lora_segment(host.numpy(), arrays, block_m,
                                bound if pad_to is not None else None)
    host = host[:lora_segment_size(total, max_loras, written)]
    return lora_kernel_meta_from_buffer(host.to(device, non_blocking=True), total, max_loras,
                                        arrays.max_seg_len, variant, padded=pad_to is not None,
                                        ranks_host=ranks_host, host=host.numpy(),
                                        num_tiles=written, block_m=block_m, columns=columns)


def lora_kernel_meta_from_buffer(buf: torch.Tensor, total: int, max_loras: int, max_seg_len: int,
                                 variant: str, *, padded: bool,
                                 ranks_host: np.ndarray | None = None,
                                 host: np.ndarray | None = None, num_tiles: int = 0,
                                 block_m: int = 0,
                                 columns: tuple[bool, ...] | None = None) -> LoRAKernelMeta:
    """A ``LoRAKernelMeta`` whose int32 tensors are views of ``buf``, laid out as
    ``[token_lora_indices total | sorted_rows total | active_slots L | seg_start L |
    seg_len L | tile_slot NT | tile_start NT | tile_len NT]`` (``L = max_loras``,
    ``NT = num_tiles``), as ``fill_lora_segment`` fills it.

    Args:
        buf: int32 ``[lora_segment_size(total, max_loras, num_tiles)]`` on the device.
        total: rows, padding included.
        max_loras: slots.
        max_seg_len: the most rows of one slot (``LoRAKernelMetaArrays.max_seg_len``).
        variant: one of ``LORA_VARIANTS``.
        padded: for a CUDA graph: ``max_seg_len = total``, ``has_lora`` True, and
            ``used_columns`` = ``columns``.
        ranks_host: ``SlotTable.ranks_host``; with ``host``, an unpadded mapping gets
            ``used_columns``.
        host: the host copy of ``buf`` (numpy int32, same layout).
        num_tiles: the tile arrays' length (0 without tiles).
        block_m: the tiles' height (0 without tiles).
        columns: a padded mapping's ``used_columns`` (the columns of the projection mask
            its graph is captured for, ``SlotTable.mask_columns``); None: every column.

    The host ``segments`` (read only by the PyTorch references) are built when ``buf`` is
    on the CPU, from ``buf`` itself, padded or not; a CUDA mapping has none (the Triton
    path reads the tensors).
    """
    nt = num_tiles
    (indices, srows, act, start, length, t_slot, t_start, t_len) = buf.split(
        (total, total, max_loras, max_loras, max_loras, nt, nt, nt))
    tiles = (t_slot, t_start, t_len, block_m)
    segments = ()
    if not buf.is_cuda and (max_seg_len or padded):
        num_active = int((length > 0).sum())
        segments = tuple(
            SlotSegment(s, srows[b: b + n])
            for s, b, n in zip(act[:num_active].tolist(), start[:num_active].tolist(),
                               length[:num_active].tolist()))
    if padded:
        return LoRAKernelMeta(indices, srows, act, start, length, total, variant, True,
                              segments, *tiles, columns)
    used = None
    if ranks_host is not None and host is not None:
        used = used_columns(ranks_host, host[2 * total: 2 * total + max_loras])
    return LoRAKernelMeta(indices, srows, act, start, length, max_seg_len, variant,
                          max_seg_len > 0, segments, *tiles, used)
