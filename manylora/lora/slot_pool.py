"""The slot pool: which adapter is in which device slot, LRU, and the copies into slots.

The device has ``max_loras`` slots whose buffers were allocated once, up front (vLLM's
``max_loras``; TensorRT-LLM's device cache). A slot load is one host → device copy of a
``PinnedAdapter``'s buffer into the staging buffer (plus its small descriptor table) and one
scatter kernel (``SlotLayout.load``), whatever the number of layers and modules. On CUDA the
copies run on a side stream and each slot's last copy is marked by an event: the compute
stream waits only for the copies of the slots a step uses (``wait_for``).
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable

import torch

from manylora.lora.cache_report import LoRACacheStats
from manylora.lora.pinned import PinnedAdapter
from manylora.lora.slot_layout import SlotLayout

logger = logging.getLogger(__name__)


class SlotPool:
    """Adapters in device slots, least recently used first.

    Args:
        layout: this engine rank's ``SlotLayout`` (the slot buffers, their rank table and
            the staging buffer).
        max_loras: the number of slots.
        stats: the counters it adds to (``device_hits``, ``device_misses``,
            ``device_evictions``, ``device_load_seconds``, ``device_load_bytes``).

    Attributes:
        slot_to_id: length ``max_loras``; the ``lora_int_id`` in each slot or None.
        on_write_slot: called with ``(slot, pinned)`` before a pinned adapter is written into
            a slot (tensor parallelism tells the other ranks to load it there).
    """

    def __init__(self, layout: SlotLayout, max_loras: int, stats: LoRACacheStats) -> None:
        self.layout = layout
        self.stats = stats
        self.slot_to_id: list[int | None] = [None] * max_loras
        self.on_write_slot: Callable[[int, PinnedAdapter], None] | None = None
        self._slots: OrderedDict[int, int] = OrderedDict()     # lora_int_id → slot, LRU order
        device = layout.staging.device
        self._copy_stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self._slot_events: dict[int, torch.cuda.Event] = {}
        # (start, end, bytes, the pinned adapter, alive until its copy is done)
        self._timings: list[tuple[torch.cuda.Event, torch.cuda.Event, int, PinnedAdapter]] = []

    def __contains__(self, lora_int_id: int) -> bool:
        return lora_int_id in self._slots

    def slot_of(self, lora_int_id: int) -> int | None:
        """The slot holding the adapter, or None."""
        return self._slots.get(lora_int_id)

    def hit(self, lora_int_id: int) -> bool:
        """Whether the adapter is in a slot; if so it becomes the most recently used and
        counts as a hit."""
        if lora_int_id not in self._slots:
            return False
        self._slots.move_to_end(lora_int_id)
        self.stats.device_hits += 1
        return True

    def free_slot(self, keep: set[int]) -> int | None:
        """An empty slot, else the slot of the least recently used adapter not in ``keep``
        (evicted); None when every adapter in a slot is kept."""
        if None in self.slot_to_id:
            return self.slot_to_id.index(None)
        victim = next((i for i in self._slots if i not in keep), None)
        if victim is None:
            return None
        slot = self._slots.pop(victim)
        self.stats.device_evictions += 1
        logger.debug("slot %d: evicted adapter %d", slot, victim)
        return slot

    def load(self, slot: int, adapter: PinnedAdapter) -> None:
        """Copy ``adapter`` into ``slot`` (from ``free_slot``) and count a device miss; on
        CUDA enqueued on the side stream after the compute stream's work so far (the slot's
        old adapter is done with), else done now."""
        self.stats.device_misses += 1
        if self._copy_stream is None:
            start = time.perf_counter()
            self._write(slot, adapter)
            self.stats.device_load_seconds += time.perf_counter() - start
            self.stats.device_load_bytes += adapter.nbytes
        else:
            compute = torch.cuda.current_stream(self._copy_stream.device)
            self._copy_stream.wait_stream(compute)
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(
                enable_timing=True)
            with torch.cuda.stream(self._copy_stream):
                begin.record()
                self._write(slot, adapter)
                end.record()
            self._slot_events[slot] = end
            self._timings.append((begin, end, adapter.nbytes, adapter))
        self.slot_to_id[slot] = adapter.lora_int_id
        self._slots[adapter.lora_int_id] = slot

    def _write(self, slot: int, adapter: PinnedAdapter) -> None:
        if self.on_write_slot is not None:
            self.on_write_slot(slot, adapter)
        self.layout.load(slot, adapter, adapter.slot_load)

    def wait_for(self, slots: Iterable[int]) -> None:
        """Make the compute stream wait for the pending copies into ``slots`` (CUDA only)."""
        if self._copy_stream is None:
            return
        compute = torch.cuda.current_stream(self._copy_stream.device)
        for slot in slots:
            event = self._slot_events.pop(slot, None)
            if event is not None and not event.query():
                compute.wait_event(event)

    def collect_timings(self) -> None:
        """Add the GPU time and bytes of the copies that completed to ``stats``."""
        pending = []
        for start, end, nbytes, pinned in self._timings:
            if end.query():
                self.stats.device_load_seconds += start.elapsed_time(end) / 1e3
                self.stats.device_load_bytes += nbytes
            else:
                pending.append((start, end, nbytes, pinned))
        self._timings = pending

    def drop(self, lora_int_id: int) -> None:
        """Empty the adapter's slot, if it has one (rank 0 everywhere in the rank table)."""
        slot = self._slots.pop(lora_int_id, None)
        if slot is not None:
            self.slot_to_id[slot] = None
            self.layout.table.clear(slot)
