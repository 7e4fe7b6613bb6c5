"""Adapter residency: disk → host cache → device slot, both LRU (vLLM, S-LoRA, TensorRT-LLM).

``LoRAManager`` is what the engine core calls. It keeps the adapters it knows (how to read
each again, its digest) and how many requests use each, and sets the policy over three
parts: the ``AdapterReader`` reads adapters on loader threads, on first sight (``add`` checks
only what a config says, so the engine's thread never waits on a read; the requests wait in
the scheduler's queue until ``poll`` takes the read in) and after an eviction, ahead of the
requests that need them (``prefetch``); the ``HostCache`` holds them pinned, bounded by
``max_cpu_loras`` and ``max_cpu_lora_bytes``; the ``SlotPool`` copies them into the
``max_loras`` device slots on a side stream. An adapter in use is never evicted from a slot;
one whose only copy is in the host cache (given as tensors, TensorRT-LLM's task_id
semantics) is never evicted while requests need it, nor is one staged for waiting requests.
The scheduler sees it as its ``AdapterResidency`` (``is_ready``, ``is_resident``).
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, replace

import torch

from manylora.config import MODEL_LAYER, LoRAConfig
from manylora.lora.adapter import LoRAAdapter, LoRAAdapterError
from manylora.lora.cache_report import (
    AdapterEvents,
    AdapterLoadError,
    AdapterReloadError,
    LoRACacheStats,
)
from manylora.lora.formats.loader import adapter_from_request
from manylora.lora.formats.target import AdapterTarget
from manylora.lora.host_cache import HostCache
from manylora.lora.pinned import PinnedAdapter
from manylora.lora.reader import AdapterReader
from manylora.lora.slot_layout import SlotLayout
from manylora.lora.slot_pool import SlotPool
from manylora.lora.slots import LoRASlots
from manylora.lora_request import LoRARequest

__all__ = ["LoRAManager"]

logger = logging.getLogger(__name__)


@dataclass
class _Known:
    request: LoRARequest      # how to read it again ("" path: only the host copy exists)
    digest: str
    collective: bool = False  # its read is a collective under tensor parallelism
    invocation: tuple[int, ...] | None = None   # an activated adapter's invocation tokens

    @classmethod
    def of(cls, request: LoRARequest, adapter: PinnedAdapter | LoRAAdapter) -> _Known:
        return cls(request, adapter.digest, _collective_read(adapter), adapter.invocation_tokens)


def _collective_read(adapter: PinnedAdapter | LoRAAdapter) -> bool:
    """Whether reading ``adapter`` again enters a collective under tensor parallelism:
    DoRA's norms, or the check of an ``embed_tokens`` / ``lm_head`` table peft saved."""
    keys = adapter.weights if isinstance(adapter, LoRAAdapter) else adapter.module_ranks()
    return adapter.has_dora or any(layer == MODEL_LAYER for layer, _ in keys)


def _check_unchanged(adapter: PinnedAdapter, known: _Known) -> None:
    """Raises ``AdapterReloadError`` when a re-read adapter's weights differ from the first
    read (its files changed on disk)."""
    if adapter.digest != known.digest:
        raise AdapterReloadError(adapter.lora_int_id, LoRAAdapterError(
            f"adapter {adapter.name!r} changed on disk since it was first loaded (digest "
            f"{known.digest[:12]} → {adapter.digest[:12]})"))


class LoRAManager:
    """Two LRU tiers of adapters over fixed device slots.

    Args:
        lora_config: slot count, host-cache bounds, padded rank, target modules.
        target: what an adapter must fit (shapes, layers, dtype, DoRA norms).
        slots: ``{(layer, module): LoRASlots}``, the model's slot buffers.
        loader_threads: background threads that read adapters from disk (a ``LoaderPool``:
            each read bounded by ``lora_config.load_timeout``; one that exceeds it fails
            with ``LoRALoadTimeoutError`` and its thread is replaced).

    Attributes:
        stats: ``LoRACacheStats``.
        layout: the ``SlotLayout`` slot loads go through (its staging buffer holds the
            largest adapter the slots can take).
        reader, host_cache, slot_pool: the three parts (module docstring).
        background_dora_reads: whether DoRA adapters (and those that may carry an
            ``embed_tokens`` / ``lm_head`` table to check) are read on the loader threads;
            False under tensor parallelism, where DoRA's norms and that check are
            collectives that only the engine's thread may start: ``add`` and ``prefetch``
            then read them on the calling thread.
        host_alloc: ``nbytes → uint8 [nbytes]`` host tensor a pinned adapter is written into
            (pinned memory; shared memory under tensor parallelism, set before any ``add``).
        notify: called (from a loader thread) when a read finishes, so an engine loop
            waiting for it wakes to ``poll`` it in.
        on_write_slot: called with ``(slot, pinned)`` before a pinned adapter is written into
            a slot (tensor parallelism tells the other ranks to load it there).
        slot_to_id: length ``max_loras``; the ``lora_int_id`` in each slot or None.
        host_bytes: bytes of the adapters in the host cache.
    """

    def __init__(self, lora_config: LoRAConfig, target: AdapterTarget,
                 slots: Mapping[tuple[int, str], LoRASlots], loader_threads: int = 2) -> None:
        self.config = lora_config
        self.target = target
        self.stats = LoRACacheStats()
        self._known: dict[int, _Known] = {}
        self._refs: Counter[int] = Counter()
        self._failures: list[AdapterLoadError] = []
        self._wanted: set[int] = set()
        self.layout = SlotLayout(dict(slots), target.module_shapes,
                                 lora_config.max_lora_rank)
        self.reader = AdapterReader(target, self.layout, self.stats, loader_threads,
                                    lora_config.load_timeout)
        self.host_cache = HostCache(lora_config, self.stats, self._evictable, self._evicted)
        self.slot_pool = SlotPool(self.layout, lora_config.max_loras, self.stats)
        self.background_dora_reads = True

    # the parts' hooks the engine sets: notify; under tensor parallelism, before any
    # ``add``, host_alloc and on_write_slot
    @property
    def host_alloc(self) -> Callable[[int], torch.Tensor]:
        return self.reader.host_alloc

    @host_alloc.setter
    def host_alloc(self, alloc: Callable[[int], torch.Tensor]) -> None:
        self.reader.host_alloc = alloc

    @property
    def notify(self) -> Callable[[], None] | None:
        return self.reader.notify

    @notify.setter
    def notify(self, notify: Callable[[], None] | None) -> None:
        self.reader.notify = notify

    @property
    def on_write_slot(self) -> Callable[[int, PinnedAdapter], None] | None:
        return self.slot_pool.on_write_slot

    @on_write_slot.setter
    def on_write_slot(self, hook: Callable[[int, PinnedAdapter], None] | None) -> None:
        self.slot_pool.on_write_slot = hook

    @property
    def slot_to_id(self) -> list[int | None]:
        return self.slot_pool.slot_to_id

    @property
    def host_bytes(self) -> int:
        return self.host_cache.nbytes

    # ------------------------------------------------------------------ requests come and go

    def add(self, request: LoRARequest) -> str | None:
        """Register one more request for the adapter; the adapter's digest, or None while
        its first read is in flight (``poll`` reports the digest when it is done).

        A path seen for the first time gets the checks that read no tensor now (the
        directory, its config) and is read, validated, digested and pinned on a loader
        thread (under tensor parallelism a DoRA adapter is read here: its norms are a
        collective); further requests for it join that read. A request carrying
        ``weights``/``config`` is validated and cached in the host cache; a bare id must
        name an adapter the cache knows.

        Raises:
            LoRAAdapterError: the adapter cannot be served (a config that is not PEFT LoRA
                or names modules the model lacks, no weights file, not a directory; the
                weights themselves are checked by the read, see ``poll``).
            FileNotFoundError: a local path that does not exist (a hub repo id is resolved
                by the read).
            ValueError: the id already names another path or other weights (without
                ``replace``, or while requests use them), the id is not cached, or the host
                cache is full of adapters that requests still need.
        """
        lid = request.lora_int_id
        known = self._known.get(lid)
        first = self.reader.first_read(lid)
        if first is not None and first.request.lora_path != request.lora_path:
            raise ValueError(
                f"lora_int_id {lid} already names adapter {first.request.lora_name!r} "
                f"({first.request.lora_path}, being read), not "
                f"{request.lora_path or 'tensors'}")
        if request.has_tensors:
            adapter = adapter_from_request(request, self.target)
            if known is not None and known.digest != adapter.digest:
                self._replace(request, known)
                known = None
            if known is None:
                self.host_cache.insert(self.reader.pin(adapter), must_fit=True)
                self._known[lid] = known = _Known.of(request, adapter)
            else:
                self.host_cache.touch(lid)
        elif request.lora_path:
            if known is not None and known.request.lora_path != request.lora_path:
                raise ValueError(
                    f"lora_int_id {lid} already names adapter {known.request.lora_name!r} "
                    f"({known.request.lora_path or 'given as tensors'}), not "
                    f"{request.lora_path}")
            if known is None and first is None:
                self._start_first_read(request)
                known = self._known.get(lid)          # read here (DoRA under TP)
            elif known is not None:
                self.host_cache.touch(lid)
        elif known is None:
            raise ValueError(
                f"LoRA task_id {lid} ({request.lora_name}) is not cached: it was never seen or "
                "was evicted; send its weights and config (or a lora_path) again")
        self._refs[lid] += 1
        return None if known is None else known.digest

    def _start_first_read(self, request: LoRARequest) -> None:
        """The cheap checks of a new path, then its read on a loader thread (or here, for
        DoRA under tensor parallelism)."""
        collective = self.reader.check(request)
        if not self.background_dora_reads and collective is not False:
            adapter = self.reader.read(request)
            self.host_cache.insert(adapter, must_fit=True)
            self._known[request.lora_int_id] = _Known.of(request, adapter)
            return
        self.reader.start_first(request)

    @property
    def has_pending_reads(self) -> bool:
        """Whether a first read is in flight (``poll`` will report it)."""
        return self.reader.has_first_reads

    def wait_first_read(self, lora_int_id: int) -> None:
        """Block until the adapter's first read (if one is in flight) has finished; ``poll``
        then takes it in."""
        self.reader.wait_first(lora_int_id)

    def release(self, lora_int_id: int) -> None:
        """One request for the adapter has finished."""
        self._refs[lora_int_id] -= 1
        if self._refs[lora_int_id] <= 0:
            del self._refs[lora_int_id]

    def remove(self, lora_int_id: int) -> bool:
        """Drop an adapter from the host cache, its slot and the known ids, unless requests
        still use it; True when it is gone (or was never known), False while in use."""
        if self._refs[lora_int_id] > 0:
            return False
        self._refs.pop(lora_int_id, None)
        self.reader.cancel(lora_int_id)
        self._wanted.discard(lora_int_id)
        self._forget(lora_int_id)
        return True

    def _replace(self, request: LoRARequest, known: _Known) -> None:
        lid = request.lora_int_id
        if not request.replace:
            raise ValueError(f"LoRA task_id {lid} is cached with other weights (digest "
                             f"{known.digest[:12]}); set replace=True to replace them")
        if self._refs[lid]:
            raise ValueError(f"LoRA task_id {lid} cannot be replaced while {self._refs[lid]} "
                             "requests still use it")
        self._forget(lid)

    def _forget(self, lid: int) -> None:
        self.host_cache.pop(lid)
        self._known.pop(lid, None)
        self.slot_pool.drop(lid)

    # ------------------------------------------------------------------ host cache policy

    def _evictable(self, lid: int) -> bool:
        """Neither about to be used (staged for waiting requests) nor the only copy of an
        adapter that requests still need."""
        if lid in self._wanted:
            return False
        return not (self._refs[lid] > 0 and not self._known[lid].request.lora_path)

    def _evicted(self, lid: int) -> None:
        if not self._known[lid].request.lora_path:
            del self._known[lid]          # given as tensors: nothing to read again from

    # ------------------------------------------------------------------ scheduler's view

    def invocation_tokens(self, lora_int_id: int) -> tuple[int, ...] | None:
        """An activated adapter's invocation tokens (aLoRA), None for a plain one or one
        whose first read has not finished."""
        known = self._known.get(lora_int_id)
        return None if known is None else known.invocation

    def is_ready(self, lora_int_id: int) -> bool:
        return lora_int_id in self.slot_pool or lora_int_id in self.host_cache

    def is_resident(self, lora_int_id: int) -> bool:
        return lora_int_id in self.slot_pool

    def is_loading(self, lora_int_id: int) -> bool:
        """Whether a loader thread is still reading the adapter (first read or re-read;
        a read that ended is not, even before ``poll`` takes it in)."""
        return self.reader.is_reading(lora_int_id)

    def has_finished_reads(self) -> bool:
        """Whether a read has ended that ``poll`` has not taken in yet."""
        return self.reader.has_finished()

    # ------------------------------------------------------------------ staging ahead

    def prefetch(self, wanted: Iterable[LoRARequest], in_use: Iterable[int]) -> None:
        """Stage adapters that waiting requests will need, most urgent first: read those
        not in the host cache on background threads, and copy those in the host cache into
        slots no running request uses, on the side stream.

        Args:
            wanted: ``LoRARequest`` of the adapters, most urgent first.
            in_use: ids of the adapters the current step uses (their slots are kept).
        """
        wanted = list(wanted)
        self._wanted = {r.lora_int_id for r in wanted}
        busy = set(in_use)
        for request in wanted:
            lid = request.lora_int_id
            if (lid in self.host_cache or lid in self.slot_pool
                    or self.reader.has_reread(lid)):
                continue
            known = self._known.get(lid)
            if known is None or not known.request.lora_path:
                continue
            if known.collective and not self.background_dora_reads:
                self._read_now(lid, known)
                continue
            if not self.reader.start_reread(known.request):
                break
        for request in wanted:
            lid = request.lora_int_id
            adapter = self.host_cache.get(lid)
            if lid in self.slot_pool or adapter is None:
                continue
            slot = self.slot_pool.free_slot(
                busy | {i for i in self._wanted if i in self.slot_pool})
            if slot is None:
                break
            self.slot_pool.load(slot, adapter)
            busy.add(lid)

    def _read_now(self, lid: int, known: _Known) -> None:
        """Stage an adapter from disk on the calling thread (a failure ends its requests
        at the next ``poll``, as a failed background read does)."""
        try:
            adapter = self.reader.read(known.request)
            _check_unchanged(adapter, known)
        except AdapterReloadError as e:
            self._failures.append(e)
            return
        except (LoRAAdapterError, FileNotFoundError, OSError) as e:
            self._failures.append(AdapterReloadError(lid, e))
            return
        self.host_cache.insert(adapter, must_fit=False)

    def poll(self) -> AdapterEvents:
        """Take in finished background reads and copy timings: the adapters whose first
        read finished (now in the host cache, with their digests), and those whose read
        failed (a bad adapter, files changed or gone), whose requests must end."""
        events = AdapterEvents()
        first_reads, rereads, failed = self.reader.take_finished()
        self._failures.extend(failed)
        for request, adapter in first_reads:
            lid = request.lora_int_id
            self._known[lid] = _Known.of(request, adapter)
            events.ready[lid] = adapter.digest
            # a host cache full of adapters that waiting requests need: dropped for now, read
            # again (prefetch) when its turn comes, as an evicted adapter is
            self.host_cache.insert(adapter, must_fit=False)
        for lid, adapter in rereads:
            known = self._known.get(lid)
            if known is None or lid in self.host_cache:
                continue
            try:
                _check_unchanged(adapter, known)
            except AdapterReloadError as e:
                self._failures.append(e)
                continue
            self.host_cache.insert(adapter, must_fit=False)
        self.slot_pool.collect_timings()
        failures, self._failures = self._failures, []
        for f in failures:
            self._known.pop(f.lora_int_id, None)
        self.stats.host_load_failures += len(failures)
        events.failed = failures
        return events

    def snapshot(self) -> LoRACacheStats:
        """A copy of ``stats`` with the reads pending now (``pending_loads``,
        ``oldest_pending_load_since``, ``stuck_loader_threads``)."""
        pending = self.reader.pending()
        now_mono, now = time.monotonic(), time.time()
        return replace(self.stats, pending_loads=len(pending),
                       oldest_pending_load_since=now - (now_mono - min(pending))
                       if pending else None,
                       stuck_loader_threads=self.reader.stuck)

    def record_wait(self, num_requests: int, seconds: float) -> None:
        """Count requests that waited in the queue for their adapter to be read
        (``adapter_waits``, ``adapter_wait_seconds``)."""
        self.stats.adapter_waits += num_requests
        self.stats.adapter_wait_seconds += seconds

    # ------------------------------------------------------------------ device slots

    def activate(self, requests: Iterable[LoRARequest]) -> dict[int, int]:
        """Bind every adapter in ``requests`` to a device slot; ``{lora_int_id: slot}``.

        Adapters already in a slot stay there; others take a free slot or evict the least
        recently used adapter that is not in ``requests``. On CUDA the compute stream then
        waits for the copies of these slots (and only those).

        Raises:
            RuntimeError: more distinct adapters than ``max_loras`` (the scheduler prevents it).
            AdapterReloadError: an adapter that is neither staged nor readable again.
        """
        wanted = {r.lora_int_id: r for r in requests}
        if len(wanted) > self.config.max_loras:
            raise RuntimeError(f"{len(wanted)} adapters in one step exceed max_loras="
                               f"{self.config.max_loras}")
        for lid in wanted:
            if self.slot_pool.hit(lid):
                continue
            adapter = self._host_copy(lid)
            self.slot_pool.load(self.slot_pool.free_slot(set(wanted)), adapter)
        slots = {lid: self.slot_pool.slot_of(lid) for lid in wanted}
        self.slot_pool.wait_for(slots.values())
        return slots

    def _host_copy(self, lid: int) -> PinnedAdapter:
        """The adapter from the host cache, else read again now (a staged re-read waited
        for, or a read on this thread)."""
        adapter = self.host_cache.hit(lid)
        if adapter is not None:
            return adapter
        known = self._known.get(lid)
        if known is None or not known.request.lora_path:
            raise AdapterReloadError(lid, f"adapter {lid} is no longer cached")
        future = self.reader.take_reread(lid)
        try:
            adapter = (future.result() if future is not None
                       else self.reader.read(known.request))
        except (LoRAAdapterError, FileNotFoundError, OSError) as e:
            self._known.pop(lid, None)
            raise AdapterReloadError(lid, e) from e
        self.stats.sync_disk_loads += 1
        try:
            _check_unchanged(adapter, known)
        except AdapterReloadError:
            self._known.pop(lid, None)
            raise
        self.host_cache.insert(adapter, must_fit=False)
        return adapter

    def slot_of(self, lora_int_id: int) -> int | None:
        """The slot holding the adapter, or None."""
        return self.slot_pool.slot_of(lora_int_id)

    def shutdown(self) -> None:
        """Stop the loader threads (pending reads are dropped)."""
        self.reader.shutdown()
