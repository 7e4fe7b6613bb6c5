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
``manylora:request_queue_time_seconds``          histogram                          seconds
``manylora:request_prefill_time_seconds``        histogram                          seconds
``manylora:request_decode_time_seconds``         histogram                          seconds
``manylora:request_inference_time_seconds``      histogram                          seconds
``manylora:time_per_prefill_token_request_seconds`` histogram                       seconds
``manylora:request_time_per_output_token_seconds`` histogram                        seconds
``manylora:request_max_num_generation_tokens``   histogram                          tokens
``manylora:request_params_max_tokens``           histogram                          tokens
``manylora:iteration_tokens_total``              histogram                          tokens
``manylora:lora_request_success``                counter    lora_name,              requests
                                                            finished_reason
``manylora:lora_prompt_tokens``                  counter    lora_name               tokens
``manylora:lora_generation_tokens``              counter    lora_name               tokens
``manylora:lora_time_to_first_token_seconds``    histogram  lora_name               seconds
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
``manylora:cache_config_info``                   gauge      block_size,             1
                                                            num_gpu_blocks, ...
===============================================  =========  ======================  ============

**vLLM's names.** Each series of vLLM v1's ``PrometheusStatLogger`` that we measure is also
exposed under vLLM's name and labels (``VLLM_METRICS``), so a vLLM dashboard reads it:
``model_name`` and ``engine`` (always ``"0"``) plus the source's other labels, vLLM's
buckets. ``vllm:prompt_tokens``, ``vllm:generation_tokens``, ``vllm:request_success``,
``vllm:time_to_first_token_seconds``, ``vllm:e2e_request_latency_seconds``,
``vllm:request_queue_time_seconds``, ``vllm:request_prefill_time_seconds``,
``vllm:request_decode_time_seconds``, ``vllm:request_inference_time_seconds``,
``vllm:time_per_prefill_token_request_seconds``,
``vllm:request_time_per_output_token_seconds``, ``vllm:request_prompt_tokens``,
``vllm:request_generation_tokens``, ``vllm:request_max_num_generation_tokens``,
``vllm:request_params_max_tokens``, ``vllm:iteration_tokens_total``,
``vllm:num_requests_running``, ``vllm:num_requests_waiting``, ``vllm:kv_cache_usage_perc``,
``vllm:prefix_cache_queries``, ``vllm:prefix_cache_hits``, ``vllm:num_preemptions`` and
``vllm:cache_config_info`` repeat the ``manylora:`` series of the same name;
``vllm:time_per_output_token_seconds`` and ``vllm:inter_token_latency_seconds`` repeat
``inter_token_latency_seconds`` (in vLLM's coarser buckets), ``vllm:gpu_cache_usage_perc``
``kv_cache_usage_perc``, ``vllm:gpu_prefix_cache_queries`` and ``vllm:gpu_prefix_cache_hits``
the prefix cache counters (vLLM's deprecated names, still read by its dashboard), and
``vllm:lora_requests_info`` has ``lora_requests_info``'s labels exactly. vLLM's
``request_params_n`` is not exposed: a request with ``n`` > 1 reaches the engine as ``n``
requests. ``names`` (``--metrics-names``) turns either set off.

**Per adapter** (``manylora:`` only; vLLM has no per-adapter series): ``lora_request_success``,
``lora_prompt_tokens``, ``lora_generation_tokens`` and ``lora_time_to_first_token_seconds``
count each finished request of an adapter (not the base model's) when it ends, under its
``lora_name``. The first ``max_lora_labels`` (``--max-lora-metric-labels``) adapter names
seen get series of their own; later ones are counted under ``lora_name="other"``, so a
server with many adapters keeps a bounded number of series.

Notes: ``request_success`` counts every finished request, aborted ones included
(``finished_reason="abort"``), and the per-request histograms likewise observe every
finished request. A request's phases are vLLM's: queue time from arrival to the scheduler
first running it (to its end when it never ran), prefill time from then to its first token,
decode time from its first token to its last, inference time prefill + decode;
``request_time_per_output_token_seconds`` is decode time over the tokens after the first
(requests with two tokens or more); ``request_max_num_generation_tokens`` observes its
generated tokens (one sequence per engine request) and ``iteration_tokens_total`` each
step's prompt + generation tokens (steps with none are not observed). ``lora_loads`` is
disk reads for the host tier (= host misses) and host → device copies into a slot for the
device tier (= device misses, slot loads); ``lora_load_seconds`` is the disk reads' wall
time (read, validate, digest, pin; on loader threads) for the host tier and the copies' GPU
time (CUDA events on the copy stream; host time on the CPU) for the device tier.
``lora_adapter_waits`` counts requests that arrived while their adapter was on disk only (a
first read, or a re-read after an eviction) and ``lora_adapter_wait_seconds`` the time they
waited for it to reach host memory (counted when it does); ``lora_sync_disk_loads`` counts
the reads a step itself waited for. ``lora_pending_loads`` is the disk reads queued or
running as of the engine's last report (sent whenever a read starts or ends) and
``lora_oldest_pending_load_seconds`` the age of the oldest at the scrape (0 when none);
``lora_stuck_loader_threads`` counts loader threads still inside a read that exceeded
``lora_load_timeout``. ``prefix_cache_hit_rate`` is hits / queries since start, 0 before
any query; ``kv_cache_usage_perc`` is used / total device blocks, 0 when there are none.
``lora_requests_info`` has one sample, valued at the scrape's unix time, with the adapter
names comma-joined (empty string when none), present whether or not LoRA is on
(``max_lora="0"`` when off).

Label values are written as :func:`label_value` makes them: a name holding a code point
UTF-8 cannot encode (a lone surrogate) has it as escape text, so one such adapter or model
name cannot make ``generate_latest`` (which encodes the whole exposition) fail every scrape.
Quotes, backslashes and newlines are escaped by prometheus_client, as the text format says.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator, Mapping
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
REQUEST_QUEUE_TIME = PREFIX + "request_queue_time_seconds"
REQUEST_PREFILL_TIME = PREFIX + "request_prefill_time_seconds"
REQUEST_DECODE_TIME = PREFIX + "request_decode_time_seconds"
REQUEST_INFERENCE_TIME = PREFIX + "request_inference_time_seconds"
TIME_PER_PREFILL_TOKEN = PREFIX + "time_per_prefill_token_request_seconds"
REQUEST_TIME_PER_OUTPUT_TOKEN = PREFIX + "request_time_per_output_token_seconds"
REQUEST_MAX_NUM_GENERATION_TOKENS = PREFIX + "request_max_num_generation_tokens"
REQUEST_PARAMS_MAX_TOKENS = PREFIX + "request_params_max_tokens"
ITERATION_TOKENS = PREFIX + "iteration_tokens_total"
LORA_REQUEST_SUCCESS = PREFIX + "lora_request_success"
LORA_PROMPT_TOKENS = PREFIX + "lora_prompt_tokens"
LORA_GENERATION_TOKENS = PREFIX + "lora_generation_tokens"
LORA_TIME_TO_FIRST_TOKEN = PREFIX + "lora_time_to_first_token_seconds"
CACHE_CONFIG_INFO = PREFIX + "cache_config_info"

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
# vLLM v1's own bounds for the series it names differently from ours or we do not bucket alike.
VLLM_TPOT_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5,
                     5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
PREFILL_TOKEN_BUCKETS = (0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0)
ITERATION_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)

#: Which name sets ``PrometheusStatLogger`` exposes (``--metrics-names``).
NAME_SETS = ("manylora", "vllm")
#: The ``lora_name`` value adapters past the label bound are counted under.
OTHER_LORA = "other"


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
    MetricSpec(REQUEST_QUEUE_TIME, "histogram", _M, "seconds",
               "Histogram of time spent in WAITING phase for request.", "record"),
    MetricSpec(REQUEST_PREFILL_TIME, "histogram", _M, "seconds",
               "Histogram of time spent in PREFILL phase for request.", "record"),
    MetricSpec(REQUEST_DECODE_TIME, "histogram", _M, "seconds",
               "Histogram of time spent in DECODE phase for request.", "record"),
    MetricSpec(REQUEST_INFERENCE_TIME, "histogram", _M, "seconds",
               "Histogram of time spent in RUNNING phase for request.", "record"),
    MetricSpec(TIME_PER_PREFILL_TOKEN, "histogram", _M, "seconds",
               "Time spent per token during prefill phase in seconds.", "record"),
    MetricSpec(REQUEST_TIME_PER_OUTPUT_TOKEN, "histogram", _M, "seconds",
               "Histogram of time_per_output_token_seconds per request.", "record"),
    MetricSpec(REQUEST_MAX_NUM_GENERATION_TOKENS, "histogram", _M, "tokens",
               "Histogram of maximum number of requested generation tokens.", "record"),
    MetricSpec(REQUEST_PARAMS_MAX_TOKENS, "histogram", _M, "tokens",
               "Histogram of the max_tokens request parameter.", "record"),
    MetricSpec(ITERATION_TOKENS, "histogram", _M, "tokens",
               "Histogram of number of tokens per engine_step.", "record"),
    MetricSpec(LORA_REQUEST_SUCCESS, "counter", ("model_name", "lora_name", "finished_reason"),
               "requests", "Finished requests per adapter, by finish reason.", "record"),
    MetricSpec(LORA_PROMPT_TOKENS, "counter", ("model_name", "lora_name"), "tokens",
               "Prompt tokens of finished requests per adapter.", "record"),
    MetricSpec(LORA_GENERATION_TOKENS, "counter", ("model_name", "lora_name"), "tokens",
               "Generation tokens of finished requests per adapter.", "record"),
    MetricSpec(LORA_TIME_TO_FIRST_TOKEN, "histogram", ("model_name", "lora_name"), "seconds",
               "Histogram of time to first token per adapter in seconds.", "record"),
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
    MetricSpec(CACHE_CONFIG_INFO, "gauge", ("model_name",), "1",
               "Information of the LLMEngine CacheConfig"),
)}

_BUCKETS: dict[str, tuple[float, ...] | None] = {
    TIME_TO_FIRST_TOKEN: TTFT_BUCKETS, INTER_TOKEN_LATENCY: ITL_BUCKETS,
    E2E_REQUEST_LATENCY: E2E_LATENCY_BUCKETS, REQUEST_QUEUE_TIME: E2E_LATENCY_BUCKETS,
    REQUEST_PREFILL_TIME: E2E_LATENCY_BUCKETS, REQUEST_DECODE_TIME: E2E_LATENCY_BUCKETS,
    REQUEST_INFERENCE_TIME: E2E_LATENCY_BUCKETS, TIME_PER_PREFILL_TOKEN: PREFILL_TOKEN_BUCKETS,
    ITERATION_TOKENS: ITERATION_TOKEN_BUCKETS, LORA_TIME_TO_FIRST_TOKEN: TTFT_BUCKETS,
    REQUEST_TIME_PER_OUTPUT_TOKEN: VLLM_TPOT_BUCKETS,
    REQUEST_PROMPT_TOKENS: None, REQUEST_GENERATION_TOKENS: None,
    REQUEST_MAX_NUM_GENERATION_TOKENS: None, REQUEST_PARAMS_MAX_TOKENS: None,
}  # None: the 1-2-5 ladder up to max_model_len


@dataclass(frozen=True)
class VllmAlias:
    """One vLLM v1 series exposed from one of ours (same meaning, same unit).

    Attributes:
        name: vLLM's family name (``vllm:prompt_tokens``; counters get ``_total``).
        source: our metric it repeats (a key of ``METRICS``).
        buckets: vLLM's bucket bounds where they differ from ours, else None (ours).

    Its labels are vLLM's: ``model_name``, ``engine`` (always ``"0"``: one engine core)
    and the source's other labels; ``vllm:lora_requests_info`` has exactly the source's.
    """

    name: str
    source: str
    buckets: tuple[float, ...] | None = None

    @property
    def labels(self) -> tuple[str, ...]:
        labels = METRICS[self.source].labels
        if labels[:1] != ("model_name",):
            return labels
        return ("model_name", "engine", *labels[1:])


#: vLLM's name for each series of vLLM v1's ``PrometheusStatLogger`` that we measure.
VLLM_METRICS: dict[str, VllmAlias] = {a.name: a for a in (
    VllmAlias("vllm:prompt_tokens", PROMPT_TOKENS),
    VllmAlias("vllm:generation_tokens", GENERATION_TOKENS),
    VllmAlias("vllm:request_success", REQUEST_SUCCESS),
    VllmAlias("vllm:time_to_first_token_seconds", TIME_TO_FIRST_TOKEN),
    VllmAlias("vllm:time_per_output_token_seconds", INTER_TOKEN_LATENCY, VLLM_TPOT_BUCKETS),
    VllmAlias("vllm:inter_token_latency_seconds", INTER_TOKEN_LATENCY, VLLM_TPOT_BUCKETS),
    VllmAlias("vllm:e2e_request_latency_seconds", E2E_REQUEST_LATENCY),
    VllmAlias("vllm:request_queue_time_seconds", REQUEST_QUEUE_TIME),
    VllmAlias("vllm:request_prefill_time_seconds", REQUEST_PREFILL_TIME),
    VllmAlias("vllm:request_decode_time_seconds", REQUEST_DECODE_TIME),
    VllmAlias("vllm:request_inference_time_seconds", REQUEST_INFERENCE_TIME),
    VllmAlias("vllm:time_per_prefill_token_request_seconds", TIME_PER_PREFILL_TOKEN),
    VllmAlias("vllm:request_time_per_output_token_seconds", REQUEST_TIME_PER_OUTPUT_TOKEN),
    VllmAlias("vllm:request_prompt_tokens", REQUEST_PROMPT_TOKENS),
    VllmAlias("vllm:request_generation_tokens", REQUEST_GENERATION_TOKENS),
    VllmAlias("vllm:request_max_num_generation_tokens", REQUEST_MAX_NUM_GENERATION_TOKENS),
    VllmAlias("vllm:request_params_max_tokens", REQUEST_PARAMS_MAX_TOKENS),
    VllmAlias("vllm:iteration_tokens_total", ITERATION_TOKENS),
    VllmAlias("vllm:num_requests_running", NUM_REQUESTS_RUNNING),
    VllmAlias("vllm:num_requests_waiting", NUM_REQUESTS_WAITING),
    VllmAlias("vllm:kv_cache_usage_perc", KV_CACHE_USAGE_PERC),
    VllmAlias("vllm:gpu_cache_usage_perc", KV_CACHE_USAGE_PERC),
    VllmAlias("vllm:prefix_cache_queries", PREFIX_CACHE_QUERIES),
    VllmAlias("vllm:prefix_cache_hits", PREFIX_CACHE_HITS),
    VllmAlias("vllm:gpu_prefix_cache_queries", PREFIX_CACHE_QUERIES),
    VllmAlias("vllm:gpu_prefix_cache_hits", PREFIX_CACHE_HITS),
    VllmAlias("vllm:num_preemptions", NUM_PREEMPTIONS),
    VllmAlias("vllm:lora_requests_info", LORA_REQUESTS_INFO),
    VllmAlias("vllm:cache_config_info", CACHE_CONFIG_INFO),
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
        names: the name sets to expose, a subset of ``NAME_SETS``: ``"manylora"`` (the
            ``manylora:*`` series) and ``"vllm"`` (``VLLM_METRICS``).
        max_lora_labels: how many adapters get ``lora_name`` series of their own in the
            per-adapter metrics (first come, first served); the others are counted under
            ``lora_name="other"``. 0: every adapter is ``"other"``.
        cache_config: the label values of ``cache_config_info`` (vLLM's ``CacheConfig``
            fields we have: ``block_size``, ``num_gpu_blocks``, ...), strings.

    Attributes:
        registry: the registry given.
        model_name: the ``model_name`` label value, as written.

    Raises:
        ValueError: a metric name is already registered in ``registry``,
            ``max_model_len`` < 1, ``max_lora_labels`` < 0, or ``names`` is empty or holds
            an unknown set. Nothing is left registered then.
    """

    def __init__(self, registry: prometheus_client.CollectorRegistry, model_name: str,
                 snapshot: Callable[[], EngineSnapshot], *, max_model_len: int = 131072,
                 clock: Callable[[], float] = time.time,
                 names: Iterable[str] = NAME_SETS, max_lora_labels: int = 100,
                 cache_config: Mapping[str, str] | None = None) -> None:
        names = frozenset(names)
        if not names or not names <= set(NAME_SETS):
            raise ValueError(f"names must be a non-empty subset of {NAME_SETS}, "
                             f"got {sorted(names)}")
        if max_lora_labels < 0:
            raise ValueError(f"max_lora_labels must be >= 0, got {max_lora_labels}")
        token_buckets = build_1_2_5_buckets(max_model_len)
        model_name = label_value(model_name)
        self.model_name = model_name
        self.registry = registry
        self.max_lora_labels = max_lora_labels
        self._lora_names: set[str] = set()
        self._collectors: list[Collector] = []
        # our name -> [(metric, its leading label values)] for each exposed copy
        self._targets: dict[str, list[tuple[prometheus_client.metrics.MetricWrapperBase,
                                             tuple[str, ...]]]] = {}
        # our name -> the copies' children, for the metrics without further labels
        self._bound: dict[str, list[prometheus_client.metrics.MetricWrapperBase]] = {}

        def register(name: str, labels: tuple[str, ...], kind: str, help: str,
                     buckets: tuple[float, ...] | None) -> prometheus_client.Counter:
            if kind == "counter":
                metric = prometheus_client.Counter(name, help, list(labels),
                                                   registry=registry)
            else:
                metric = prometheus_client.Histogram(
                    name, help, list(labels), registry=registry,
                    buckets=token_buckets if buckets is None else buckets)
            self._collectors.append(metric)
            return metric

        collector = _SnapshotCollector(model_name, snapshot, clock, names,
                                       dict(cache_config or {}))
        registry.register(collector)
        self._collectors.append(collector)
        try:
            for name, spec in METRICS.items():
                if spec.source != "record":
                    continue
                targets = self._targets.setdefault(name, [])
                if "manylora" in names:
                    metric = register(name, spec.labels, spec.kind, spec.help,
                                      _BUCKETS.get(name))
                    targets.append((metric, (model_name,)))
            if "vllm" in names:
                for alias in VLLM_METRICS.values():
                    spec = METRICS[alias.source]
                    if spec.source != "record":
                        continue
                    metric = register(alias.name, alias.labels, spec.kind, spec.help,
                                      alias.buckets or _BUCKETS.get(alias.source))
                    self._targets[alias.source].append((metric, (model_name, "0")))
            for name, spec in METRICS.items():     # series that exist before any request
                if spec.source != "record" or "lora_name" in spec.labels:
                    continue
                for metric, base in self._targets[name]:
                    if name == REQUEST_SUCCESS:
                        for reason in FINISH_REASONS:
                            metric.labels(*base, reason)
                    else:
                        self._bound.setdefault(name, []).append(metric.labels(*base))
        except ValueError:
            self.unregister()
            raise

    def _add(self, name: str, value: float, *labels: str) -> None:
        """Add ``value`` to (counter) or observe it in (histogram) every copy of ``name``,
        at the further ``labels`` (after ``model_name`` and vLLM's ``engine``)."""
        children = (self._bound.get(name, ()) if not labels else
                    [metric.labels(*base, *labels) for metric, base in self._targets[name]])
        counter = METRICS[name].kind == "counter"
        for child in children:
            if counter:
                child.inc(value)
            else:
                child.observe(value)

    def _lora_label(self, lora_name: str) -> str:
        """The ``lora_name`` value of ``lora_name``'s per-adapter series (``"other"`` once
        ``max_lora_labels`` adapters have their own)."""
        if lora_name in self._lora_names:
            return lora_name
        if len(self._lora_names) < self.max_lora_labels:
            self._lora_names.add(lora_name)
            return lora_name
        return OTHER_LORA

    def record(self, stats: IterationStats) -> None:
        """Adds one engine step's tokens, latencies (seconds) and finished requests.

        Safe to call from the engine thread while another thread scrapes.

        Raises:
            ValueError: a token count in ``stats`` is negative (counters only go up).
        """
        if stats.num_prompt_tokens:
            self._add(PROMPT_TOKENS, stats.num_prompt_tokens)
        if stats.num_generation_tokens:
            self._add(GENERATION_TOKENS, stats.num_generation_tokens)
        if stats.num_prompt_tokens or stats.num_generation_tokens:
            self._add(ITERATION_TOKENS, stats.num_prompt_tokens + stats.num_generation_tokens)
        for seconds in stats.time_to_first_tokens:
            self._add(TIME_TO_FIRST_TOKEN, seconds)
        for seconds in stats.inter_token_latencies:
            self._add(INTER_TOKEN_LATENCY, seconds)
        for req in stats.finished:
            self._add(REQUEST_SUCCESS, 1, req.finish_reason)
            self._add(E2E_REQUEST_LATENCY, req.e2e_latency)
            self._add(REQUEST_QUEUE_TIME, req.queue_time)
            self._add(REQUEST_PREFILL_TIME, req.prefill_time)
            self._add(REQUEST_DECODE_TIME, req.decode_time)
            self._add(REQUEST_INFERENCE_TIME, req.inference_time)
            if req.num_prompt_tokens > 0:
                self._add(TIME_PER_PREFILL_TOKEN, req.prefill_time / req.num_prompt_tokens)
            if req.num_generation_tokens > 1:
                self._add(REQUEST_TIME_PER_OUTPUT_TOKEN,
                          req.decode_time / (req.num_generation_tokens - 1))
            self._add(REQUEST_PROMPT_TOKENS, req.num_prompt_tokens)
            self._add(REQUEST_GENERATION_TOKENS, req.num_generation_tokens)
            self._add(REQUEST_MAX_NUM_GENERATION_TOKENS, req.num_generation_tokens)
            if req.max_tokens:
                self._add(REQUEST_PARAMS_MAX_TOKENS, req.max_tokens)
            if req.lora_name is not None:
                lora = self._lora_label(label_value(req.lora_name))
                self._add(LORA_REQUEST_SUCCESS, 1, lora, req.finish_reason)
                self._add(LORA_PROMPT_TOKENS, req.num_prompt_tokens, lora)
                self._add(LORA_GENERATION_TOKENS, req.num_generation_tokens, lora)
                if req.first_token_latency is not None:
                    self._add(LORA_TIME_TO_FIRST_TOKEN, req.first_token_latency, lora)

    def unregister(self) -> None:
        """Removes this logger's metrics from its registry (e.g. when its server stops), so
        another logger may register there. Calling it again does nothing."""
        collectors, self._collectors = self._collectors, []
        for collector in collectors:
            self.registry.unregister(collector)


class _SnapshotCollector(Collector):
    """The scrape-time metrics: calls ``snapshot()`` once per ``collect``."""

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
