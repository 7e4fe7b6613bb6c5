"""Prometheus metrics of one engine, named after vLLM v1's with the ``manylora:`` prefix.

``PrometheusStatLogger`` registers everything into the ``CollectorRegistry`` it is given
(never the process-wide default one), so several servers can live in one process. Two kinds
of metric:

* **per step** (``record``): prometheus_client ``Counter`` and ``Histogram`` objects fed from
  each ``IterationStats`` by the engine thread;
* **at scrape time**: a custom collector that calls the ``snapshot`` callable and reports the
  engine's state and cumulative cache counters (``EngineSnapshot``).

Counters are exposed with ``_total`` appended to the name below (``manylora:prompt_tokens``
→ ``manylora:prompt_tokens_total``); the per-step counters and histograms also expose
prometheus_client's ``_created`` samples. Every metric has a ``model_name`` label except
``manylora:lora_requests_info``, whose label set is exactly vLLM's ``vllm:lora_requests_info``
(read by the Gateway API inference extension's LoRA-affinity routing).

===============================================  =========  ======================  ============
name                                             type       labels (+ model_name)   unit
===============================================  =========  ======================  ============
``manylora:prompt_tokens``                       counter                            tokens
``manylora:generation_tokens``                   counter                            tokens
``manylora:request_success``                     counter    finished_reason         requests
``manylora:time_to_first_token_seconds``         histogram                          seconds
``manylora:inter_token_latency_seconds``         histogram                          seconds
``manylora:e2e_request_latency_seconds``         histogram                          seconds
``manylora:request_prompt_tokens``               histogram                          tokens
``manylora:request_generation_tokens``           histogram                          tokens
``manylora:num_requests_running``                gauge                              requests
``manylora:num_requests_waiting``                gauge                              requests
``manylora:kv_cache_usage_perc``                 gauge                              fraction 0-1
``manylora:kv_cache_blocks``                     gauge      state (used|cached|free) blocks
``manylora:prefix_cache_queries``                counter                            tokens
``manylora:prefix_cache_hits``                   counter                            tokens
``manylora:prefix_cache_hit_rate``               gauge                              fraction 0-1
``manylora:num_preemptions``                     counter                            requests
``manylora:kv_recomputed_tokens``                counter                            tokens
``manylora:kv_swapped_blocks``                   counter    direction (out|in)      blocks
``manylora:kv_evicted_blocks``                   counter                            blocks
``manylora:lora_requests_info``                  gauge      max_lora,               unix seconds
                                                            running_lora_adapters,
                                                            waiting_lora_adapters
                                                            (no model_name)
``manylora:lora_cache_hits``                     counter    tier (host|device)      adapters
``manylora:lora_cache_misses``                   counter    tier (host|device)      adapters
``manylora:lora_loads``                          counter    tier (host|device)      adapters
``manylora:lora_evictions``                      counter    tier (host|device)      adapters
``manylora:lora_load_seconds``                   counter    tier (host|device)      seconds
``manylora:lora_sync_disk_loads``                counter                            adapters
``manylora:lora_device_load_bytes``              counter                            bytes
``manylora:lora_host_load_bytes``                counter                            bytes
``manylora:lora_load_failures``                  counter                            adapters
``manylora:lora_adapter_waits``                  counter                            requests
``manylora:lora_adapter_wait_seconds``           counter                            seconds
``manylora:lora_pending_loads``                  gauge                              adapters
``manylora:lora_oldest_pending_load_seconds``    gauge                              seconds
``manylora:lora_stuck_loader_threads``           gauge                              threads
===============================================  =========  ======================  ============

Notes: ``request_success`` counts every finished request, aborted ones included
(``finished_reason="abort"``), and the three per-request histograms likewise observe
every finished request. ``lora_loads`` is disk reads for the host tier (= host misses)
and host → device copies into a slot for the device tier (= device misses, slot loads);
``lora_load_seconds`` is the disk reads' wall time (read, validate, digest, pin; on
loader threads) for the host tier and the copies' GPU time (CUDA events on the copy
stream; host time on the CPU) for the device tier. ``lora_adapter_waits`` counts
requests that arrived while their adapter was on disk only (a first read, or a re-read
after an eviction) and ``lora_adapter_wait_seconds`` the time they waited for it to
reach host memory (counted when it does); ``lora_sync_disk_loads`` counts the reads a
step itself waited for. ``lora_pending_loads`` is the disk reads queued or running as of
the engine's last report (sent whenever a read starts or ends) and
``lora_oldest_pending_load_seconds`` the age of the oldest at the scrape (0 when none);
``lora_stuck_loader_threads`` counts loader threads still inside a read that exceeded
``lora_load_timeout``. ``prefix_cache_hit_rate`` is hits / queries since start, 0
before any query; ``kv_cache_usage_perc`` is used / total device blocks, 0 when there
are none. ``lora_requests_info`` has one sample, valued at the scrape's unix time, with
the adapter names comma-joined (empty string when none), present whether or not LoRA is
on (``max_lora="0"`` when off).

Label values are written as :func:`label_value` makes them: a name holding a code point
UTF-8 cannot encode (a lone surrogate) has it as escape text, so one such adapter or model
name cannot make ``generate_latest`` (which encodes the whole exposition) fail every scrape.
Quotes, backslashes and newlines are escaped by prometheus_client, as the text format says.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import prometheus_client
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from manylora.engine.stats import EngineSnapshot, IterationStats

PREFIX = "manylora:"

# Per step (PrometheusStatLogger.record).
PROMPT_TOKENS = PREFIX + "prompt_tokens"
GENERATION_TOKENS = PREFIX + "generation_tokens"
REQUEST_SUCCESS = PREFIX + "request_success"
TIME_TO_FIRST_TOKEN = PREFIX + "time_to_first_token_seconds"
INTER_TOKEN_LATENCY = PREFIX + "inter_token_latency_seconds"
E2E_REQUEST_LATENCY = PREFIX + "e2e_request_latency_seconds"
REQUEST_PROMPT_TOKENS = PREFIX + "request_prompt_tokens"
REQUEST_GENERATION_TOKENS = PREFIX + "request_generation_tokens"

# At scrape time (from the engine snapshot).
NUM_REQUESTS_RUNNING = PREFIX + "num_requests_running"
NUM_REQUESTS_WAITING = PREFIX + "num_requests_waiting"
KV_CACHE_USAGE_PERC = PREFIX + "kv_cache_usage_perc"
KV_CACHE_BLOCKS = PREFIX + "kv_cache_blocks"
PREFIX_CACHE_QUERIES = PREFIX + "prefix_cache_queries"
PREFIX_CACHE_HITS = PREFIX + "prefix_cache_hits"
PREFIX_CACHE_HIT_RATE = PREFIX + "prefix_cache_hit_rate"
NUM_PREEMPTIONS = PREFIX + "num_preemptions"
KV_RECOMPUTED_TOKENS = PREFIX + "kv_recomputed_tokens"
KV_SWAPPED_BLOCKS = PREFIX + "kv_swapped_blocks"
KV_EVICTED_BLOCKS = PREFIX + "kv_evicted_blocks"
LORA_REQUESTS_INFO = PREFIX + "lora_requests_info"
LORA_CACHE_HITS = PREFIX + "lora_cache_hits"
LORA_CACHE_MISSES = PREFIX + "lora_cache_misses"
LORA_LOADS = PREFIX + "lora_loads"
LORA_EVICTIONS = PREFIX + "lora_evictions"
LORA_LOAD_SECONDS = PREFIX + "lora_load_seconds"
LORA_SYNC_DISK_LOADS = PREFIX + "lora_sync_disk_loads"
LORA_DEVICE_LOAD_BYTES = PREFIX + "lora_device_load_bytes"
LORA_HOST_LOAD_BYTES = PREFIX + "lora_host_load_bytes"
LORA_LOAD_FAILURES = PREFIX + "lora_load_failures"
LORA_ADAPTER_WAITS = PREFIX + "lora_adapter_waits"
LORA_ADAPTER_WAIT_SECONDS = PREFIX + "lora_adapter_wait_seconds"
LORA_PENDING_LOADS = PREFIX + "lora_pending_loads"
LORA_OLDEST_PENDING_LOAD = PREFIX + "lora_oldest_pending_load_seconds"
LORA_STUCK_LOADER_THREADS = PREFIX + "lora_stuck_loader_threads"

# Finish reasons whose request_success series exist (at 0) from the start.
FINISH_REASONS = ("stop", "length", "abort", "error")

# Histogram bucket upper bounds, seconds: vLLM v1's, with finer low buckets for inter-token
# latency (small models decode in a few milliseconds).
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.0075, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3,
               0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
E2E_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0,
                       50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)


@dataclass(frozen=True)
class MetricSpec:
    """One metric family this module exposes.

    Attributes:
        name: the family name as registered (``manylora:prompt_tokens``); counters are
            exposed with ``_total`` appended (see ``sample_names``).
        kind: ``"counter"``, ``"gauge"`` or ``"histogram"``.
        labels: label names, ``model_name`` first where present.
        unit: what one unit of the value is (``"tokens"``, ``"seconds"``, ...).
        help: the HELP text.
        source: ``"record"`` (fed per step by ``PrometheusStatLogger.record``) or
            ``"snapshot"`` (read from the engine snapshot at scrape time).
    """

    name: str
    kind: str
    labels: tuple[str, ...]
    unit: str
    help: str
    source: str = "snapshot"

    @property
    def sample_names(self) -> tuple[str, ...]:
        """The sample names in the exposition (without ``_created``): ``name_total`` for a
        counter, ``name`` for a gauge, ``name_bucket``/``name_count``/``name_sum`` for a
        histogram."""
        if self.kind == "counter":
            return (self.name + "_total",)
        if self.kind == "histogram":
            return (self.name + "_bucket", self.name + "_count", self.name + "_sum")
        return (self.name,)


_M = ("model_name",)
_TIER = ("model_name", "tier")

METRICS: dict[str, MetricSpec] = {spec.name: spec for spec in (
    MetricSpec(PROMPT_TOKENS, "counter", _M, "tokens", "Number of prefill tokens processed.",
               "record"),
    MetricSpec(GENERATION_TOKENS, "counter", _M, "tokens",
               "Number of generation tokens processed.", "record"),
    MetricSpec(REQUEST_SUCCESS, "counter", ("model_name", "finished_reason"), "requests",
               "Count of finished requests, by finish reason (abort included).", "record"),
    MetricSpec(TIME_TO_FIRST_TOKEN, "histogram", _M, "seconds",
               "Histogram of time to first token in seconds.", "record"),
    MetricSpec(INTER_TOKEN_LATENCY, "histogram", _M, "seconds",
               "Histogram of inter-token latency in seconds.", "record"),
    MetricSpec(E2E_REQUEST_LATENCY, "histogram", _M, "seconds",
               "Histogram of end to end request latency in seconds.", "record"),
    MetricSpec(REQUEST_PROMPT_TOKENS, "histogram", _M, "tokens",
               "Number of prefill tokens per finished request.", "record"),
    MetricSpec(REQUEST_GENERATION_TOKENS, "histogram", _M, "tokens",
               "Number of generation tokens per finished request.", "record"),
    MetricSpec(NUM_REQUESTS_RUNNING, "gauge", _M, "requests",
               "Number of requests in the running batch."),
    MetricSpec(NUM_REQUESTS_WAITING, "gauge", _M, "requests",
               "Number of requests waiting to be processed."),
    MetricSpec(KV_CACHE_USAGE_PERC, "gauge", _M, "fraction",
               "Fraction of KV-cache blocks in use (0 to 1)."),
    MetricSpec(KV_CACHE_BLOCKS, "gauge", ("model_name", "state"), "blocks",
               "KV-cache device blocks by state: used, cached (reusable prefix) or free."),
    MetricSpec(PREFIX_CACHE_QUERIES, "counter", _M, "tokens",
               "Prefix cache queries, in prompt tokens looked up."),
    MetricSpec(PREFIX_CACHE_HITS, "counter", _M, "tokens",
               "Prefix cache hits, in prompt tokens found cached."),
    MetricSpec(PREFIX_CACHE_HIT_RATE, "gauge", _M, "fraction",
               "Prefix cache hits / queries (tokens) since start, 0 before any query."),
    MetricSpec(NUM_PREEMPTIONS, "counter", _M, "requests",
               "Requests preempted under KV-cache memory pressure."),
    MetricSpec(KV_RECOMPUTED_TOKENS, "counter", _M, "tokens",
               "Tokens computed again because their KV blocks were lost."),
    MetricSpec(KV_SWAPPED_BLOCKS, "counter", ("model_name", "direction"), "blocks",
               "KV blocks copied device to host (out) and host to device (in)."),
    MetricSpec(KV_EVICTED_BLOCKS, "counter", _M, "blocks",
               "Cached KV blocks reused for new contents."),
    MetricSpec(LORA_REQUESTS_INFO, "gauge",
               ("max_lora", "running_lora_adapters", "waiting_lora_adapters"), "unix seconds",
               "Running stats on lora requests."),
    MetricSpec(LORA_CACHE_HITS, "counter", _TIER, "adapters",
               "Adapter lookups that found the adapter in the tier."),
    MetricSpec(LORA_CACHE_MISSES, "counter", _TIER, "adapters",
               "Adapter lookups that did not find the adapter in the tier."),
    MetricSpec(LORA_LOADS, "counter", _TIER, "adapters",
               "Adapter loads into the tier: disk reads (host), host to device copies (device)."),
    MetricSpec(LORA_EVICTIONS, "counter", _TIER, "adapters",
               "Adapters evicted from the tier."),
    MetricSpec(LORA_LOAD_SECONDS, "counter", _TIER, "seconds",
               "Seconds spent loading adapters into the tier."),
    MetricSpec(LORA_SYNC_DISK_LOADS, "counter", _M, "adapters",
               "Adapter disk reads an engine step had to wait for."),
    MetricSpec(LORA_DEVICE_LOAD_BYTES, "counter", _M, "bytes",
               "Bytes of completed host to device adapter copies."),
    MetricSpec(LORA_HOST_LOAD_BYTES, "counter", _M, "bytes",
               "Bytes of adapter tensors read from disk into the host tier."),
    MetricSpec(LORA_LOAD_FAILURES, "counter", _M, "adapters",
               "Adapter disk reads that failed (their requests ended with the error)."),
    MetricSpec(LORA_ADAPTER_WAITS, "counter", _M, "requests",
               "Requests that waited in the queue for their adapter's disk read."),
    MetricSpec(LORA_ADAPTER_WAIT_SECONDS, "counter", _M, "seconds",
               "Seconds requests waited in the queue for their adapter's disk read."),
    MetricSpec(LORA_PENDING_LOADS, "gauge", _M, "adapters",
               "Adapter disk reads queued or running."),
    MetricSpec(LORA_OLDEST_PENDING_LOAD, "gauge", _M, "seconds",
               "Age of the oldest adapter disk read queued or running, 0 when none."),
    MetricSpec(LORA_STUCK_LOADER_THREADS, "gauge", _M, "threads",
               "Loader threads still inside an adapter read that exceeded its time bound."),
)}


def label_value(text: str) -> str:
    """``text`` as a label value the exposition can encode: each code point UTF-8 cannot
    encode (a lone surrogate) replaced by its backslash escape (``"\\ud800"``)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return text.encode("utf-8", "backslashreplace").decode("utf-8")
    return text


def build_1_2_5_buckets(max_value: int) -> tuple[int, ...]:
    """Bucket bounds 1, 2, 5, 10, 20, 50, ... up to and including ``max_value`` when it falls
    on the ladder (every bound <= ``max_value``).

    Raises:
        ValueError: ``max_value`` < 1.
    """
    if max_value < 1:
        raise ValueError(f"max_value must be >= 1, got {max_value}")
    bounds: list[int] = []
    scale = 1
    while True:
        for mantissa in (1, 2, 5):
            value = mantissa * scale
            if value > max_value:
                return tuple(bounds)
            bounds.append(value)
        scale *= 10


class PrometheusStatLogger:
    """Feeds one engine's stats into a Prometheus registry (see the module docstring).

    Args:
        registry: where every metric is registered; a second logger (or anything else
            exposing the same names) in the same registry raises ``ValueError``.
        model_name: the ``model_name`` label value (as :func:`label_value` writes it).
        snapshot: returns the engine's latest state; called on every scrape, from the
            scraping thread, so it must be cheap and thread-safe (returning the last published
            ``EngineSnapshot`` is). An exception it raises propagates out of the scrape
            (``prometheus_client.generate_latest``).
        max_model_len: the largest request length, tokens: the top of the 1-2-5 bucket ladder
            of the per-request token histograms.
        clock: unix time in seconds, the value of ``manylora:lora_requests_info``.

    Attributes:
        registry: the registry given.
        model_name: the ``model_name`` label value, as written.

    Raises:
        ValueError: a metric name is already registered in ``registry``, or
            ``max_model_len`` < 1. Nothing is left registered then.
    """

    def __init__(self, registry: prometheus_client.CollectorRegistry, model_name: str,
                 snapshot: Callable[[], EngineSnapshot], *, max_model_len: int = 131072,
                 clock: Callable[[], float] = time.time) -> None:
        token_buckets = build_1_2_5_buckets(max_model_len)
        model_name = label_value(model_name)
        self.model_name = model_name
        self.registry = registry
        self._collectors: list[Collector] = []

        def counter(name: str) -> prometheus_client.Counter:
            spec = METRICS[name]
            metric = prometheus_client.Counter(name, spec.help, list(spec.labels),
                                               registry=registry)
            self._collectors.append(metric)
            return metric

        def histogram(name: str, buckets: tuple[float, ...]) -> prometheus_client.Histogram:
            spec = METRICS[name]
            metric = prometheus_client.Histogram(name, spec.help, list(spec.labels),
                                                 buckets=buckets, registry=registry)
            self._collectors.append(metric)
            return metric

        collector = _SnapshotCollector(model_name, snapshot, clock)
        registry.register(collector)
        self._collectors.append(collector)
        try:
            self._prompt_tokens = counter(PROMPT_TOKENS).labels(model_name)
            self._generation_tokens = counter(GENERATION_TOKENS).labels(model_name)
            self._request_success = counter(REQUEST_SUCCESS)
            self._success_by_reason = {
                reason: self._request_success.labels(model_name, reason)
                for reason in FINISH_REASONS}
            self._ttft = histogram(TIME_TO_FIRST_TOKEN, TTFT_BUCKETS).labels(model_name)
            self._itl = histogram(INTER_TOKEN_LATENCY, ITL_BUCKETS).labels(model_name)
            self._e2e = histogram(E2E_REQUEST_LATENCY, E2E_LATENCY_BUCKETS).labels(model_name)
            self._request_prompt_tokens = histogram(
                REQUEST_PROMPT_TOKENS, token_buckets).labels(model_name)
            self._request_generation_tokens = histogram(
                REQUEST_GENERATION_TOKENS, token_buckets).labels(model_name)
        except ValueError:
            self.unregister()
            raise

    def record(self, stats: IterationStats) -> None:
        """Adds one engine step's tokens, latencies (seconds) and finished requests.

        Safe to call from the engine thread while another thread scrapes.

        Raises:
            ValueError: a token count in ``stats`` is negative (counters only go up).
        """
        if stats.num_prompt_tokens:
            self._prompt_tokens.inc(stats.num_prompt_tokens)
        if stats.num_generation_tokens:
            self._generation_tokens.inc(stats.num_generation_tokens)
        for seconds in stats.time_to_first_tokens:
            self._ttft.observe(seconds)
        for seconds in stats.inter_token_latencies:
            self._itl.observe(seconds)
        for req in stats.finished:
            success = self._success_by_reason.get(req.finish_reason)
            if success is None:
                success = self._request_success.labels(self.model_name, req.finish_reason)
                self._success_by_reason[req.finish_reason] = success
            success.inc()
            self._e2e.observe(req.e2e_latency)
            self._request_prompt_tokens.observe(req.num_prompt_tokens)
            self._request_generation_tokens.observe(req.num_generation_tokens)

    def unregister(self) -> None:
        """Removes this logger's metrics from its registry (e.g. when its server stops), so
        another logger may register there. Calling it again does nothing."""
        collectors, self._collectors = self._collectors, []
        for collector in collectors:
            self.registry.unregister(collector)


class _SnapshotCollector(Collector):
    """The scrape-time metrics: calls ``snapshot()`` once per ``collect``."""

    def __init__(self, model_name: str, snapshot: Callable[[], EngineSnapshot],
                 clock: Callable[[], float]) -> None:
        self._model_name = model_name
        self._snapshot = snapshot
        self._clock = clock

    def describe(self) -> Iterator[Metric]:
        """The families without samples, so the registry checks names without calling
        ``snapshot``."""
        return iter(self._families(None))

    def collect(self) -> Iterator[Metric]:
        """The families with the current snapshot's values."""
        return iter(self._families(self._snapshot()))

    def _families(self, snap: EngineSnapshot | None) -> list[Metric]:
        m = [self._model_name]
        families: dict[str, Metric] = {}
        for name, spec in METRICS.items():
            if spec.source != "snapshot":
                continue
            family = CounterMetricFamily if spec.kind == "counter" else GaugeMetricFamily
            families[name] = family(name, spec.help, labels=spec.labels)
        if snap is None:
            return list(families.values())

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
        return list(families.values())
