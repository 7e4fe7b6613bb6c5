"""The per-step token → slot map that every LoRA-aware layer reads (Punica's indices).

Built once per step by the model runner (vLLM's ``token_lora_mapping``) and passed,
unchanged, to every LoRA-aware linear of the forward pass.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch


class SlotSegment(NamedTuple):
    """The rows of one adapter slot in this step.

    Attributes:
        slot: device slot index in ``[0, max_loras)``.
        rank: the adapter's true rank (≤ max_lora_rank); columns past it are zero padding.
        rows: int64 ``[n]`` indices into the flat token batch, on the model's device.
    """

    slot: int
    rank: int
    rows: torch.Tensor


class LoRAMapping(NamedTuple):
    """Which adapter slot each token row uses in this step.

    Attributes:
        token_lora_indices: int64 ``[T]``, the slot of every token row, -1 for base-model rows.
        segments: one ``SlotSegment`` per slot present in the step (no entry for base rows).
    """

    token_lora_indices: torch.Tensor
    segments: tuple[SlotSegment, ...]

    @property
    def has_lora(self) -> bool:
        """Whether any row of the step uses an adapter (if not, layers skip LoRA entirely)."""
        return bool(self.segments)


def build_lora_mapping(token_slots: Sequence[int], slot_ranks: Sequence[int],
                       device: torch.device) -> LoRAMapping:
    """Build the step's mapping from a host list of per-token slots.

    Args:
        token_slots: length ``T``, the slot of every token row (-1 = base model).
        slot_ranks: length ``max_loras``, the true rank of the adapter in each slot.
        device: where the index tensors live.

    Raises:
        IndexError: a slot outside ``[-1, len(slot_ranks))``.
    """
    rows_of: dict[int, list[int]] = {}
    for row, slot in enumerate(token_slots):
        if slot >= 0:
            rows_of.setdefault(slot, []).append(row)
    for slot in rows_of:
        if slot >= len(slot_ranks):
            raise IndexError(f"slot {slot} is outside the {len(slot_ranks)} adapter slots")
    segments = tuple(
        SlotSegment(slot, slot_ranks[slot], torch.tensor(rows, dtype=torch.int64).to(device))
        for slot, rows in sorted(rows_of.items()))
    indices = torch.tensor(list(token_slots), dtype=torch.int64).to(device)
    return LoRAMapping(indices, segments)
