"""The metrics read at scrape time: the engine's state and cumulative cache counters
(``EngineSnapshot``), reported by a custom collector that calls ``snapshot()`` on each
scrape (the running and waiting requests, KV cache use and prefix cache, preemptions and
swaps, the LoRA tiers' hits, loads, evictions and pending reads, ``lora_requests_info``,
``cache_config_info``)."""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from manylora.engine.stats import EngineSnapshot
from manylora.metrics.catalog import (
    CACHE_CONFIG_INFO,
    KV_CACHE_BLOCKS,
    KV_CACHE_USAGE_PERC,
    KV_EVICTED_BLOCKS,
    KV_RECOMPUTED_TOKENS,
    KV_SWAPPED_BLOCKS,
    LORA_ADAPTER_WAIT_SECONDS,
    LORA_ADAPTER_WAITS,
    LORA_CACHE_HITS,
    LORA_CACHE_MISSES,
    LORA_DEVICE_LOAD_BYTES,
    LORA_EVICTIONS,
    LORA_HOST_LOAD_BYTES,
    LORA_LOAD_FAILURES,
    LORA_LOAD_SECONDS,
    LORA_LOADS,
    LORA_OLDEST_PENDING_LOAD,
    LORA_PENDING_LOADS,
    LORA_REQUESTS_INFO,
    LORA_STUCK_LOADER_THREADS,
    LORA_SYNC_DISK_LOADS,
    METRICS,
    NUM_PREEMPTIONS,
    NUM_REQUESTS_RUNNING,
    NUM_REQUESTS_WAITING,
    PREFIX_CACHE_ALORA_HITS,
    PREFIX_CACHE_HIT_RATE,
    PREFIX_CACHE_HITS,
    PREFIX_CACHE_QUERIES,
    label_value,
)
from manylora.metrics.vllm_names import VLLM_METRICS


class SnapshotCollector(Collector):
    """The scrape-time metrics (a prometheus_client collector): calls ``snapshot()`` once
    per ``collect`` and reports the families of :data:`~manylora.metrics.catalog.METRICS`
    whose source is ``"snapshot"``, under our names and (``names``) vLLM's.

    Args:
        model_name: the ``model_name`` label value, as written.
        snapshot: returns the engine's latest state (cheap and thread-safe).
        clock: unix time in seconds (``lora_requests_info``'s value, pending load ages).
        names: the name sets to expose (``"manylora"``, ``"vllm"``).
        cache_config: the label values of ``cache_config_info``.
    """

    def __init__(self, model_name: str, snapshot: Callable[[], EngineSnapshot],
                 clock: Callable[[], float], names: frozenset[str],
                 cache_config: dict[str, str]) -> None:
        self._model_name = model_name
        self._snapshot = snapshot
        self._clock = clock
        self._names = names
        self._cache_config = {k: label_value(str(v)) for k, v in cache_config.items()}

    def describe(self) -> Iterator[Metric]:
        """The families without samples, so the registry checks names without calling
        ``snapshot``."""
        return iter(self._families(None))

    def collect(self) -> Iterator[Metric]:
        """The families with the current snapshot's values."""
        return iter(self._families(self._snapshot()))

    def _labels(self, name: str, labels: tuple[str, ...]) -> tuple[str, ...]:
        if name in (CACHE_CONFIG_INFO, "vllm:cache_config_info"):
            return (*labels, *self._cache_config)
        return labels

    def _families(self, snap: EngineSnapshot | None) -> list[Metric]:
        m = [self._model_name]
        families: dict[str, Metric] = {}
        for name, spec in METRICS.items():
            if spec.source != "snapshot":
                continue
            family = CounterMetricFamily if spec.kind == "counter" else GaugeMetricFamily
            families[name] = family(name, spec.help, labels=self._labels(name, spec.labels))
        if snap is not None:
            self._fill(families, snap, m)
        out: list[Metric] = []
        if "manylora" in self._names:
            out.extend(families.values())
        if "vllm" in self._names:
            for alias in VLLM_METRICS.values():
                spec = METRICS[alias.source]
                if spec.source != "snapshot":
                    continue
                source = families[alias.source]
                family = CounterMetricFamily if spec.kind == "counter" else GaugeMetricFamily
                copy = family(alias.name, spec.help,
                              labels=self._labels(alias.name, alias.labels))
                engine = alias.labels[1:2] == ("engine",)
                for sample in source.samples:
                    if sample.name.endswith("_created"):
                        continue
                    values = list(sample.labels.values())
                    if engine:
                        values.insert(1, "0")
                    copy.add_metric(values, sample.value)
                out.append(copy)
        return out

    def _fill(self, families: dict[str, Metric], snap: EngineSnapshot, m: list[str]) -> None:
        """Add ``snap``'s values to our families."""
        kv, lora = snap.kv, snap.lora
        families[NUM_REQUESTS_RUNNING].add_metric(m, snap.num_running)
        families[NUM_REQUESTS_WAITING].add_metric(m, snap.num_waiting)
        usage = kv.used_blocks / kv.num_blocks if kv.num_blocks else 0.0
        families[KV_CACHE_USAGE_PERC].add_metric(m, usage)
        for state, count in (("used", kv.used_blocks), ("cached", kv.cached_blocks),
                             ("free", kv.free_blocks)):
            families[KV_CACHE_BLOCKS].add_metric(m + [state], count)
        families[PREFIX_CACHE_QUERIES].add_metric(m, kv.prefix_queries)
        families[PREFIX_CACHE_HITS].add_metric(m, kv.prefix_hits)
        hit_rate = kv.prefix_hits / kv.prefix_queries if kv.prefix_queries else 0.0
        families[PREFIX_CACHE_HIT_RATE].add_metric(m, hit_rate)
        families[PREFIX_CACHE_ALORA_HITS].add_metric(m, kv.prefix_hits_alora)
        families[NUM_PREEMPTIONS].add_metric(m, kv.preemptions)
        families[KV_RECOMPUTED_TOKENS].add_metric(m, kv.recomputed_tokens)
        families[KV_SWAPPED_BLOCKS].add_metric(m + ["out"], kv.swapped_out_blocks)
        families[KV_SWAPPED_BLOCKS].add_metric(m + ["in"], kv.swapped_in_blocks)
        families[KV_EVICTED_BLOCKS].add_metric(m, kv.evicted_blocks)
        families[LORA_REQUESTS_INFO].add_metric(
            [str(snap.max_loras), label_value(",".join(snap.running_lora_adapters)),
             label_value(",".join(snap.waiting_lora_adapters))], self._clock())
        for name, host, device in (
                (LORA_CACHE_HITS, lora.host_hits, lora.device_hits),
                (LORA_CACHE_MISSES, lora.host_misses, lora.device_misses),
                (LORA_LOADS, lora.host_misses, lora.device_misses),
                (LORA_EVICTIONS, lora.host_evictions, lora.device_evictions),
                (LORA_LOAD_SECONDS, lora.host_load_seconds, lora.device_load_seconds)):
            families[name].add_metric(m + ["host"], host)
            families[name].add_metric(m + ["device"], device)
        families[LORA_SYNC_DISK_LOADS].add_metric(m, lora.sync_disk_loads)
        families[LORA_DEVICE_LOAD_BYTES].add_metric(m, lora.device_load_bytes)
        families[LORA_HOST_LOAD_BYTES].add_metric(m, lora.host_load_bytes)
        families[LORA_LOAD_FAILURES].add_metric(m, lora.host_load_failures)
        families[LORA_ADAPTER_WAITS].add_metric(m, lora.adapter_waits)
        families[LORA_ADAPTER_WAIT_SECONDS].add_metric(m, lora.adapter_wait_seconds)
        families[LORA_PENDING_LOADS].add_metric(m, lora.pending_loads)
        since = lora.oldest_pending_load_since
        families[LORA_OLDEST_PENDING_LOAD].add_metric(
            m, 0.0 if since is None else max(self._clock() - since, 0.0))
        families[LORA_STUCK_LOADER_THREADS].add_metric(m, lora.stuck_loader_threads)
        families[CACHE_CONFIG_INFO].add_metric(
            m + [v for v in self._cache_config.values()], 1)
