"""Engine metrics for the OpenAI-compatible server: Prometheus exposition (``prometheus``)."""

from manylora.metrics.prometheus import METRICS, MetricSpec, PrometheusStatLogger

__all__ = ["METRICS", "MetricSpec", "PrometheusStatLogger"]
