"""vLLM's names: each series of vLLM v1's ``PrometheusStatLogger`` that we measure is also
exposed under vLLM's name and labels (:data:`VLLM_METRICS`), so a vLLM dashboard reads it:
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
"""

from __future__ import annotations

from dataclasses import dataclass

from manylora.metrics.catalog import (
    CACHE_CONFIG_INFO,
    E2E_REQUEST_LATENCY,
    GENERATION_TOKENS,
    INTER_TOKEN_LATENCY,
    ITERATION_TOKENS,
    KV_CACHE_USAGE_PERC,
    LORA_REQUESTS_INFO,
    METRICS,
    NUM_PREEMPTIONS,
    NUM_REQUESTS_RUNNING,
    NUM_REQUESTS_WAITING,
    PREFIX_CACHE_HITS,
    PREFIX_CACHE_QUERIES,
    PROMPT_TOKENS,
    REQUEST_DECODE_TIME,
    REQUEST_GENERATION_TOKENS,
    REQUEST_INFERENCE_TIME,
    REQUEST_MAX_NUM_GENERATION_TOKENS,
    REQUEST_PARAMS_MAX_TOKENS,
    REQUEST_PREFILL_TIME,
    REQUEST_PROMPT_TOKENS,
    REQUEST_QUEUE_TIME,
    REQUEST_SUCCESS,
    REQUEST_TIME_PER_OUTPUT_TOKEN,
    TIME_PER_PREFILL_TOKEN,
    TIME_TO_FIRST_TOKEN,
    VLLM_TPOT_BUCKETS,
)


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
