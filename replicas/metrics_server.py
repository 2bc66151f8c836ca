"""`/metrics` for a standalone engine (no Ray): the same `tidal:` names, through prometheus_client.

A daemon thread polls the engine once per `interval_s` and feeds a `StatsRecorder`; an HTTP
server serves the registry. Without Ray there is no relabelling: names are `tidal:<name>` as
exported. The server always answers in the classic text format: prometheus_client's OpenMetrics
output, which Prometheus asks for first, rewrites the colon to `_` in sample names
(prometheus/client_python#1177). `_created` samples are left out, as on the Ray path.
"""
from __future__ import annotations

import functools
import logging
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Callable, Iterable, Sequence

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.exposition import CONTENT_TYPE_PLAIN_0_0_4, generate_latest

from replicas.metrics import METRICS, Kind, MetricSpec, StatsRecorder
from replicas.stats import EngineStats, RequestTimings

log = logging.getLogger(__name__)

try:   # prometheus_client >= 0.22 escapes names unless told names may stay as they are
    from prometheus_client.openmetrics.exposition import ALLOWUTF8
    render_text = functools.partial(generate_latest, escaping=ALLOWUTF8)
except ImportError:
    render_text = generate_latest

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


class WithoutCreated:
    """A registry's metric families minus their `_created` samples (creation timestamps)."""

    def __init__(self, registry: CollectorRegistry):
        self.registry = registry

    def collect(self):
        for family in self.registry.collect():
            family.samples = [s for s in family.samples if not s.name.endswith("_created")]
            yield family


def metrics_handler(registry: CollectorRegistry) -> type[BaseHTTPRequestHandler]:
    view = WithoutCreated(registry)

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):
            if self.path.split("?")[0] not in ("/metrics", "/"):
                self.send_error(404)
                return
            body = render_text(view)
            self.send_response(200)
            self.send_header("Content-Type", CONTENT_TYPE_PLAIN_0_0_4)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):   # no line per scrape on stderr
            pass

    return Handler


class MetricsServer:
    """Polls `engine_stats_fn` into a registry served over HTTP; `stop()` ends both."""

    def __init__(self, engine_stats_fn: EngineStatsFn, recorder: StatsRecorder, registry: CollectorRegistry,
                 interval_s: float):
        self.engine_stats_fn = engine_stats_fn
        self.recorder = recorder
        self.registry = registry
        self.interval_s = interval_s
        self.port = 0
        self._httpd: ThreadingHTTPServer | None = None
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name="tidal-metrics-poll", daemon=True)

    def start(self, port: int, addr: str) -> None:
        self.poll()
        self._httpd = ThreadingHTTPServer((addr, port), metrics_handler(self.registry))
        self._httpd.daemon_threads = True
        self.port = self._httpd.server_port
        threading.Thread(target=self._httpd.serve_forever, name="tidal-metrics-http", daemon=True).start()
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
