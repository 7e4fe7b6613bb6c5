"""``PrometheusStatLogger``: one engine's metrics in a Prometheus registry, named after vLLM
v1's with the ``manylora:`` prefix (the names, types, labels and units: ``catalog.py``;
vLLM's own names for them: ``vllm_names.py``).

``PrometheusStatLogger`` registers everything into the ``CollectorRegistry`` it is given
(never the process-wide default one), so several servers can live in one process. Two kinds
of metric:

* **per step** (``record``): prometheus_client ``Counter`` and ``Histogram`` objects fed from
  each ``IterationStats`` by the engine thread;
* **at scrape time**: a custom collector (``scrape.py``) that calls the ``snapshot``
  callable and reports the engine's state and cumulative cache counters
  (``EngineSnapshot``).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping

import prometheus_client
from prometheus_client.registry import Collector

from manylora.engine.stats import EngineSnapshot, IterationStats
from manylora.metrics.catalog import (
    BUCKETS,
    E2E_REQUEST_LATENCY,
    FINISH_REASONS,
    GENERATION_TOKENS,
    INTER_TOKEN_LATENCY,
    ITERATION_TOKENS,
    LORA_GENERATION_TOKENS,
    LORA_PROMPT_TOKENS,
    LORA_REQUEST_SUCCESS,
    LORA_TIME_TO_FIRST_TOKEN,
    METRICS,
    NAME_SETS,
    OTHER_LORA,
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
    build_1_2_5_buckets,
    label_value,
)
from manylora.metrics.scrape import SnapshotCollector
from manylora.metrics.vllm_names import VLLM_METRICS


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

        collector = SnapshotCollector(model_name, snapshot, clock, names,
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
                                      BUCKETS.get(name))
                    targets.append((metric, (model_name,)))
            if "vllm" in names:
                for alias in VLLM_METRICS.values():
                    spec = METRICS[alias.source]
                    if spec.source != "record":
                        continue
                    metric = register(alias.name, alias.labels, spec.kind, spec.help,
                                      alias.buckets or BUCKETS.get(alias.source))
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
