"""Every metric of one engine: its name (vLLM v1's with the ``manylora:`` prefix), type,
labels, unit, help text and buckets (:data:`METRICS`), and how label values are written.

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
``manylora:prefix_cache_alora_hits``             counter                            tokens
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
disk reads for the host cache (= host misses) and host → device copies into a slot for the
device tier (= device misses, slot loads); ``lora_load_seconds`` is the disk reads' wall
time (read, validate, digest, pin; on loader threads) for the host cache and the copies' GPU
time (CUDA events on the copy stream; host time on the CPU) for the device tier.
``lora_adapter_waits`` counts requests that arrived while their adapter was on disk only (a
first read, or a re-read after an eviction) and ``lora_adapter_wait_seconds`` the time they
waited for it to reach host memory (counted when it does); ``lora_sync_disk_loads`` counts
the reads a step itself waited for. ``lora_pending_loads`` is the disk reads queued or
running as of the engine's last report (sent whenever a read starts or ends) and
``lora_oldest_pending_load_seconds`` the age of the oldest at the scrape (0 when none);
``lora_stuck_loader_threads`` counts loader threads still inside a read that exceeded
``lora_load_timeout``. ``prefix_cache_hit_rate`` is hits / queries since start, 0 before
any query; ``prefix_cache_alora_hits`` counts the hits of activated adapters' (aLoRA)
requests in the base model's blocks before their invocation, KV that crossed adapters;
``kv_cache_usage_perc`` is used / total device blocks, 0 when there are none.
``lora_requests_info`` has one sample, valued at the scrape's unix time, with the adapter
names comma-joined (empty string when none), present whether or not LoRA is on
(``max_lora="0"`` when off).

Label values are written as :func:`label_value` makes them: a name holding a code point
UTF-8 cannot encode (a lone surrogate) has it as escape text, so one such adapter or model
name cannot make ``generate_latest`` (which encodes the whole exposition) fail every scrape.
Quotes, backslashes and newlines are escaped by prometheus_client, as the text format says.
"""

from __future__ import annotations

from dataclasses import dataclass

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
PREFIX_CACHE_ALORA_HITS = PREFIX + "prefix_cache_alora_hits"
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
    MetricSpec(PREFIX_CACHE_ALORA_HITS, "counter", _M, "tokens",
               "Prefix cache hits of activated adapters' (aLoRA) requests before their "
               "invocation, in blocks keyed as the base model's: KV shared across adapters, "
               "in prompt tokens."),
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
               "Bytes of adapter tensors read from disk into the host cache."),
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

#: Each histogram's bucket bounds.
BUCKETS: dict[str, tuple[float, ...] | None] = {
    TIME_TO_FIRST_TOKEN: TTFT_BUCKETS, INTER_TOKEN_LATENCY: ITL_BUCKETS,
    E2E_REQUEST_LATENCY: E2E_LATENCY_BUCKETS, REQUEST_QUEUE_TIME: E2E_LATENCY_BUCKETS,
    REQUEST_PREFILL_TIME: E2E_LATENCY_BUCKETS, REQUEST_DECODE_TIME: E2E_LATENCY_BUCKETS,
    REQUEST_INFERENCE_TIME: E2E_LATENCY_BUCKETS, TIME_PER_PREFILL_TOKEN: PREFILL_TOKEN_BUCKETS,
    ITERATION_TOKENS: ITERATION_TOKEN_BUCKETS, LORA_TIME_TO_FIRST_TOKEN: TTFT_BUCKETS,
    REQUEST_TIME_PER_OUTPUT_TOKEN: VLLM_TPOT_BUCKETS,
    REQUEST_PROMPT_TOKENS: None, REQUEST_GENERATION_TOKENS: None,
    REQUEST_MAX_NUM_GENERATION_TOKENS: None, REQUEST_PARAMS_MAX_TOKENS: None,
}  # None: the 1-2-5 ladder up to max_model_len



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

