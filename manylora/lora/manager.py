"""Adapter residency: disk → host tier → device slot, both LRU (vLLM, S-LoRA, TensorRT-LLM).

The host tier keeps loaded adapters pinned (``PinnedAdapter``: one pinned buffer in slot
order, built once on the loader thread that read the adapter), bounded by count
(``max_cpu_loras``) and bytes (``max_cpu_lora_bytes``); the device has ``max_loras`` slots
whose buffers were allocated once, up front. A slot load is one host → device copy of that
buffer into a staging buffer (plus its small descriptor table) and one scatter kernel
(``SlotLayout.load``), whatever the number of layers and modules. An adapter named by a
path is read on loader threads: on first sight (``add`` checks only what its config says,
so the engine's thread never waits on a read, a digest or a pin; its requests wait in the
scheduler's queue until ``poll`` takes the read in) and, after an eviction, ahead of the
requests that need it (``prefetch``), so a
step never waits on disk. Slot copies run on a
side CUDA stream; the compute stream waits only for the copies of the slots it uses. An
adapter in use is never evicted from a slot; one whose only copy is in the host tier (given
as tensors, TensorRT-LLM's task_id semantics) is never evicted while requests need it.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections import Counter, OrderedDict
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import Future
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from manylora.checkpoint.hub import resolve_adapter_path
from manylora.config import LoRAConfig
from manylora.lora.adapter import LoRAAdapter, LoRAAdapterError
from manylora.lora.formats.loader import (
    adapter_from_request,
    check_adapter_dir,
    load_adapter_dir,
)
from manylora.lora.formats.peft import AdapterTarget
from manylora.lora.loader_pool import LoaderPool, report_progress
from manylora.lora.pinned import PinnedAdapter, pin_adapter, pinned_bytes
from manylora.lora.slot_layout import SlotLayout
from manylora.lora.slots import LoRASlots
from manylora.lora_request import LoRARequest

logger = logging.getLogger(__name__)


class AdapterLoadError(RuntimeError):
    """An adapter could not be read into the host tier: its first read on a loader thread
    failed (bad weights, files gone, the host tier full of adapters in use), or a re-read
    did (``AdapterReloadError``).

    Attributes:
        lora_int_id: the adapter that failed; only its requests need to end.
        cause: the reader's exception (``LoRAAdapterError``, ``FileNotFoundError``,
            ``ValueError``, ...), None when the failure was described by a message only.
    """

    def __init__(self, lora_int_id: int, cause: Exception | str) -> None:
        super().__init__(str(cause))
        self.lora_int_id = lora_int_id
        self.cause = cause if isinstance(cause, Exception) else None


class AdapterReloadError(AdapterLoadError):
    """An adapter that was loaded once could not be loaded again (its files changed or went)."""


@dataclass
class AdapterEvents:
    """What ``LoRAManager.poll`` took in.

    Attributes:
        ready: ``{lora_int_id: digest}`` of adapters whose first read finished: their
            digest is known and they are in the host tier (unless it is full of adapters
            that waiting requests need: then they are read again when their turn comes).
        failed: adapters whose (first or repeated) read failed; their requests must end.
    """

    ready: dict[int, str] = field(default_factory=dict)
    failed: list[AdapterLoadError] = field(default_factory=list)


@dataclass
class LoRACacheStats:
    """Counters of the two adapter tiers since the engine started.

    Attributes:
        host_hits / host_misses: adapters needed for a slot (or prefetched) that were / were
            not in the host tier; each miss is one disk read.
        host_evictions: adapters dropped from the host tier.
        host_load_seconds: wall time of all disk reads (parse, validate, digest, pin),
            seconds.
        host_load_bytes: bytes the reads put in the host tier (pinned adapters: tensors,
            alignment and slot-load descriptors; what ``max_cpu_lora_bytes`` counts).
        host_load_failures: disk reads that failed (their requests ended with the error).
        sync_disk_loads: disk reads a step had to wait for (staging came too late).
        adapter_waits: requests that waited in the queue because their adapter was on
            disk only when they arrived (a first read, or a re-read after an eviction).
        adapter_wait_seconds: how long those requests waited until their adapter was in
            host memory, seconds (summed).
        device_hits: adapters a step used that were already in a slot.
        device_misses: host → device copies into a slot, on demand or staged ahead.
        device_evictions: adapters evicted from a slot.
        device_load_seconds: GPU time of completed host → device copies, seconds.
        device_load_bytes: bytes of completed host → device copies.
        pending_loads: disk reads queued or running now (first reads and re-reads).
        oldest_pending_load_since: unix time (seconds) the oldest of them was started;
            None when there is none.
        stuck_loader_threads: loader threads still inside a read that timed out.
    """

    host_hits: int = 0
    host_misses: int = 0
    host_evictions: int = 0
    host_load_seconds: float = 0.0
    host_load_bytes: int = 0
    host_load_failures: int = 0
    sync_disk_loads: int = 0
    adapter_waits: int = 0
    adapter_wait_seconds: float = 0.0
    device_hits: int = 0
    device_misses: int = 0
    device_evictions: int = 0
    device_load_seconds: float = 0.0
    device_load_bytes: int = 0
    pending_loads: int = 0
    oldest_pending_load_since: float | None = None
    stuck_loader_threads: int = 0


def _check_unchanged(adapter: PinnedAdapter, known: _Known) -> None:
    """Raises ``AdapterReloadError`` when a re-read adapter's weights differ from the first
    read (its files changed on disk)."""
    if adapter.digest != known.digest:
        raise AdapterReloadError(adapter.lora_int_id, LoRAAdapterError(
            f"adapter {adapter.name!r} changed on disk since it was first loaded (digest "
            f"{known.digest[:12]} → {adapter.digest[:12]})"))


@dataclass
class _Known:
    request: LoRARequest      # how to read it again ("" path: only the host copy exists)
    digest: str
    has_dora: bool = False


@dataclass
class _FirstRead:
    request: LoRARequest      # the path being read for the first time
    future: Future            # → LoRAAdapter, pinned


def _is_local_path(path: str) -> bool:
    """Whether ``path`` can only name a local directory (not a hub repo id)."""
    return os.path.isabs(path) or path.startswith((".", "~")) or path.count("/") > 1


class LoRAManager:
    """Two LRU tiers of adapters over fixed device slots.

    Args:
        lora_config: slot count, host-tier bounds, padded rank, target modules.
        target: what an adapter must fit (shapes, layers, dtype, DoRA norms).
        slots: ``{(layer, module): LoRASlots}``, the model's slot buffers.
        loader_threads: background threads that read adapters from disk (a ``LoaderPool``:
            each read bounded by ``lora_config.load_timeout``; one that exceeds it fails
            with ``LoRALoadTimeoutError`` and its thread is replaced).

    Attributes:
        slot_to_id: length ``max_loras``; the ``lora_int_id`` in each slot or None.
        stats: ``LoRACacheStats``.
        layout: the ``SlotLayout`` slot loads go through (its staging buffer holds the
            largest adapter the slots can take).
        host_alloc: ``nbytes → uint8 [nbytes]`` host tensor a pinned adapter is written into
            (pinned memory; shared memory under tensor parallelism, set before any ``add``).
        on_write_slot: called with ``(slot, pinned)`` before a pinned adapter is written into
            a slot (tensor parallelism tells the other ranks to load it there).
        background_dora_reads: whether DoRA adapters are read on the loader threads;
            False under tensor parallelism, where DoRA's norms are a collective that only
            the engine's thread may start: ``add`` and ``prefetch`` then read them on the
            calling thread.
        notify: called (from a loader thread) when a read finishes, so an engine loop
            waiting for it wakes to ``poll`` it in.
    """

    def __init__(self, lora_config: LoRAConfig, target: AdapterTarget,
                 slots: Mapping[tuple[int, str], LoRASlots], loader_threads: int = 2) -> None:
        self.config = lora_config
        self.target = target
        self.slots = dict(slots)
        self.stats = LoRACacheStats()
        self._host: OrderedDict[int, PinnedAdapter] = OrderedDict()
        self._host_bytes = 0
        self._known: dict[int, _Known] = {}
        self._refs: Counter[int] = Counter()
        self._device: OrderedDict[int, int] = OrderedDict()   # lora_int_id → slot, LRU order
        self.slot_to_id: list[int | None] = [None] * lora_config.max_loras
        self._loading: dict[int, Future] = {}
        self._first: dict[int, _FirstRead] = {}
        self.notify: Callable[[], None] | None = None
        self._failures: list[AdapterReloadError] = []
        self._wanted: set[int] = set()
        self._pool = LoaderPool(loader_threads, lora_config.load_timeout)
        self._max_in_flight = 2 * loader_threads
        self._stats_lock = threading.Lock()
        self.layout = SlotLayout(self.slots, target.module_shapes,
                                 lora_config.max_lora_rank)
        device = self.layout.staging.device
        self._cuda = device.type == "cuda"
        self.host_alloc: Callable[[int], torch.Tensor] = pinned_bytes
        self._copy_stream = torch.cuda.Stream(device) if self._cuda else None
        self._load_stream = torch.cuda.Stream(device) if self._cuda else None
        self._slot_events: dict[int, torch.cuda.Event] = {}
        # (start, end, bytes, the pinned adapter, alive until its copy is done)
        self._timings: list[tuple[torch.cuda.Event, torch.cuda.Event, int, PinnedAdapter]] = []
        self.on_write_slot: Callable[[int, PinnedAdapter], None] | None = None
        self.background_dora_reads = True

    # ------------------------------------------------------------------ requests come and go

    def add(self, request: LoRARequest) -> str | None:
        """Register one more request for the adapter; the adapter's digest, or None while
        its first read is in flight (``poll`` reports the digest when it is done).

        A path seen for the first time gets the checks that read no tensor now (the
        directory, its config) and is read, validated, digested and pinned on a loader
        thread (under tensor parallelism a DoRA adapter is read here: its norms are a
        collective); further requests for it join that read. A request carrying
        ``weights``/``config`` is validated and cached in the host tier; a bare id must
        name an adapter the cache knows.

        Raises:
            LoRAAdapterError: the adapter cannot be served (a config that is not PEFT LoRA
                or names modules the model lacks, no weights file, not a directory; the
                weights themselves are checked by the read, see ``poll``).
            FileNotFoundError: a local path that does not exist (a hub repo id is resolved
                by the read).
            ValueError: the id already names another path or other weights (without
                ``replace``, or while requests use them), the id is not cached, or the host
                tier is full of adapters that requests still need.
        """
        lid = request.lora_int_id
        known = self._known.get(lid)
        first = self._first.get(lid)
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
                self._insert_host(self._pack(adapter), must_fit=True)
                self._known[lid] = known = _Known(request, adapter.digest, adapter.has_dora)
            else:
                self._touch_host(lid)
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
                self._touch_host(lid)
        elif known is None:
            raise ValueError(
                f"LoRA task_id {lid} ({request.lora_name}) is not cached: it was never seen or "
                "was evicted; send its weights and config (or a lora_path) again")
        self._refs[lid] += 1
        return None if known is None else known.digest

    def _start_first_read(self, request: LoRARequest) -> None:
        """The cheap checks of a new path, then its read on a loader thread (or here, for
        DoRA under tensor parallelism)."""
        local = Path(request.lora_path).expanduser()
        use_dora = None                      # unknown for a hub repo until it is fetched
        if local.exists() or _is_local_path(request.lora_path):
            if not local.exists():
                raise FileNotFoundError(
                    f"adapter {request.lora_name!r}: {request.lora_path} does not exist")
            use_dora = check_adapter_dir(request, local, self.target)
        if not self.background_dora_reads and use_dora is not False:
            adapter = self._read(request)
            self._insert_host(adapter, must_fit=True)
            self._known[request.lora_int_id] = _Known(request, adapter.digest,
                                                      adapter.has_dora)
            return
        future = self._pool.submit(self._read, request, what=f"adapter {request.lora_name!r}")
        self._first[request.lora_int_id] = _FirstRead(request, future)
        self._notify_when_done(future)

    def _notify_when_done(self, future: Future) -> None:
        notify = self.notify
        if notify is not None:
            future.add_done_callback(lambda _: notify())

    @property
    def has_pending_reads(self) -> bool:
        """Whether a first read is in flight (``poll`` will report it)."""
        return bool(self._first)

    def wait_first_read(self, lora_int_id: int) -> None:
        """Block until the adapter's first read (if one is in flight) has finished; ``poll``
        then takes it in."""
        first = self._first.get(lora_int_id)
        if first is not None:
            with contextlib.suppress(Exception):
                first.future.result()

    def release(self, lora_int_id: int) -> None:
        """One request for the adapter has finished."""
        self._refs[lora_int_id] -= 1
        if self._refs[lora_int_id] <= 0:
            del self._refs[lora_int_id]

    def remove(self, lora_int_id: int) -> bool:
        """Drop an adapter from the host tier, its slot and the known ids, unless requests
        still use it; True when it is gone (or was never known), False while in use."""
        if self._refs[lora_int_id] > 0:
            return False
        self._refs.pop(lora_int_id, None)
        future = self._loading.pop(lora_int_id, None)
        if future is not None:
            future.cancel()
        first = self._first.pop(lora_int_id, None)
        if first is not None:
            first.future.cancel()         # one already running finishes unseen
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
        adapter = self._host.pop(lid, None)
        if adapter is not None:
            self._host_bytes -= adapter.nbytes
        self._known.pop(lid, None)
        slot = self._device.pop(lid, None)
        if slot is not None:
            self.slot_to_id[slot] = None
            if self.slots:                   # empty: rank 0 everywhere in the rank table
                next(iter(self.slots.values())).table.clear(slot)

    # ------------------------------------------------------------------ host tier

    def _pack(self, adapter: LoRAAdapter) -> PinnedAdapter:
        """The host tier's form of ``adapter``, with this engine's slot-load descriptors
        (any thread)."""
        pinned = pin_adapter(adapter, self.host_alloc)
        return replace(pinned, load=self.layout.prepare(pinned))

    def _read(self, request: LoRARequest) -> PinnedAdapter:
        """Disk → pinned host memory (any thread)."""
        start = time.perf_counter()
        stream = (torch.cuda.stream(self._load_stream) if self._load_stream is not None
                  else contextlib.nullcontext())
        with stream:
            adapter = load_adapter_dir(request, resolve_adapter_path(request.lora_path),
                                       self.target)
        report_progress()
        adapter = self._pack(adapter)
        with self._stats_lock:
            self.stats.host_load_seconds += time.perf_counter() - start
            self.stats.host_load_bytes += adapter.nbytes
            self.stats.host_misses += 1
        return adapter

    def _touch_host(self, lid: int) -> None:
        if lid in self._host:
            self._host.move_to_end(lid)

    def _over(self, extra_bytes: int, extra_count: int) -> bool:
        cap = self.config.max_cpu_lora_bytes
        return (len(self._host) + extra_count > self.config.max_cpu_loras
                or (cap is not None and self._host_bytes + extra_bytes > cap))

    def _evictable(self, lid: int) -> bool:
        """Neither about to be used (staged for waiting requests) nor the only copy of an
        adapter that requests still need."""
        if lid in self._wanted:
            return False
        return not (self._refs[lid] > 0 and not self._known[lid].request.lora_path)

    def _insert_host(self, adapter: PinnedAdapter, must_fit: bool) -> bool:
        """Put ``adapter`` in the host tier, evicting LRU adapters nobody needs.

        Raises:
            ValueError: ``must_fit`` and the tier is full of adapters requests still need.
        """
        while self._over(adapter.nbytes, 1):
            victim = next((lid for lid in self._host if self._evictable(lid)), None)
            if victim is None:
                if not must_fit:
                    return False
                raise ValueError(
                    f"adapter {adapter.name!r}: the host LoRA cache (max_cpu_loras="
                    f"{self.config.max_cpu_loras}, max_cpu_lora_bytes="
                    f"{self.config.max_cpu_lora_bytes}) is full of adapters that requests "
                    "still need; retry when they finish")
            evicted = self._host.pop(victim)
            self._host_bytes -= evicted.nbytes
            self.stats.host_evictions += 1
            if not self._known[victim].request.lora_path:
                del self._known[victim]          # given as tensors: nothing to reload from
            logger.debug("host tier evicted adapter %d", victim)
        self._host[adapter.lora_int_id] = adapter
        self._host_bytes += adapter.nbytes
        return True

    @property
    def host_bytes(self) -> int:
        """Bytes of adapter tensors held in the host tier."""
        return self._host_bytes

    # ------------------------------------------------------------------ scheduler's view

    def is_ready(self, lora_int_id: int) -> bool:
        return lora_int_id in self._device or lora_int_id in self._host

    def is_resident(self, lora_int_id: int) -> bool:
        return lora_int_id in self._device

    def is_loading(self, lora_int_id: int) -> bool:
        """Whether a loader thread is still reading the adapter (first read or re-read;
        a read that ended is not, even before ``poll`` takes it in)."""
        first = self._first.get(lora_int_id)
        future = first.future if first is not None else self._loading.get(lora_int_id)
        return future is not None and not future.done()

    def has_finished_reads(self) -> bool:
        """Whether a read has ended that ``poll`` has not taken in yet."""
        return (any(f.future.done() for f in self._first.values())
                or any(f.done() for f in self._loading.values()))

    # ------------------------------------------------------------------ staging ahead

    def prefetch(self, wanted: Iterable[LoRARequest], in_use: Iterable[int]) -> None:
        """Stage adapters that waiting requests will need, most urgent first: read those
        not in the host tier on background threads, and copy those in the host tier into
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
            if lid in self._host or lid in self._device or lid in self._loading:
                continue
            known = self._known.get(lid)
            if known is None or not known.request.lora_path:
                continue
            if known.has_dora and not self.background_dora_reads:
                self._read_now(lid, known)
                continue
            if len(self._loading) >= self._max_in_flight:
                break
            self._loading[lid] = future = self._pool.submit(
                self._read, known.request, what=f"adapter {known.request.lora_name!r}")
            self._notify_when_done(future)
        for request in wanted:
            lid = request.lora_int_id
            if lid in self._device or lid not in self._host:
                continue
            slot = self._free_slot(busy | self._wanted_resident())
            if slot is None:
                break
            self.stats.device_misses += 1
            self._load_slot(slot, self._host[lid])
            self._device[lid] = slot
            busy.add(lid)

    def _read_now(self, lid: int, known: _Known) -> None:
        """Stage an adapter from disk on the calling thread (a failure ends its requests
        at the next ``poll``, as a failed background read does)."""
        try:
            adapter = self._read(known.request)
            _check_unchanged(adapter, known)
        except AdapterReloadError as e:
            self._failures.append(e)
            return
        except (LoRAAdapterError, FileNotFoundError, OSError) as e:
            self._failures.append(AdapterReloadError(lid, e))
            return
        self._insert_host(adapter, must_fit=False)

    def _wanted_resident(self) -> set[int]:
        return {lid for lid in self._wanted if lid in self._device}

    def poll(self) -> AdapterEvents:
        """Take in finished background reads and copy timings: the adapters whose first
        read finished (now in the host tier, with their digests), and those whose read
        failed (a bad adapter, files changed or gone), whose requests must end."""
        events = AdapterEvents()
        for lid, first in list(self._first.items()):
            if not first.future.done():
                continue
            del self._first[lid]
            try:
                adapter = first.future.result()
            except Exception as e:             # whatever the reader met ends its requests
                logger.warning("adapter %r (%s) failed to load: %s", first.request.lora_name,
                               first.request.lora_path, e)
                self._failures.append(AdapterLoadError(lid, e))
                continue
            self._known[lid] = _Known(first.request, adapter.digest, adapter.has_dora)
            events.ready[lid] = adapter.digest
            # a host tier full of adapters that waiting requests need: dropped for now, read
            # again (prefetch) when its turn comes, as an evicted adapter is
            self._insert_host(adapter, must_fit=False)
        for lid, future in list(self._loading.items()):
            if not future.done():
                continue
            del self._loading[lid]
            known = self._known.get(lid)
            try:
                adapter = future.result()
            except (LoRAAdapterError, FileNotFoundError, OSError) as e:
                self._failures.append(AdapterReloadError(lid, e))
                continue
            if known is None or lid in self._host:
                continue
            try:
                _check_unchanged(adapter, known)
            except AdapterReloadError as e:
                self._failures.append(e)
                continue
            self._insert_host(adapter, must_fit=False)
        self._collect_timings()
        failures, self._failures = self._failures, []
        for f in failures:
            self._known.pop(f.lora_int_id, None)
        self.stats.host_load_failures += len(failures)
        events.failed = failures
        return events

    def snapshot(self) -> LoRACacheStats:
        """A copy of ``stats`` with the reads pending now (``pending_loads``,
        ``oldest_pending_load_since``, ``stuck_loader_threads``)."""
        pending = self._pool.pending()
        now_mono, now = time.monotonic(), time.time()
        return replace(self.stats, pending_loads=len(pending),
                       oldest_pending_load_since=now - (now_mono - min(pending))
                       if pending else None,
                       stuck_loader_threads=self._pool.stuck)

    def record_wait(self, num_requests: int, seconds: float) -> None:
        """Count requests that waited in the queue for their adapter to be read
        (``adapter_waits``, ``adapter_wait_seconds``)."""
        self.stats.adapter_waits += num_requests
        self.stats.adapter_wait_seconds += seconds

    def _collect_timings(self) -> None:
        pending = []
        for start, end, nbytes, pinned in self._timings:
            if end.query():
                self.stats.device_load_seconds += start.elapsed_time(end) / 1e3
                self.stats.device_load_bytes += nbytes
            else:
                pending.append((start, end, nbytes, pinned))
        self._timings = pending

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
            if lid in self._device:
                self._device.move_to_end(lid)
                self.stats.device_hits += 1
                continue
            self.stats.device_misses += 1
            adapter = self._host_copy(lid)
            slot = self._free_slot(set(wanted))
            self._load_slot(slot, adapter)
            self._device[lid] = slot
        slots = {lid: self._device[lid] for lid in wanted}
        self._wait_for(slots.values())
        return slots

    def _host_copy(self, lid: int) -> PinnedAdapter:
        adapter = self._host.get(lid)
        if adapter is not None:
            self._host.move_to_end(lid)
            self.stats.host_hits += 1
            return adapter
        known = self._known.get(lid)
        if known is None or not known.request.lora_path:
            raise AdapterReloadError(lid, f"adapter {lid} is no longer cached")
        future = self._loading.pop(lid, None)
        try:
            adapter = future.result() if future is not None else self._read(known.request)
        except (LoRAAdapterError, FileNotFoundError, OSError) as e:
            self._known.pop(lid, None)
            raise AdapterReloadError(lid, e) from e
        self.stats.sync_disk_loads += 1
        try:
            _check_unchanged(adapter, known)
        except AdapterReloadError:
            self._known.pop(lid, None)
            raise
        self._insert_host(adapter, must_fit=False)
        return adapter

    def _free_slot(self, keep: set[int]) -> int | None:
        if None in self.slot_to_id:
            return self.slot_to_id.index(None)
        victim = next((i for i in self._device if i not in keep), None)
        if victim is None:
            return None
        slot = self._device.pop(victim)
        self.stats.device_evictions += 1
        logger.debug("slot %d: evicted adapter %d", slot, victim)
        return slot

    def _load_slot(self, slot: int, adapter: PinnedAdapter) -> None:
        if self._copy_stream is None:
            start = time.perf_counter()
            self._write_slot(slot, adapter)
            self.stats.device_load_seconds += time.perf_counter() - start
            self.stats.device_load_bytes += adapter.nbytes
        else:
            compute = torch.cuda.current_stream(self._copy_stream.device)
            self._copy_stream.wait_stream(compute)   # the slot's old adapter is done with
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(
                enable_timing=True)
            with torch.cuda.stream(self._copy_stream):
                begin.record()
                self._write_slot(slot, adapter)
                end.record()
            self._slot_events[slot] = end
            self._timings.append((begin, end, adapter.nbytes, adapter))
        self.slot_to_id[slot] = adapter.lora_int_id

    def _write_slot(self, slot: int, adapter: PinnedAdapter) -> None:
        if self.on_write_slot is not None:
            self.on_write_slot(slot, adapter)
        self.layout.load(slot, adapter, adapter.load)

    def _wait_for(self, slots: Iterable[int]) -> None:
        if self._copy_stream is None:
            return
        compute = torch.cuda.current_stream(self._copy_stream.device)
        for slot in slots:
            event = self._slot_events.pop(slot, None)
            if event is not None and not event.query():
                compute.wait_event(event)

    def slot_of(self, lora_int_id: int) -> int | None:
        """The slot holding the adapter, or None."""
        return self._device.get(lora_int_id)

    def shutdown(self) -> None:
        """Stop the loader threads (pending reads are dropped)."""
        self._first.clear()
        self._pool.shutdown()
