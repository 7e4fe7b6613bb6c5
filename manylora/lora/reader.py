"""Adapter reads: disk → ``PinnedAdapter``, on loader threads (or the calling thread).

A read parses, validates and digests the adapter's files (``formats.loader``), then pins it
(``pin_adapter``: one host buffer in slot order, in ``host_alloc``'s memory) with this
engine rank's slot-load descriptors (``SlotLayout.prepare``), so that the engine's thread
never waits on disk, a digest or a pin. Reads run on a ``LoaderPool`` (each failed once its
parse makes no progress for ``load_timeout`` seconds; the pin runs ``outside_timeout``: a
page-locked allocation on a busy device waits on the driver, not on the store). The reader
keeps the reads in flight: first reads (a path seen for the first time, which every request
for it joins) and re-reads (an adapter evicted from the host cache, read again ahead of the
requests that need it, as vLLM's and S-LoRA's adapter caches do); ``LoRAManager.poll``
takes the finished ones in.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from manylora.checkpoint.hub import resolve_adapter_path
from manylora.lora.adapter import LoRAAdapter, LoRAAdapterError
from manylora.lora.cache_report import AdapterLoadError, AdapterReloadError, LoRACacheStats
from manylora.lora.formats.loader import check_adapter_dir, load_adapter_dir
from manylora.lora.formats.target import AdapterTarget
from manylora.lora.loader_pool import LoaderPool, outside_timeout, report_progress
from manylora.lora.pinned import PinnedAdapter, pin_adapter, pinned_bytes
from manylora.lora.slot_layout import SlotLayout
from manylora.lora_request import LoRARequest

logger = logging.getLogger(__name__)


@dataclass
class FirstRead:
    """A path being read for the first time.

    Attributes:
        request: the request that named it (``lora_path`` is what is read).
        future: resolves to the ``PinnedAdapter``, or fails with what the read raised.
    """

    request: LoRARequest
    future: Future


def is_local_path(path: str) -> bool:
    """Whether ``path`` can only name a local directory (not a hub repo id)."""
    return os.path.isabs(path) or path.startswith((".", "~")) or path.count("/") > 1


class AdapterReader:
    """Reads adapters from disk into their pinned host form, and keeps the reads in flight.

    Args:
        target: what an adapter must fit (shapes, layers, dtype, DoRA norms).
        layout: this engine rank's ``SlotLayout`` (``prepare`` makes each read adapter's
            slot-load descriptors).
        stats: the counters a read adds to (``host_misses``, ``host_load_seconds``,
            ``host_load_bytes``; updated from loader threads under a lock).
        loader_threads: ``LoaderPool`` workers.
        timeout: seconds a read may go without progress (``LoRAConfig.load_timeout``);
            None: no bound.

    Attributes:
        host_alloc: ``nbytes → uint8 [nbytes]`` host tensor a pinned adapter is written into
            (pinned memory; shared memory under tensor parallelism).
        notify: called (from a loader thread) when a read finishes; None: nobody waits.
        max_in_flight: re-reads in flight at most (``2 * loader_threads``).
    """

    def __init__(self, target: AdapterTarget, layout: SlotLayout, stats: LoRACacheStats,
                 loader_threads: int, timeout: float | None) -> None:
        self.target = target
        self.layout = layout
        self.stats = stats
        self.host_alloc: Callable[[int], torch.Tensor] = pinned_bytes
        self.notify: Callable[[], None] | None = None
        self.max_in_flight = 2 * loader_threads
        self._pool = LoaderPool(loader_threads, timeout)
        self._first: dict[int, FirstRead] = {}
        self._rereads: dict[int, Future] = {}
        self._stats_lock = threading.Lock()
        device = layout.staging.device
        # DoRA norms run on the device during a read: on a stream of their own
        self._stream = torch.cuda.Stream(device) if device.type == "cuda" else None

    # ------------------------------------------------------------------ one read

    def check(self, request: LoRARequest) -> bool | None:
        """The checks of a new path that read no tensor (the directory, its config);
        whether its read may enter a collective under tensor parallelism (DoRA, or peft's
        copy of an ``embed_tokens`` / ``lm_head`` table: ``check_adapter_dir``), None when
        unknown (a hub repo id, fetched by the read).

        Raises:
            FileNotFoundError: a local path that does not exist.
            LoRAAdapterError: as ``check_adapter_dir``.
        """
        local = Path(request.lora_path).expanduser()
        if not (local.exists() or is_local_path(request.lora_path)):
            return None
        if not local.exists():
            raise FileNotFoundError(
                f"adapter {request.lora_name!r}: {request.lora_path} does not exist")
        return check_adapter_dir(request, local, self.target)

    def pin(self, adapter: LoRAAdapter) -> PinnedAdapter:
        """The host cache's form of ``adapter``, with this engine rank's slot-load
        descriptors (any thread)."""
        pinned = pin_adapter(adapter, self.host_alloc)
        return replace(pinned, slot_load=self.layout.prepare(pinned))

    def read(self, request: LoRARequest) -> PinnedAdapter:
        """Disk → pinned host memory, on the calling thread (any thread).

        Raises:
            LoRAAdapterError, FileNotFoundError, OSError: as the format readers and
                ``resolve_adapter_path``.
        """
        start = time.perf_counter()
        stream = (torch.cuda.stream(self._stream) if self._stream is not None
                  else contextlib.nullcontext())
        with stream:
            adapter = load_adapter_dir(request, resolve_adapter_path(request.lora_path),
                                       self.target)
        report_progress()
        with outside_timeout():
            adapter = self.pin(adapter)
        with self._stats_lock:
            self.stats.host_load_seconds += time.perf_counter() - start
            self.stats.host_load_bytes += adapter.nbytes
            self.stats.host_misses += 1
        return adapter

    def _submit(self, request: LoRARequest) -> Future:
        future = self._pool.submit(self.read, request, what=f"adapter {request.lora_name!r}")
        notify = self.notify
        if notify is not None:
            future.add_done_callback(lambda _: notify())
        return future

    # ------------------------------------------------------------------ reads in flight

    def start_first(self, request: LoRARequest) -> None:
        """Read a path seen for the first time on a loader thread."""
        self._first[request.lora_int_id] = FirstRead(request, self._submit(request))

    def first_read(self, lora_int_id: int) -> FirstRead | None:
        """The adapter's first read, if one is in flight (or ended, not yet taken in)."""
        return self._first.get(lora_int_id)

    def start_reread(self, request: LoRARequest) -> bool:
        """Read an adapter again on a loader thread; False (nothing started) while
        ``max_in_flight`` re-reads are in flight."""
        if len(self._rereads) >= self.max_in_flight:
            return False
        self._rereads[request.lora_int_id] = self._submit(request)
        return True

    def has_reread(self, lora_int_id: int) -> bool:
        """Whether a re-read of the adapter was started and not taken in yet."""
        return lora_int_id in self._rereads

    def take_reread(self, lora_int_id: int) -> Future | None:
        """The adapter's re-read (done or not), no longer kept here; None if none."""
        return self._rereads.pop(lora_int_id, None)

    @property
    def has_first_reads(self) -> bool:
        """Whether a first read is in flight or not taken in yet."""
        return bool(self._first)

    def is_reading(self, lora_int_id: int) -> bool:
        """Whether a loader thread is still reading the adapter (first read or re-read; a
        read that ended is not, even before it is taken in)."""
        first = self._first.get(lora_int_id)
        future = first.future if first is not None else self._rereads.get(lora_int_id)
        return future is not None and not future.done()

    def has_finished(self) -> bool:
        """Whether a read has ended that was not taken in yet."""
        return (any(f.future.done() for f in self._first.values())
                or any(f.done() for f in self._rereads.values()))

    def take_finished(self) -> tuple[list[tuple[LoRARequest, PinnedAdapter]],
                                     list[tuple[int, PinnedAdapter]],
                                     list[AdapterLoadError]]:
        """The reads that ended, no longer kept here, in the order they were started: the
        first reads' ``(request, adapter)``, the re-reads' ``(lora_int_id, adapter)``, and
        the failures (``AdapterLoadError`` for a first read, whatever it raised;
        ``AdapterReloadError`` for a re-read that raised ``LoRAAdapterError``,
        ``FileNotFoundError`` or ``OSError``).

        Raises:
            Exception: whatever else a re-read raised (a bug, not a bad adapter).
        """
        first, again, failed = [], [], []
        for lid, read in list(self._first.items()):
            if not read.future.done():
                continue
            del self._first[lid]
            try:
                first.append((read.request, read.future.result()))
            except Exception as e:             # whatever the reader met ends its requests
                logger.warning("adapter %r (%s) failed to load: %s", read.request.lora_name,
                               read.request.lora_path, e)
                failed.append(AdapterLoadError(lid, e))
        for lid, future in list(self._rereads.items()):
            if not future.done():
                continue
            del self._rereads[lid]
            try:
                again.append((lid, future.result()))
            except (LoRAAdapterError, FileNotFoundError, OSError) as e:
                failed.append(AdapterReloadError(lid, e))
        return first, again, failed

    def wait_first(self, lora_int_id: int) -> None:
        """Block until the adapter's first read (if one is in flight) has ended."""
        first = self._first.get(lora_int_id)
        if first is not None:
            with contextlib.suppress(Exception):
                first.future.result()

    def cancel(self, lora_int_id: int) -> None:
        """Forget the adapter's reads; a queued one is cancelled, a running one finishes
        unseen."""
        future = self._rereads.pop(lora_int_id, None)
        if future is not None:
            future.cancel()
        first = self._first.pop(lora_int_id, None)
        if first is not None:
            first.future.cancel()

    def pending(self) -> list[float]:
        """``time.monotonic()`` submission times of the reads not ended yet."""
        return self._pool.pending()

    @property
    def stuck(self) -> int:
        """Loader threads still inside a read that timed out."""
        return self._pool.stuck

    def shutdown(self) -> None:
        """Stop the loader threads (pending reads are dropped)."""
        self._first.clear()
        self._pool.shutdown()
