"""tidal's metrics on Ray's metrics path (a Serve replica, the fleet controller).

The definitions and the recorder are replicas/metrics.py. Here they are recorded through `ray.util.metrics`
objects named `tidal_<name>`. Ray exports them on its metrics port as `ray_tidal_<name>` (counters
`ray_tidal_<name>_total`) and silently drops any name containing a colon, so the Prometheus scrape renames
them back with `RAY_METRIC_RELABEL_CONFIGS` (a PodMonitor's `metricRelabelings` carries the same rule).
"""
from __future__ import annotations

import functools
from typing import Iterable

from replicas.metrics import METRICS, PREFIX, Kind, MetricSink, MetricSpec, StatsRecorder

# Prometheus `metric_relabel_configs` for a job scraping Ray's metrics export port.
RAY_METRIC_RELABEL_CONFIGS: tuple[dict, ...] = (
    {"source_labels": ["__name__"], "regex": f"ray_{PREFIX}_(.+)",
     "target_label": "__name__", "replacement": f"{PREFIX}:${{1}}", "action": "replace"},
)


class RayMetricSink:
    """Records through `ray.util.metrics`; the objects are created once per process and shared."""

    def __init__(self):
        self._metrics = _ray_metrics()

    def inc(self, spec: MetricSpec, value: float, labels: dict[str, str]) -> None:
        self._metrics[spec.name].inc(value, tags=labels)

    def set(self, spec: MetricSpec, value: float, labels: dict[str, str]) -> None:
        self._metrics[spec.name].set(value, tags=labels)

    def observe(self, spec: MetricSpec, values: Iterable[float], labels: dict[str, str]) -> None:
        histogram = self._metrics[spec.name]
        for v in values:
            histogram.observe(v, tags=labels)


@functools.cache
def _ray_metrics() -> dict:
    from ray.util.metrics import Counter, Gauge, Histogram

    made = {}
    for spec in METRICS.values():
        if spec.kind is Kind.COUNTER:
            made[spec.name] = Counter(spec.ray_name, spec.help, tag_keys=spec.labels)
        elif spec.kind is Kind.GAUGE:
            made[spec.name] = Gauge(spec.ray_name, spec.help, tag_keys=spec.labels)
        else:
            made[spec.name] = Histogram(spec.ray_name, spec.help, boundaries=list(spec.buckets),
                                        tag_keys=spec.labels)
    return made


class ReplicaMetrics(StatsRecorder):
    """What a Serve replica (or the fleet controller) records through Ray's metrics path."""

    def __init__(self, model_name: str, replica: str, tp_rank: int = 0, sink: MetricSink | None = None):
        super().__init__(sink if sink is not None else RayMetricSink(), model_name, replica, tp_rank)
