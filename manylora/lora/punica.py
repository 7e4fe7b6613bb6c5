"""The per-step token → slot map that every LoRA-aware layer reads (Punica's indices).

Built once per step by the model runner (vLLM's ``token_lora_mapping``) and passed,
unchanged, to every LoRA-aware linear of the forward pass. It carries both views the
kernels need:

* the gather view (BGMV): ``token_lora_indices[t]``, the slot of every row;
* the segment view (SGMV): the LoRA rows sorted by slot (``sorted_rows``), and for the
  ``i``-th slot present in the step ``active_slots[i]``, its rows
  ``sorted_rows[seg_start[i] : seg_start[i] + seg_len[i]]``.

It also carries ``slot_dora``, which slots hold a DoRA adapter (Liu et al. 2024): the expand
kernels read that flag as data, so a captured CUDA graph stays valid when DoRA and plain
adapters are swapped in and out of slots.

All index tensors are int32 on the model's device and are built from one host buffer with
a single copy. A mapping built with ``pad_to`` has the fixed shapes a CUDA graph captures:
padding rows are base rows, and ``max_seg_len`` is the padded batch size.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

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
        rank: the adapter's true rank (≤ max_lora_rank); columns past it are zero padding.
        rows: int32 ``[n]`` indices into the flat token batch, on the model's device (a view
            of ``LoRAMapping.sorted_rows``).
        dora: whether the slot's adapter has DoRA scales (``LoRAMapping.slot_dora[slot]``).
    """

    slot: int
    rank: int
    rows: torch.Tensor
    dora: bool = False


class LoRAMapping(NamedTuple):
    """Which adapter slot each token row uses in this step.

    Attributes:
        token_lora_indices: int32 ``[T]``, the slot of every token row, -1 for base rows.
        slot_ranks: int32 ``[max_loras]``, the true rank of the adapter in each slot (0 when
            empty); kernels do ``rank`` work, not ``max_lora_rank`` work.
        sorted_rows: int32 ``[T]``, the rows with an adapter grouped by slot (ascending slot,
            ascending row within a slot), then the base rows.
        active_slots: int32 ``[max_loras]``, the slots present in the step in ascending
            order, then -1.
        seg_start: int32 ``[max_loras]``, where ``active_slots[i]``'s rows start in
            ``sorted_rows`` (0 past the active ones).
        seg_len: int32 ``[max_loras]``, how many rows ``active_slots[i]`` has (0 past them).
        slot_dora: int32 ``[max_loras]``, 1 where the slot's adapter has DoRA scales, else 0;
            the expand kernels read it per program, so it may change between CUDA-graph
            replays like the other tensors.
        max_seg_len: host int, an upper bound on ``seg_len`` (kernels size their grid by it).
        schedule: ``"sgmv"`` (segments) or ``"bgmv"`` (per-row gather), the kernel schedule.
        has_lora: host bool, whether any row uses an adapter (if not, layers launch nothing).
        segments: one ``SlotSegment`` per slot present (host view; empty in a padded mapping).
    """

    token_lora_indices: torch.Tensor
    slot_ranks: torch.Tensor
    sorted_rows: torch.Tensor
    active_slots: torch.Tensor
    seg_start: torch.Tensor
    seg_len: torch.Tensor
    slot_dora: torch.Tensor
    max_seg_len: int
    schedule: str
    has_lora: bool
    segments: tuple[SlotSegment, ...]


def build_lora_mapping(token_slots: Sequence[int], slot_ranks: Sequence[int],
                       device: torch.device, *, slot_dora: Sequence[int] | None = None,
                       pad_to: int | None = None, schedule: str | None = None) -> LoRAMapping:
    """Build the step's mapping from a host list of per-token slots.

    Args:
        token_slots: length ``T``, the slot of every token row (-1 = base model).
        slot_ranks: length ``max_loras``, the true rank of the adapter in each slot.
        device: where the index tensors live.
        slot_dora: length ``max_loras``, nonzero where the slot's adapter has DoRA scales
            (stored as 0/1); None: no DoRA slot.
        pad_to: pad to this many rows (base rows) and give the mapping fixed shapes for a
            CUDA graph: ``max_seg_len = pad_to``, no host ``segments``, ``has_lora`` True.
        schedule: force ``"sgmv"`` or ``"bgmv"``; by default SGMV when the step has at least
            ``SGMV_MIN_ROWS`` LoRA rows and its slots average at least
            ``SGMV_MIN_ROWS_PER_SLOT``, else BGMV.

    Returns:
        The ``LoRAMapping``; its seven int32 tensors come from one host → device copy
        (pinned and non-blocking on CUDA).

    Raises:
        IndexError: a slot outside ``[-1, len(slot_ranks))``.
        ValueError: ``pad_to`` below the number of rows, ``slot_dora`` of another length
            than ``slot_ranks``, or an unknown ``schedule``.
    """
    num_rows, max_loras = len(token_slots), len(slot_ranks)
    total = num_rows if pad_to is None else pad_to
    if total < num_rows:
        raise ValueError(f"pad_to={pad_to} is below the step's {num_rows} rows")
    if schedule not in (None, "sgmv", "bgmv"):
        raise ValueError(f"unknown LoRA kernel schedule {schedule!r}: use 'sgmv' or 'bgmv'")
    dora = [0] * max_loras if slot_dora is None else [int(bool(d)) for d in slot_dora]
    if len(dora) != max_loras:
        raise ValueError(f"slot_dora has {len(dora)} entries for {max_loras} adapter slots")
    rows_of, base_rows = _rows_by_slot(token_slots, max_loras)
    active = sorted(rows_of)
    sorted_rows = [r for s in active for r in rows_of[s]] + base_rows + list(
        range(num_rows, total))
    lens = [len(rows_of[s]) for s in active]
    starts = [sum(lens[:i]) for i in range(len(active))]
    pad = max_loras - len(active)
    host = torch.tensor(
        list(token_slots) + [-1] * (total - num_rows) + list(slot_ranks) + sorted_rows
        + active + [-1] * pad + starts + [0] * pad + lens + [0] * pad + dora, dtype=torch.int32,
        pin_memory=torch.device(device).type == "cuda")
    (indices, ranks, srows, act, start, length, dora_t) = host.to(device, non_blocking=True).split(
        (total, max_loras, total, max_loras, max_loras, max_loras, max_loras))
    num_lora_rows = num_rows - len(base_rows)
    if schedule is None:
        schedule = ("sgmv" if active and num_lora_rows >= max(
            SGMV_MIN_ROWS, SGMV_MIN_ROWS_PER_SLOT * len(active)) else "bgmv")
    if pad_to is not None:
        return LoRAMapping(indices, ranks, srows, act, start, length, dora_t, pad_to, schedule,
                           True, ())
    segments = tuple(SlotSegment(s, int(slot_ranks[s]), srows[b: b + n], bool(dora[s]))
                     for s, b, n in zip(active, starts, lens))
    return LoRAMapping(indices, ranks, srows, act, start, length, dora_t, max(lens, default=0),
                       schedule, bool(active), segments)


def _rows_by_slot(token_slots: Sequence[int],
                  max_loras: int) -> tuple[dict[int, list[int]], list[int]]:
    """``({slot: its rows, ascending}, base rows)`` of a step.

    Raises:
        IndexError: a slot outside ``[-1, max_loras)``.
    """
    rows_of: dict[int, list[int]] = {}
    base_rows: list[int] = []
    for row, slot in enumerate(token_slots):
        if slot >= max_loras or slot < -1:
            raise IndexError(f"slot {slot} is outside the {max_loras} adapter slots")
        (rows_of.setdefault(slot, []) if slot >= 0 else base_rows).append(row)
    return rows_of, base_rows
