"""The per-(slot, layer, module) rank table every LoRA kernel reads.

One table per model (vLLM keeps one rank per slot; S-LoRA and Punica one per adapter): for
each adapter slot and each (layer, module) with slot buffers, the rank of the slot's adapter
for that module and whether it has DoRA scales there. A module the adapter does not target
has rank 0 (as has every module of an empty slot), and a ``rank_pattern`` module has its own
rank, so the shrink and expand kernels do exactly the work the adapter defines: a program
whose (slot, module) has rank 0 returns before it reads x, A, B or y.

The device tensors are written in place when a slot is written, never reallocated, so a
captured CUDA graph reads the current table at every replay. Host numpy mirrors of both,
written at the same time, let an eager step skip the launches of a projection that none of
its slots needs (``used_columns``), without reading the device.

Each ``LoRASlots`` of ``S`` slices owns ``S`` consecutive columns from its ``rank_col`` and
holds views of them (``LoRASlots.ranks`` / ``.dora``, int32 ``[max_loras, S]``).

A CUDA-graph decode step cannot skip launches by looking at the host, so it is captured for
a *projection mask*: one bit per projection kind over all layers, set where some slot of the
step has a nonzero rank in a column of that kind (``kind_mask``). A kind is what one launch
covers: the modules of one ``LoRASlots`` (packed ``q_proj``/``k_proj``/``v_proj``,
``o_proj``, packed ``gate_proj``/``up_proj``, ``down_proj`` in a Llama model), so masks
that would launch the same kernels are one mask. A graph captured for mask ``M`` launches
the LoRA kernels of the columns ``mask_columns(M)`` only; it is valid for any step whose
mask is a subset of ``M``, since every other column has rank 0 for all of the step's
slots.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Protocol

import numpy as np
import torch


class SlotColumns(Protocol):
    """What the table needs of one projection's slot buffers (``LoRASlots``).

    Attributes:
        module_names: its slices' modules, e.g. ``("q_proj", "k_proj", "v_proj")``; it
            gets one column per module.
        max_loras: its number of slots.
    """

    module_names: tuple[str, ...]
    max_loras: int

    def bind(self, table: SlotTable, rank_col: int) -> None:
        """Use columns ``[rank_col, rank_col + len(module_names))`` of ``table``."""


class SlotTable:
    """Ranks and DoRA flags of every (slot, layer, module) with slot buffers.

    Args:
        slots: ``{(layer, module): LoRASlots}`` (the model's; a packed ``LoRASlots`` appears
            under each of its modules' keys, all of one layer). Each distinct ``LoRASlots``
            gets its columns in first-appearance order and is bound to this table (its
            ``ranks`` / ``dora`` views and ``rank_col`` point here; what it held before is
            dropped).
        max_loras: the number of adapter slots.
        device: where the kernels read the table.

    Attributes:
        ranks: device int32 ``[max_loras, E]``; ``E`` = the number of (layer, module) pairs.
        dora: device int32 ``[max_loras, E]``, 1 where that (slot, module) has DoRA scales.
        ranks_host, dora_host: numpy int32 ``[max_loras, E]``, the host mirrors.
        keys: the ``(layer, module)`` of each column.
        kinds: the projection kinds, in column order: each the ``module_names`` of a
            ``LoRASlots`` (one launch), e.g. ``("q_proj", "k_proj", "v_proj")``.

    Raises:
        ValueError: a ``LoRASlots`` of another ``max_loras``, under keys of several layers or
            of modules it does not have.
    """

    def __init__(self, slots: Mapping[tuple[int, str], SlotColumns], max_loras: int,
                 device: torch.device) -> None:
        owners: dict[int, tuple[SlotColumns, int]] = {}
        for (layer, module), lora in slots.items():
            if module not in lora.module_names:
                raise ValueError(f"({layer}, {module!r}) maps to slots of {lora.module_names}")
            if lora.max_loras != max_loras:
                raise ValueError(f"slots of {lora.module_names} have {lora.max_loras} slots, "
                                 f"the table {max_loras}")
            known = owners.setdefault(id(lora), (lora, layer))
            if known[1] != layer:
                raise ValueError(f"slots of {lora.module_names} appear in layers {known[1]} "
                                 f"and {layer}")
        keys: list[tuple[int, str]] = []
        bind: list[tuple[SlotColumns, int]] = []
        for lora, layer in owners.values():
            bind.append((lora, len(keys)))
            keys.extend((layer, name) for name in lora.module_names)
        self.keys = tuple(keys)
        self._column = {key: i for i, key in enumerate(keys)}
        self.max_loras = max_loras
        self.ranks = torch.zeros(max_loras, len(keys), dtype=torch.int32, device=device)
        self.dora = torch.zeros(max_loras, len(keys), dtype=torch.int32, device=device)
        self.ranks_host = np.zeros((max_loras, len(keys)), np.int32)
        self.dora_host = np.zeros((max_loras, len(keys)), np.int32)
        for lora, col in bind:
            lora.bind(self, col)
        self.kinds = tuple(dict.fromkeys(lora.module_names for lora, _ in bind))
        kind_of = np.array([self.kinds.index(lora.module_names)
                            for lora, _ in bind for _ in lora.module_names], np.int64)
        self._column_bits = np.left_shift(1, kind_of)          # int64 [E], its kind's bit

    @property
    def full_mask(self) -> int:
        """The projection mask of every kind (``(1 << len(kinds)) - 1``)."""
        return (1 << len(self.kinds)) - 1

    def kind_mask(self, active_slots: np.ndarray) -> int:
        """The projection mask a step's slots need, from the host mirror: bit ``k`` set when
        some slot has a nonzero rank in a column of kind ``kinds[k]`` (any layer).

        Args:
            active_slots: int ``[n]``, slot indices; negative entries (padding) ignored.

        Returns:
            An int in ``[0, full_mask]``.
        """
        slots = np.asarray(active_slots).reshape(-1)
        used = self.ranks_host[slots[slots >= 0]].any(axis=0)             # [E]
        return int(np.bitwise_or.reduce(self._column_bits[used], initial=0))

    def mask_columns(self, mask: int) -> tuple[bool, ...]:
        """Per column, whether its kind is in ``mask`` (what ``LoRAKernelMeta.used_columns``
        holds for a graph captured for ``mask``).

        Raises:
            ValueError: bits outside ``full_mask``.
        """
        if not 0 <= mask <= self.full_mask:
            raise ValueError(f"projection mask {mask:#x} has bits outside the "
                             f"{len(self.kinds)} kinds {self.kinds}")
        return tuple(((self._column_bits & mask) != 0).tolist())

    @property
    def num_columns(self) -> int:
        """E, the (layer, module) pairs with slot buffers."""
        return len(self.keys)

    def column(self, layer: int, module: str) -> int:
        """The column of ``(layer, module)``.

        Raises:
            KeyError: no slot buffers for that (layer, module).
        """
        try:
            return self._column[(layer, module)]
        except KeyError:
            raise KeyError(f"no adapter slot buffers for module {module!r} of layer "
                           f"{layer}") from None

    def set(self, slot: int, col: int, rank: int, dora: bool) -> None:
        """Write one entry, host mirror and device (two in-place fills on the current
        stream; nothing synchronises).

        Raises:
            ValueError: a negative rank, or a slot or column out of range.
        """
        if rank < 0 or not 0 <= slot < self.max_loras or not 0 <= col < self.num_columns:
            raise ValueError(f"rank {rank} at slot {slot}, column {col} of a "
                             f"[{self.max_loras}, {self.num_columns}] table")
        self.ranks_host[slot, col] = rank
        self.dora_host[slot, col] = int(dora)
        self.ranks[slot, col] = rank
        self.dora[slot, col] = int(dora)

    def write_row(self, slot: int, ranks: np.ndarray, dora: np.ndarray) -> None:
        """Write a slot's whole row (every column: 0 where its adapter has no module there):
        the host mirrors, then one copy per device tensor, on the current stream.

        Args:
            ranks, dora: integer ``[E]``.

        Raises:
            ValueError: rows of another length, or a negative rank.
        """
        ranks = np.asarray(ranks, dtype=np.int32).reshape(-1)
        flags = (np.asarray(dora).reshape(-1) != 0).astype(np.int32)
        if ranks.size != self.num_columns or flags.size != self.num_columns:
            raise ValueError(f"a row of {ranks.size} ranks and {flags.size} DoRA flags for "
                             f"{self.num_columns} columns")
        if (ranks < 0).any():
            raise ValueError(f"negative rank in slot {slot}'s row")
        self.ranks_host[slot] = ranks
        self.dora_host[slot] = flags
        self.ranks[slot].copy_(torch.from_numpy(ranks))
        self.dora[slot].copy_(torch.from_numpy(flags))

    def clear(self, slot: int) -> None:
        """Mark ``slot`` empty: rank 0 and no DoRA in every column."""
        self.write_row(slot, np.zeros(self.num_columns, np.int32),
                       np.zeros(self.num_columns, np.int32))
