"""The host cache: pinned adapters in host memory, LRU, bounded by count and bytes.

vLLM's ``max_cpu_loras`` bounds the count; ``max_cpu_lora_bytes`` (TensorRT-LLM's
``host_cache_size``) the bytes the ``PinnedAdapter`` buffers and their slot-load descriptors
take. Which adapters may be evicted is the caller's rule (``LoRAManager``: none that waiting
requests are about to use, nor the only copy of one given as tensors while requests need
it); the least recently used of the others goes first.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Callable

from manylora.config import LoRAConfig
from manylora.lora.cache_report import LoRACacheStats
from manylora.lora.pinned import PinnedAdapter

logger = logging.getLogger(__name__)


class HostCache:
    """Pinned adapters by ``lora_int_id``, least recently used first.

    Args:
        config: ``max_cpu_loras`` and ``max_cpu_lora_bytes``, the bounds.
        stats: the counters it adds to (``host_hits``, ``host_evictions``).
        evictable: ``lora_int_id → bool``, whether an adapter may be evicted now.
        on_evict: called with the ``lora_int_id`` of each adapter it evicts.
    """

    def __init__(self, config: LoRAConfig, stats: LoRACacheStats,
                 evictable: Callable[[int], bool], on_evict: Callable[[int], None]) -> None:
        self.config = config
        self.stats = stats
        self._evictable = evictable
        self._on_evict = on_evict
        self._adapters: OrderedDict[int, PinnedAdapter] = OrderedDict()
        self._bytes = 0

    def __contains__(self, lora_int_id: int) -> bool:
        return lora_int_id in self._adapters

    @property
    def nbytes(self) -> int:
        """Host bytes of the adapters held (what ``max_cpu_lora_bytes`` bounds)."""
        return self._bytes

    def get(self, lora_int_id: int) -> PinnedAdapter | None:
        """The adapter, or None; its place in the LRU order is kept."""
        return self._adapters.get(lora_int_id)

    def hit(self, lora_int_id: int) -> PinnedAdapter | None:
        """The adapter, now most recently used and counted as a hit; None (and nothing
        counted) when it is not held."""
        adapter = self._adapters.get(lora_int_id)
        if adapter is not None:
            self._adapters.move_to_end(lora_int_id)
            self.stats.host_hits += 1
        return adapter

    def touch(self, lora_int_id: int) -> None:
        """Make the adapter, if held, the most recently used."""
        if lora_int_id in self._adapters:
            self._adapters.move_to_end(lora_int_id)

    def pop(self, lora_int_id: int) -> PinnedAdapter | None:
        """Drop the adapter (not an eviction); it, or None."""
        adapter = self._adapters.pop(lora_int_id, None)
        if adapter is not None:
            self._bytes -= adapter.nbytes
        return adapter

    def _over(self, extra_bytes: int, extra_count: int) -> bool:
        cap = self.config.max_cpu_lora_bytes
        return (len(self._adapters) + extra_count > self.config.max_cpu_loras
                or (cap is not None and self._bytes + extra_bytes > cap))

    def insert(self, adapter: PinnedAdapter, must_fit: bool) -> bool:
        """Hold ``adapter``, evicting the least recently used evictable adapters until it
        fits; whether it is held (False: it did not fit, and ``must_fit`` was False).

        Raises:
            ValueError: ``must_fit`` and the cache is full of adapters that may not be
                evicted (naming the bounds).
        """
        while self._over(adapter.nbytes, 1):
            victim = next((lid for lid in self._adapters if self._evictable(lid)), None)
            if victim is None:
                if not must_fit:
                    return False
                raise ValueError(
                    f"adapter {adapter.name!r}: the host LoRA cache (max_cpu_loras="
                    f"{self.config.max_cpu_loras}, max_cpu_lora_bytes="
                    f"{self.config.max_cpu_lora_bytes}) is full of adapters that requests "
                    "still need; retry when they finish")
            self.pop(victim)
            self.stats.host_evictions += 1
            self._on_evict(victim)
            logger.debug("host cache evicted adapter %d", victim)
        self._adapters[adapter.lora_int_id] = adapter
        self._bytes += adapter.nbytes
        return True
