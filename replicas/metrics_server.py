"""`/metrics` for a standalone engine (no Ray): the same `tidal:` names, through prometheus_client.

A daemon thread polls the engine once per `interval_s` and feeds a `StatsRecorder`; the HTTP
server serves the registry. Without Ray there is no relabelling: names are `tidal:<name>` as
exported.
"""
from __future__ import annotations

import logging
import threading
from typing import Callable, Iterable, Sequence

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

from cluster.metrics import METRICS, Kind, MetricSpec, StatsRecorder
from replicas.stats import EngineStats, RequestTimings

log = logging.getLogger(__name__)

EngineStatsFn = Callable[[], tuple[EngineStats, Sequence[RequestTimings]]]


class PrometheusClientSink:
    """A prometheus_client metric per `MetricSpec`, in its own registry."""

    def __init__(self, registry: CollectorRegistry):
        self.registry = registry
        self._metrics = {}
        for spec in METRICS.values():
            name = f"tidal:{spec.name}"
            if spec.kind is Kind.COUNTER:
                metric = Counter(name, spec.help, spec.labels, registry=registry)
            elif spec.kind is Kind.GAUGE:
                metric = Gauge(name, spec.help, spec.labels, registry=registry)
            else:
                metric = Histogram(name, spec.help, spec.labels, buckets=spec.buckets, registry=registry)
            self._metrics[spec.name] = metric

    def inc(self, spec: MetricSpec, value: float, labels: dict[str, str]) -> None:
        self._metrics[spec.name].labels(**labels).inc(value)

    def set(self, spec: MetricSpec, value: float, labels: dict[str, str]) -> None:
        self._metrics[spec.name].labels(**labels).set(value)

    def observe(self, spec: MetricSpec, values: Iterable[float], labels: dict[str, str]) -> None:
        child = self._metrics[spec.name].labels(**labels)
        for v in values:
            child.observe(v)


class MetricsServer:
    """Polls `engine_stats_fn` into a registry served over HTTP; `stop()` ends both."""

    def __init__(self, engine_stats_fn: EngineStatsFn, recorder: StatsRecorder, registry: CollectorRegistry,
                 interval_s: float):
        self.engine_stats_fn = engine_stats_fn
        self.recorder = recorder
        self.registry = registry
        self.interval_s = interval_s
        self.port = 0
        self._httpd = None
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name="tidal-metrics-poll", daemon=True)

    def start(self, port: int, addr: str) -> None:
        self.poll()
        self._httpd, _ = start_http_server(port, addr=addr, registry=self.registry)
        self.port = self._httpd.server_port
        self._thread.start()

    def poll(self) -> None:
        with self._lock:
            stats, timings = self.engine_stats_fn()
            self.recorder.record(stats, timings)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        if self._httpd is not None:
            self._httpd.shutdown()
            self._httpd.server_close()

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self.poll()
            except Exception:   # a failing engine must not kill the exporter; the next poll retries
                log.exception("metrics poll failed")


def start_metrics_server(engine_stats_fn: EngineStatsFn, port: int, *, model_name: str = "tidal",
                         replica: str = "standalone", tp_rank: int = 0, addr: str = "0.0.0.0",
                         interval_s: float = 1.0) -> MetricsServer:
    """Serve `tidal:` metrics on `addr:port` (0 picks a free port, see `.port`).

    `engine_stats_fn()` returns the engine's current `EngineStats` and the `RequestTimings` of the
    requests finished since the previous call.
    """
    registry = CollectorRegistry()
    recorder = StatsRecorder(PrometheusClientSink(registry), model_name, replica, tp_rank)
    server = MetricsServer(engine_stats_fn, recorder, registry, interval_s)
    server.start(port, addr)
    return server
