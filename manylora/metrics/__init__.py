"""Engine metrics for the OpenAI-compatible server: Prometheus exposition (``prometheus``),
the catalog of metrics (``catalog``), vLLM's names for them (``vllm_names``)."""

from manylora.metrics.catalog import METRICS, MetricSpec
from manylora.metrics.prometheus import PrometheusStatLogger

__all__ = ["METRICS", "MetricSpec", "PrometheusStatLogger"]
