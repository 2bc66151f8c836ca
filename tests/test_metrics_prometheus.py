"""Metrics through a real Prometheus server.

1. Ray path, unit level: a local Ray cluster (own driver process) where two actors record a
   deterministic synthetic workload through `ReplicaMetrics`; Prometheus scrapes Ray's metrics
   export port with `RAY_METRIC_RELABEL_CONFIGS`, as KubeRay's PodMonitor does.
2. Standalone path: `start_metrics_server` in this process, scraped by the same Prometheus.
3. The real server: `tidal serve` on CPU (`tidal_server` / `tidal_metrics_port` fixtures from
   tests/conftest.py) under load from the openai SDK; skipped when the fixtures are not there.

Each checks that every PromQL expression of every dashboard returns data, the names and label sets.
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from cluster.metrics import METRICS, RAY_METRIC_RELABEL_CONFIGS, Kind, ReplicaMetrics
from replicas.stats import EngineStats, RequestTimings

sys.path.insert(0, str(Path(__file__).resolve().parent))
from prometheus_util import ScrapeJob, free_port, prometheus_binary, start_prometheus  # noqa: E402

GRAFANA_DIR = Path(__file__).resolve().parents[1] / "grafana"
RAY_MODEL, STANDALONE_MODEL = "synthetic-ray", "synthetic-standalone"
STEPS = 24                  # active steps of the synthetic workload, then idle
GEN_PER_STEP = 7
WAIT_S = 90                 # Ray's export and the 1 s scrapes lag a few seconds

needs_prometheus = pytest.mark.skipif(prometheus_binary() is None,
                                      reason="prometheus not installed (scripts/install-prometheus.sh)")


class SyntheticEngine:
    """Deterministic EngineStats/RequestTimings: every counter, gauge and histogram moves."""

    def __init__(self):
        self.stats = EngineStats(kv_blocks_total=100, max_num_batched_tokens=2048, elastic_mode="elastic",
                                 reserve_bytes=64 << 20, reserve_blocks_total=20)
        self.step_no = 0

    def step(self) -> tuple[EngineStats, list[RequestTimings]]:
        self.step_no += 1
        s, i = self.stats, self.step_no
        s.num_running, s.num_waiting, s.kv_blocks_used = 4, 2, 50
        s.reserve_lent_bytes, s.reserve_blocks_used = 32 << 20, 5
        s.num_steps += 2
        s.iteration_tokens_total += 18
        s.prompt_tokens += 11
        s.generation_tokens += GEN_PER_STEP
        s.prefix_cache_queries += 16
        s.prefix_cache_hits += 8
        s.preemptions += 1
        s.lend_total += 1
        s.reclaim_total += 1
        s.blocks_migrated += 3
        s.elastic_preemptions += 1
        s.spec_drafts += 2
        s.spec_draft_tokens += 8
        s.spec_accepted_tokens += 5
        s.spec_accepted_by_position = [p + d for p, d in zip(s.spec_accepted_by_position or [0, 0, 0], (2, 2, 1))]
        s.lend_latencies, s.reclaim_latencies = [0.002 + 0.001 * (i % 3)], [0.03]
        t0 = float(i)
        reason = "stop" if i % 2 else "length"
        return s, [RequestTimings(f"r{i}", t0, t0 + 0.05, t0 + 0.2, t0 + 1.5, 11, GEN_PER_STEP, reason,
                                  [0.02, 0.03, 0.05])]

    def idle(self) -> tuple[EngineStats, list[RequestTimings]]:
        s = self.stats
        s.num_running = s.num_waiting = s.kv_blocks_used = s.reserve_blocks_used = s.reserve_lent_bytes = 0
        s.lend_latencies = s.reclaim_latencies = []
        return s, []


def run_ray_driver(metrics_port: int) -> None:
    """Child process: a local Ray cluster whose actors record the synthetic workload, until stdin closes."""
    import time

    import ray

    ray.init(num_cpus=1, include_dashboard=False, _metrics_export_port=metrics_port,
             _system_config={"metrics_report_interval_ms": 1000}, logging_level="ERROR",
             log_to_driver=False)

    @ray.remote(num_cpus=0)
    class SyntheticReplica:
        def __init__(self, replica: str):
            self.engine = SyntheticEngine()
            self.metrics = ReplicaMetrics(RAY_MODEL, replica, tp_rank=0)

        def run(self, steps: int, period_s: float) -> int:
            for i in range(steps):
                self.metrics.record(*self.engine.step())
                if i % 8 == 0:
                    self.metrics.record_controller_decision("max_num_batched_tokens", 2048 - 64 * i, "kv_pressure")
                time.sleep(period_s)
            self.metrics.record(*self.engine.idle())
            return self.engine.stats.generation_tokens

    replicas = [SyntheticReplica.remote(f"r{k}") for k in range(2)]
    totals = ray.get([r.run.remote(STEPS, 0.25) for r in replicas])
    print(json.dumps({"generation_tokens": totals}), flush=True)
    sys.stdin.read()
    ray.shutdown()


def dashboard_expressions() -> list[tuple[str, str, str]]:
    """(dashboard file, panel title, expr) for every target of every committed dashboard."""
    out = []
    for path in sorted(GRAFANA_DIR.glob("*.json")):
        board = json.loads(path.read_text())
        for panel in board["panels"]:
            for target in panel.get("targets", []):
                out.append((path.name, panel["title"], target["expr"]))
    assert out, "no dashboards found"
    return out


def concrete(expr: str, model: str = ".*", replica: str = ".*", window: str = "5m") -> str:
    """A dashboard expression with Grafana's variables filled in, ready for Prometheus."""
    return expr.replace("$model_name", model).replace("$replica", replica).replace("$__rate_interval", window)


def metric_families(expr: str) -> set[str]:
    families = set()
    for name in re.findall(r"tidal:[a-z0-9_]+", expr):
        families.add(re.sub(r"_(bucket|sum|count)$", "", name))
    return families


def assert_expressions_return_data(prom, expressions: list[tuple[str, str, str]], model: str) -> None:
    """Waits until every expression returns data; rates need two scrapes after a series appears."""
    pending = list(expressions)

    def drained():
        pending[:] = [e for e in pending if not prom.query(concrete(e[2], model=model))]
        return not pending

    try:
        prom.wait_until(drained, WAIT_S, "dashboard expressions to return data")
    except AssertionError:
        raise AssertionError(f"dashboard expressions without data: {pending}") from None


def assert_names_and_labels(prom, model: str) -> set[str]:
    """Every tidal series of `model` is a known family with the table's label set; returns the families."""
    by_family = {spec.exported_name: spec for spec in METRICS.values()}
    seen = set()
    for series in prom.series(f'{{__name__=~"tidal:.+", model_name="{model}"}}'):
        name = series["__name__"]
        family = re.sub(r"_(bucket|sum|count)$", "", name) if name not in by_family else name
        assert family in by_family, f"unknown metric {name}"
        spec = by_family[family]
        assert spec.kind is Kind.HISTOGRAM or name == family
        missing = set(spec.labels) - set(series)
        assert not missing, f"{name} lacks labels {missing}"
        seen.add(family)
    return seen


# ---- 1 + 2: synthetic Ray cluster and standalone server ----------------------------------------

@pytest.fixture(scope="module")
def synthetic_cluster():
    if prometheus_binary() is None:
        pytest.skip("prometheus not installed (scripts/install-prometheus.sh)")
    from replicas.metrics_server import start_metrics_server

    ray_port = free_port()
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    driver = subprocess.Popen([sys.executable, __file__, "ray-driver", str(ray_port)], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env)
    engine, lock = SyntheticEngine(), threading.Lock()

    def standalone_stats():
        with lock:
            return engine.step() if engine.step_no < STEPS else engine.idle()

    standalone = start_metrics_server(standalone_stats, 0, model_name=STANDALONE_MODEL, replica="s0",
                                      addr="127.0.0.1", interval_s=0.25)
    standalone.recorder.record_controller_decision("max_num_batched_tokens", 1024, "kv_pressure")
    prom = None
    try:
        prom = start_prometheus([
            ScrapeJob("ray", (f"127.0.0.1:{ray_port}",), RAY_METRIC_RELABEL_CONFIGS),
            ScrapeJob("standalone", (f"127.0.0.1:{standalone.port}",)),
        ])
        yield prom, driver
    finally:
        if prom is not None:
            prom.stop()
        standalone.stop()
        driver.stdin.close()
        try:
            driver.wait(timeout=60)
        except subprocess.TimeoutExpired:
            driver.kill()
            driver.wait()


def wait_all_families(prom, model: str) -> None:
    want = {spec.exported_name for spec in METRICS.values()}
    prom.wait_until(lambda: assert_names_and_labels(prom, model) >= want, WAIT_S,
                    f"all tidal families for {model}")


@needs_prometheus
@pytest.mark.parametrize("model", [RAY_MODEL, STANDALONE_MODEL])
def test_synthetic_names_labels_and_every_dashboard_expression(synthetic_cluster, model):
    prom, _ = synthetic_cluster
    wait_all_families(prom, model)
    assert not [n for n in prom.metric_names() if n.startswith("ray_tidal_")], "relabelling left Ray names"
    assert_expressions_return_data(prom, dashboard_expressions(), model)
    replicas = ["r0", "r1"] if model == RAY_MODEL else ["s0"]
    prom.wait_until(lambda: prom.label_values("replica", f'tidal:num_requests_running{{model_name="{model}"}}')
                    == replicas, WAIT_S, f"replicas {replicas} of {model}")
    assert prom.query(f'tidal:elastic_mode{{model_name="{model}", mode="elastic"}} == 1')


@needs_prometheus
def test_synthetic_counters_match_and_gauges_go_idle(synthetic_cluster):
    prom, driver = synthetic_cluster
    line = driver.stdout.readline()
    assert line.startswith("{"), f"Ray driver ended without its report (exit {driver.poll()})"
    totals = json.loads(line)["generation_tokens"]
    assert totals == [STEPS * GEN_PER_STEP] * 2
    for model in (RAY_MODEL, STANDALONE_MODEL):
        expected = sum(totals) if model == RAY_MODEL else STEPS * GEN_PER_STEP
        got = prom.wait_until(
            lambda: prom.value(f'sum(tidal:generation_tokens_total{{model_name="{model}"}}) == {expected}'),
            WAIT_S, f"{model} generation tokens == {expected}")
        assert got == expected
        prom.wait_until(lambda: prom.value(f'max(tidal:kv_cache_usage_perc{{model_name="{model}"}}) == 0') == 0,
                        WAIT_S, f"{model} KV usage back to 0")
    # Position 0 accepted 2 per step on each of the two Ray replicas.
    assert prom.value(f'sum(tidal:spec_decode_num_accepted_tokens_per_pos_total'
                      f'{{model_name="{RAY_MODEL}", position="0"}})') == 2 * 2 * STEPS
    decisions = prom.value(f'sum(tidal:controller_decisions_total{{model_name="{RAY_MODEL}"}})')
    assert decisions == 2 * len(range(0, STEPS, 8))


# ---- 3: the real `tidal serve` on CPU ----------------------------------------------------------

@pytest.fixture(scope="module")
def served(request):
    if prometheus_binary() is None:
        pytest.skip("prometheus not installed (scripts/install-prometheus.sh)")
    try:
        base_url = request.getfixturevalue("tidal_server")
        metrics_port = int(request.getfixturevalue("tidal_metrics_port"))
    except pytest.FixtureLookupError:
        pytest.skip("no `tidal_server` / `tidal_metrics_port` fixtures (tests/conftest.py provides them)")
    prom = start_prometheus([ScrapeJob("tidal", (f"127.0.0.1:{metrics_port}",), RAY_METRIC_RELABEL_CONFIGS)])
    try:
        yield str(base_url).rstrip("/"), prom
    finally:
        prom.stop()


def _stable_generation_total(prom, quiet_s: float = 12.0) -> float:
    """The exported generation-token total once it stopped moving (Ray exports every few seconds)."""
    import time

    expr = "sum(tidal:generation_tokens_total)"
    last, since = prom.value(expr), time.monotonic()
    while time.monotonic() - since < quiet_s:
        time.sleep(1.0)
        now = prom.value(expr)
        if now != last:
            last, since = now, time.monotonic()
    return last or 0.0


@needs_prometheus
def test_tidal_serve_metrics_under_load(served):
    openai = pytest.importorskip("openai")
    base_url, prom = served
    before = _stable_generation_total(prom)
    client = openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", timeout=300)
    model = client.models.list().data[0].id
    prompts = [f"Write one sentence about the number {i}." for i in range(8)]

    def complete(prompt: str) -> int:
        out = client.chat.completions.create(model=model, messages=[{"role": "user", "content": prompt}],
                                             max_tokens=24, temperature=0)
        return out.usage.completion_tokens

    with ThreadPoolExecutor(max_workers=4) as pool:
        received = sum(pool.map(complete, prompts))
    assert received > 0
    want = before + received
    prom.wait_until(lambda: prom.value(f"sum(tidal:generation_tokens_total) == {want}"), WAIT_S,
                    f"exported generation tokens == {want} (clients received {received})")

    seen = assert_names_and_labels(prom, model)
    core = {"tidal:num_requests_running", "tidal:kv_cache_usage_perc", "tidal:generation_tokens_total",
            "tidal:prompt_tokens_total", "tidal:request_success_total", "tidal:time_to_first_token_seconds",
            "tidal:e2e_request_latency_seconds", "tidal:request_queue_time_seconds", "tidal:num_steps_total"}
    assert core <= seen, f"missing: {core - seen}"
    assert not [n for n in prom.metric_names() if n.startswith("ray_tidal_")]
    # Expressions over families this server exported must all return data (elastic lending,
    # speculation, preemptions and the controller export only once they happen).
    exercised = [e for e in dashboard_expressions() if metric_families(e[2]) <= seen]
    print(f"{len(exercised)} of {len(dashboard_expressions())} dashboard expressions exercised; "
          f"families not exported by this server: {sorted({s.exported_name for s in METRICS.values()} - seen)}")
    assert exercised
    assert_expressions_return_data(prom, exercised, model)
    prom.wait_until(lambda: prom.value(f'max(tidal:kv_cache_usage_perc{{model_name="{model}"}}) == 0') == 0,
                    WAIT_S, "KV usage back to 0 when idle")


if __name__ == "__main__" and sys.argv[1:2] == ["ray-driver"]:
    run_ray_driver(int(sys.argv[2]))
