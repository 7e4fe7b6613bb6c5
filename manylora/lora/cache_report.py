"""What the adapter cache reports to the engine: its counters (``LoRACacheStats``), what
``LoRAManager.poll`` took in (``AdapterEvents``), and the errors that end an adapter's
requests (``AdapterLoadError``, ``AdapterReloadError``)."""

from __future__ import annotations

from dataclasses import dataclass, field


class AdapterLoadError(RuntimeError):
    """An adapter could not be read into the host cache: its first read on a loader thread
    failed (bad weights, files gone, the host cache full of adapters in use), or a re-read
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
            digest is known and they are in the host cache (unless it is full of adapters
            that waiting requests need: then they are read again when their turn comes).
        failed: adapters whose (first or repeated) read failed; their requests must end.
    """

    ready: dict[int, str] = field(default_factory=dict)
    failed: list[AdapterLoadError] = field(default_factory=list)


@dataclass
class LoRACacheStats:
    """Counters of the two adapter tiers since the engine started: the host cache
    (``HostCache``) and the device slots (``SlotPool``). A host load is a read (disk → host
    cache, ``AdapterReader``); a device load is a slot load (host cache → slot).

    Attributes:
        host_hits / host_misses: adapters needed for a slot (or prefetched) that were / were
            not in the host cache; each miss is one disk read.
        host_evictions: adapters dropped from the host cache.
        host_load_seconds: wall time of all disk reads (parse, validate, digest, pin),
            seconds.
        host_load_bytes: bytes the reads put in the host cache (pinned adapters: tensors,
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
