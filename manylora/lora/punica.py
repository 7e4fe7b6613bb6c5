"""The per-step token → slot map that every LoRA-aware layer reads (Punica's indices).

Built once per step by the model runner (vLLM's ``token_lora_mapping``) and passed,
unchanged, to every LoRA-aware linear of the forward pass. It carries both views the
kernels need:

* the gather view (BGMV): ``token_lora_indices[t]``, the slot of every row;
* the segment view (SGMV): the LoRA rows sorted by slot (``sorted_rows``), and for the
  ``i``-th slot present in the step ``active_slots[i]``, its rows
  ``sorted_rows[seg_start[i] : seg_start[i] + seg_len[i]]``.

Ranks and DoRA flags are not part of it: they are per (slot, layer, module), in the model's
``SlotTable``, which the kernels read as data (a captured CUDA graph stays valid when
adapters are swapped in and out of slots). An eager step's mapping carries, on the host,
which table columns any of its slots uses (``used_columns``), so that a projection no row
needs launches nothing.

All index tensors are int32 on the model's device and are built from one host buffer with
a single copy (numpy vector ops: a stable ``argsort`` and a ``bincount``, no per-row
Python). A mapping built with ``pad_to`` has the fixed shapes a CUDA graph captures:
padding rows are base rows, and ``max_seg_len`` is the padded batch size.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import numpy as np
import torch

# The segment (SGMV) schedule pays off once a step has at least SGMV_MIN_ROWS LoRA rows and
# its slots average SGMV_MIN_ROWS_PER_SLOT rows (prefill); otherwise each row gathers its
# own adapter (BGMV). From the SGMV-vs-BGMV table in BENCHMARKS.md (H100): BGMV wins at
# every split of 8 and 64 rows, SGMV from 256 rows at 8 rows per adapter.
SGMV_MIN_ROWS = 256
SGMV_MIN_ROWS_PER_SLOT = 8


class SlotSegment(NamedTuple):
    """The rows of one adapter slot in this step (host view, for the PyTorch reference).

    Attributes:
        slot: device slot index in ``[0, max_loras)``.
        rows: int32 ``[n]`` indices into the flat token batch, on the model's device (a view
            of ``LoRAMapping.sorted_rows``).
    """

    slot: int
    rows: torch.Tensor


class LoRAMapping(NamedTuple):
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
        schedule: ``"sgmv"`` (segments) or ``"bgmv"`` (per-row gather), the kernel schedule.
        has_lora: host bool, whether any row uses an adapter (if not, layers launch nothing).
        segments: one ``SlotSegment`` per slot present (host view; empty in a padded mapping).
        used_columns: host, per ``SlotTable`` column, whether any slot of the step has a
            nonzero rank there (``used_columns``); None: unknown, every LoRA projection
            launches (CUDA-graph steps, whose kernels exit early on rank 0).
    """

    token_lora_indices: torch.Tensor
    sorted_rows: torch.Tensor
    active_slots: torch.Tensor
    seg_start: torch.Tensor
    seg_len: torch.Tensor
    max_seg_len: int
    schedule: str
    has_lora: bool
    segments: tuple[SlotSegment, ...]
    used_columns: tuple[bool, ...] | None = None


class LoRAMappingArrays(NamedTuple):
    """The host (numpy) index arrays of a ``LoRAMapping`` (see its fields), before they are
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


def lora_mapping_arrays(token_slots: np.ndarray, max_loras: int,
                        total: int | None = None) -> LoRAMappingArrays:
    """Group a step's rows by adapter slot with numpy vector ops (a stable ``argsort`` and
    a ``bincount``; no per-row Python), as Punica's SGMV segments.

    Args:
        token_slots: integer ``[T]``, the slot of every row (-1: the base model).
        max_loras: the number of slots.
        total: pad to this many rows (padding rows are base rows); None: ``T``.

    Returns:
        The ``LoRAMappingArrays``.

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
    return LoRAMappingArrays(indices, sorted_rows, active_slots, seg_start, seg_len,
                             int(seg_len.max()) if max_loras else 0, num_lora_rows)


def default_schedule(num_lora_rows: int, num_active: int) -> str:
    """``"sgmv"`` when the step has at least ``SGMV_MIN_ROWS`` LoRA rows and its active
    slots average at least ``SGMV_MIN_ROWS_PER_SLOT`` rows, else ``"bgmv"``."""
    return ("sgmv" if num_active and num_lora_rows >= max(
        SGMV_MIN_ROWS, SGMV_MIN_ROWS_PER_SLOT * num_active) else "bgmv")


def used_columns(ranks_host: np.ndarray, active_slots: np.ndarray) -> tuple[bool, ...]:
    """Which ``SlotTable`` columns any of a step's slots uses (a nonzero rank), one numpy
    reduction over the table's host mirror.

    Args:
        ranks_host: int ``[max_loras, E]``, ``SlotTable.ranks_host``.
        active_slots: int ``[max_loras]``, the step's slots then -1
            (``LoRAMappingArrays.active_slots``).

    Returns:
        ``E`` bools.
    """
    active = active_slots[active_slots >= 0]
    return tuple((ranks_host[active] != 0).any(axis=0).tolist())


def build_lora_mapping(token_slots: Sequence[int], max_loras: int, device: torch.device, *,
                       pad_to: int | None = None, schedule: str | None = None,
                       ranks_host: np.ndarray | None = None) -> LoRAMapping:
    """Build the step's mapping from the per-token slots (``lora_mapping_arrays``).

    Args:
        token_slots: length ``T``, the slot of every token row (-1 = base model).
        max_loras: the number of adapter slots.
        device: where the index tensors live.
        pad_to: pad to this many rows (base rows) and give the mapping fixed shapes for a
            CUDA graph: ``max_seg_len = pad_to``, no host ``segments``, ``has_lora`` True.
        schedule: force ``"sgmv"`` or ``"bgmv"``; by default ``default_schedule``.
        ranks_host: ``SlotTable.ranks_host``, for ``used_columns`` (not with ``pad_to``);
            None: no eager skip.

    Returns:
        The ``LoRAMapping``; its five int32 tensors come from one host → device copy
        (pinned and non-blocking on CUDA).

    Raises:
        IndexError: a slot outside ``[-1, max_loras)``.
        ValueError: ``pad_to`` below the number of rows, a ``ranks_host`` of another slot
            count, or an unknown ``schedule``.
    """
    if schedule not in (None, "sgmv", "bgmv"):
        raise ValueError(f"unknown LoRA kernel schedule {schedule!r}: use 'sgmv' or 'bgmv'")
    if ranks_host is not None and ranks_host.shape[0] != max_loras:
        raise ValueError(f"a rank table of {ranks_host.shape[0]} slots for {max_loras}")
    arrays = lora_mapping_arrays(np.asarray(token_slots, dtype=np.int64), max_loras, pad_to)
    total = arrays.token_lora_indices.size
    host = torch.empty(2 * total + 3 * max_loras, dtype=torch.int32,
                       pin_memory=torch.device(device).type == "cuda")
    np.concatenate([arrays.token_lora_indices, arrays.sorted_rows, arrays.active_slots,
                    arrays.seg_start, arrays.seg_len], out=host.numpy())
    if schedule is None:
        schedule = default_schedule(arrays.num_lora_rows, int((arrays.seg_len > 0).sum()))
    return lora_mapping_from_buffer(host.to(device, non_blocking=True), total, max_loras,
                                    arrays.max_seg_len, schedule, padded=pad_to is not None,
                                    ranks_host=ranks_host, host=host.numpy())


def lora_mapping_from_buffer(buf: torch.Tensor, total: int, max_loras: int, max_seg_len: int,
                             schedule: str, *, padded: bool,
                             ranks_host: np.ndarray | None = None,
                             host: np.ndarray | None = None) -> LoRAMapping:
    """A ``LoRAMapping`` whose five int32 tensors are views of ``buf``, laid out as
    ``[token_lora_indices total | sorted_rows total | active_slots L | seg_start L |
    seg_len L]`` (``L = max_loras``), as ``lora_mapping_arrays`` fills it.

    Args:
        buf: int32 ``[2 * total + 3 * max_loras]`` on the model's device.
        total: rows, padding included.
        max_loras: slots.
        max_seg_len: the most rows of one slot (``LoRAMappingArrays.max_seg_len``).
        schedule: ``"sgmv"`` or ``"bgmv"``.
        padded: a CUDA-graph mapping: ``max_seg_len = total``, ``has_lora`` True, no
            segments, no ``used_columns``.
        ranks_host: ``SlotTable.ranks_host``; with ``host``, an unpadded mapping gets
            ``used_columns``.
        host: the host copy of ``buf`` (numpy int32, same layout).

    The host ``segments`` (read only by the PyTorch references) are built when ``buf`` is
    on the CPU, from ``buf`` itself; a CUDA mapping has none (the Triton path reads the
    tensors).
    """
    (indices, srows, act, start, length) = buf.split(
        (total, total, max_loras, max_loras, max_loras))
    if padded:
        return LoRAMapping(indices, srows, act, start, length, total, schedule, True, ())
    used = None
    if ranks_host is not None and host is not None:
        used = used_columns(ranks_host, host[2 * total: 2 * total + max_loras])
    segments = ()
    if not buf.is_cuda and max_seg_len:
        num_active = int((length > 0).sum())
        segments = tuple(
            SlotSegment(s, srows[b: b + n])
            for s, b, n in zip(act[:num_active].tolist(), start[:num_active].tolist(),
                               length[:num_active].tolist()))
    return LoRAMapping(indices, srows, act, start, length, max_seg_len, schedule,
                       max_seg_len > 0, segments, used)
