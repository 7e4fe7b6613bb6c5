"""Adapter residency: disk → host tier (LRU) → device slot (LRU), as vLLM and S-LoRA do.

The host tier keeps up to ``max_cpu_loras`` loaded adapters; the device has ``max_loras``
slots whose buffers were allocated once, up front. ``activate`` binds the step's adapters
to slots, copying weights only for adapters not already resident, and never evicts an
adapter the step uses. The slot table (``slot_to_id``) is the single source of truth.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Iterable, Mapping

from manylora.config import LoRAConfig
from manylora.lora.adapter import LoRAAdapter, LoRAAdapterError
from manylora.lora.formats.loader import load_adapter_dir
from manylora.lora.formats.peft import AdapterTarget
from manylora.lora.layers import LoRASlots
from manylora.lora.request import LoRARequest
from manylora.model.hub import resolve_adapter_path

logger = logging.getLogger(__name__)


class AdapterReloadError(RuntimeError):
    """An adapter that was loaded once could not be loaded again (its files changed or went).

    Attributes:
        lora_int_id: the adapter that failed; only its requests need to end.
    """

    def __init__(self, lora_int_id: int, cause: Exception) -> None:
        super().__init__(str(cause))
        self.lora_int_id = lora_int_id


class LoRAManager:
    """Two LRU tiers of adapters over fixed device slots.

    Args:
        lora_config: slot count, host-tier size, padded rank, target modules.
        target: what an adapter must fit (shapes, layers, dtype).
        slots: ``{(layer, module): LoRASlots}``, the model's slot buffers.

    Attributes:
        slot_to_id: length ``max_loras``; the ``lora_int_id`` in each slot or None.
        slot_ranks: length ``max_loras``; the true rank in each slot (0 when empty).
        slot_dora: length ``max_loras``; 1 where the slot's adapter has DoRA scales.
    """

    def __init__(self, lora_config: LoRAConfig, target: AdapterTarget,
                 slots: Mapping[tuple[int, str], LoRASlots]) -> None:
        self.config = lora_config
        self.target = target
        self.slots = dict(slots)
        self._host: OrderedDict[int, LoRAAdapter] = OrderedDict()
        self._requests: dict[int, LoRARequest] = {}
        self._device: OrderedDict[int, int] = OrderedDict()   # lora_int_id → slot, LRU order
        self.slot_to_id: list[int | None] = [None] * lora_config.max_loras
        self.slot_ranks: list[int] = [0] * lora_config.max_loras
        self.slot_dora: list[int] = [0] * lora_config.max_loras
        self.num_disk_loads = 0
        self.num_slot_loads = 0

    def add(self, request: LoRARequest) -> LoRAAdapter:
        """Make sure the adapter is in the host tier (loading it from disk if needed).

        Raises:
            LoRAAdapterError: the adapter cannot be served (see ``load_peft_adapter``).
            FileNotFoundError: the path is neither a directory nor a cached hub repo.
            ValueError: ``lora_int_id`` already names an adapter at another path.
        """
        known = self._requests.get(request.lora_int_id)
        if known is not None and known.lora_path != request.lora_path:
            raise ValueError(
                f"lora_int_id {request.lora_int_id} already names adapter {known.lora_name!r} "
                f"at {known.lora_path}, not {request.lora_path}")
        adapter = self._host.get(request.lora_int_id)
        if adapter is not None:
            self._host.move_to_end(request.lora_int_id)
            return adapter
        adapter = load_adapter_dir(request, resolve_adapter_path(request.lora_path),
                                   self.target)
        self.num_disk_loads += 1
        self._requests[request.lora_int_id] = request
        self._host[request.lora_int_id] = adapter
        while len(self._host) > self.config.max_cpu_loras:
            evicted, _ = self._host.popitem(last=False)
            logger.debug("host tier evicted adapter %d", evicted)
        return adapter

    def activate(self, requests: Iterable[LoRARequest]) -> dict[int, int]:
        """Bind every adapter in ``requests`` to a device slot; ``{lora_int_id: slot}``.

        Adapters already in a slot stay there; others take a free slot or evict the least
        recently used adapter that is not in ``requests``.

        Raises:
            RuntimeError: more distinct adapters than ``max_loras`` (the scheduler prevents it).
            AdapterReloadError: an adapter evicted from the host tier failed to load again.
        """
        wanted = {r.lora_int_id: r for r in requests}
        if len(wanted) > self.config.max_loras:
            raise RuntimeError(f"{len(wanted)} adapters in one step exceed max_loras="
                               f"{self.config.max_loras}")
        for lora_id, request in wanted.items():
            if lora_id in self._device:
                self._device.move_to_end(lora_id)
                continue
            try:
                adapter = self.add(request)
            except (LoRAAdapterError, FileNotFoundError) as e:
                raise AdapterReloadError(lora_id, e) from e
            slot = self._free_slot(wanted)
            self._load_slot(slot, adapter)
            self._device[lora_id] = slot
        return {lora_id: self._device[lora_id] for lora_id in wanted}

    def _free_slot(self, pinned: Mapping[int, LoRARequest]) -> int:
        if None in self.slot_to_id:
            return self.slot_to_id.index(None)
        victim = next(i for i in self._device if i not in pinned)
        slot = self._device.pop(victim)
        logger.debug("slot %d: evicted adapter %d", slot, victim)
        return slot

    def _load_slot(self, slot: int, adapter: LoRAAdapter) -> None:
        for (layer, module), slots in self.slots.items():
            w = adapter.weights.get((layer, module))
            if w is None:
                slots.set_slot(slot, module, None, None)
            else:
                slots.set_slot(slot, module, w.a, w.b, w.dora_scale)
        self.slot_to_id[slot] = adapter.lora_int_id
        self.slot_ranks[slot] = adapter.rank
        self.slot_dora[slot] = int(adapter.has_dora)
        self.num_slot_loads += 1

    def slot_of(self, lora_int_id: int) -> int | None:
        """The slot holding the adapter, or None."""
        return self._device.get(lora_int_id)
