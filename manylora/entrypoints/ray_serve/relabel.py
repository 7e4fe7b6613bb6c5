"""Merge several engine replicas' ``/metrics`` texts into one exposition, each sample labelled
with the replica it came from (``replica="<id>"``), as a Prometheus federation of the
replicas would show them.

The texts are parsed with prometheus_client's own parser and written back with its own
``generate_latest``, so the result is valid exposition text: each metric family appears once,
with the samples of every replica.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

#: The label naming the replica a sample came from.
REPLICA_LABEL = "replica"


class _Merged:
    """A prometheus_client collector yielding already-built metric families."""

    def __init__(self, families: list[Metric]) -> None:
        self.families = families

    def collect(self) -> Iterator[Metric]:
        yield from self.families


def merge_replica_metrics(texts: Mapping[str, str], extra: list[Metric] = ()) -> bytes:
    """One exposition (Prometheus text format 0.0.4) of every replica's metrics.

    Args:
        texts: per replica id, its ``/metrics`` text.
        extra: families of the caller's own to add (no replica label).

    Returns:
        The exposition, UTF-8 bytes. A family whose type or help differs between replicas
        keeps the first replica's; a sample that already has a ``replica`` label keeps it.

    Raises:
        ValueError: a text prometheus_client's parser refuses.
    """
    families: dict[str, Metric] = {}
    for replica, text in texts.items():
        for family in text_string_to_metric_families(text):
            merged = families.get(family.name)
            if merged is None:
                merged = families[family.name] = Metric(family.name, family.documentation,
                                                        family.type, family.unit)
            merged.samples.extend(
                Sample(s.name, {REPLICA_LABEL: replica, **s.labels}, s.value, s.timestamp,
                       s.exemplar)
                for s in family.samples)
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Merged([*extra, *families.values()]))
    return generate_latest(registry)
