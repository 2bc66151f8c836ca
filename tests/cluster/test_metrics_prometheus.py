"""Metrics through a real Prometheus server.

1. Ray path, unit level: a local Ray cluster (own driver process) where two actors record a
   deterministic synthetic workload through `ReplicaMetrics`; Prometheus scrapes Ray's metrics
   export port with `RAY_METRIC_RELABEL_CONFIGS`, as KubeRay's PodMonitor does.
2. Standalone path: `start_metrics_server` in this process, scraped by the same Prometheus.
3. The real server: `tidal serve` on CPU under load from the openai SDK: the session's `tidal_server`
   and a second server (`tidal_server_factory`, tests/conftest.py) sized so that speculation,
   preemptions, elastic lends and reclaims and controller decisions all happen.

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
from dataclasses import dataclass
from pathlib import Path

import pytest

from cluster.metrics import RAY_METRIC_RELABEL_CONFIGS, ReplicaMetrics
from replicas.metrics import METRICS, Kind
from replicas.stats import EngineStats, RequestTimings

from tests.support import REPO
from tests.support.prometheus import ScrapeJob, free_port, prometheus_binary, start_prometheus

GRAFANA_DIR = REPO / "grafana"
RAY_MODEL, STANDALONE_MODEL = "synthetic-ray", "synthetic-standalone"
STEPS = 24                  # active steps of the synthetic workload, then idle
GEN_PER_STEP = 7
WAIT_S = 90                 # Ray's export and the 1 s scrapes lag a few seconds
ADMISSION_LIMIT = 4096
# A counter appears at its first increment: the real servers below refuse nothing (their refusals are checked on
# Ray's export in tests/cluster/test_serve_cluster.py).
ONLY_AFTER_A_REFUSAL = {"tidal:num_requests_refused_total"}
# and at the first step launched ahead: neither server below runs async scheduling (the events one speculates)
ONLY_WITH_ASYNC_SCHEDULING = {"tidal:num_steps_ahead_total"}

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
        s.steps_ahead += 1
        s.iteration_tokens_total += 18
        s.prompt_tokens += 11
        s.generation_tokens += GEN_PER_STEP
        s.prefix_cache_queries += 16
        s.prefix_cache_hits += 8
        s.preemptions += 1
        s.kv_admission_waits += 2
        s.lend_total += 1
        s.reclaim_total += 1
        s.blocks_migrated += 3
        s.elastic_preemptions += 1
        s.spec_drafts += 2
        s.spec_draft_tokens += 8
        s.spec_accepted_tokens += 5
        s.spec_accepted_by_position = [p + d for p, d in zip(s.spec_accepted_by_position or [0, 0, 0], (2, 2, 1))]
        s.lend_latencies, s.reclaim_latencies = [0.002 + 0.001 * (i % 3)], [0.03]
        s.spec_constrained_plain += 3
        s.constrained_requests = {"json_schema": i, "tool": i // 2}
        s.grammar_cache_hits += 1
        s.grammar_compiles += 1
        s.grammar_compile_latencies = [0.01 * (1 + i % 3)]
        s.grammar_mask_steps += 2
        s.grammar_mask_latencies = [1e-4, 3e-4]
        t0 = float(i)
        reason = "stop" if i % 2 else "length"
        return s, [RequestTimings(f"r{i}", t0, t0 + 0.05, t0 + 0.2, t0 + 1.5, 11, GEN_PER_STEP, reason,
                                  [0.02, 0.03, 0.05])]

    @staticmethod
    def admission(i: int) -> tuple[int, int, int, dict[str, int]]:
        """A replica's queue and its refusals so far (record_admission's arguments): one refusal per step."""
        return 6, 6 * 87, ADMISSION_LIMIT, {"tokens": i + 1, "requests": 0}

    def idle(self) -> tuple[EngineStats, list[RequestTimings]]:
        s = self.stats
        s.num_running = s.num_waiting = s.kv_blocks_used = s.reserve_blocks_used = s.reserve_lent_bytes = 0
        s.lend_latencies = s.reclaim_latencies = s.grammar_compile_latencies = s.grammar_mask_latencies = []
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
                self.metrics.record_admission(*self.engine.admission(i))
                time.sleep(period_s)
            self.metrics.record(*self.engine.idle())
            self.metrics.record_admission(0, 0, ADMISSION_LIMIT, {"tokens": steps, "requests": 0})
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


def assert_expressions_return_data(prom, expressions: list[tuple[str, str, str]], model: str,
                                   replica: str = ".*") -> None:
    """Waits until every expression returns data; rates need two scrapes after a series appears."""
    pending = list(expressions)

    def drained():
        pending[:] = [e for e in pending if not prom.query(concrete(e[2], model=model, replica=replica))]
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

@pytest.fixture(scope="class")
def synthetic_cluster():
    if prometheus_binary() is None:
        pytest.skip("prometheus not installed (scripts/install-prometheus.sh)")
    from replicas.metrics_server import start_metrics_server

    ray_port = free_port()
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    driver = subprocess.Popen([sys.executable, "-m", "tests.cluster.test_metrics_prometheus", "ray-driver",
                               str(ray_port)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              stderr=subprocess.DEVNULL, text=True, env=env, cwd=REPO)
    engine, lock = SyntheticEngine(), threading.Lock()

    def standalone_stats():
        with lock:
            return engine.step() if engine.step_no < STEPS else engine.idle()

    standalone = start_metrics_server(standalone_stats, 0, model_name=STANDALONE_MODEL, replica="s0",
                                      addr="127.0.0.1", interval_s=0.25)
    standalone.recorder.record_controller_decision("max_num_batched_tokens", 1024, "kv_pressure")
    standalone.recorder.record_admission(*SyntheticEngine.admission(0))
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


class TestSynthetic:
    """The synthetic cluster lives for this class only: it is gone before the real servers below start."""

    @needs_prometheus
    @pytest.mark.parametrize("model", [RAY_MODEL, STANDALONE_MODEL])
    def test_names_labels_and_every_dashboard_expression(self, synthetic_cluster, model):
        prom, _ = synthetic_cluster
        wait_all_families(prom, model)
        assert not [n for n in prom.metric_names() if n.startswith("ray_tidal_")], "relabelling left Ray names"
        assert_expressions_return_data(prom, dashboard_expressions(), model)
        replicas = ["r0", "r1"] if model == RAY_MODEL else ["s0"]
        prom.wait_until(lambda: prom.label_values("replica", f'tidal:num_requests_running{{model_name="{model}"}}')
                        == replicas, WAIT_S, f"replicas {replicas} of {model}")
        assert prom.query(f'tidal:elastic_mode{{model_name="{model}", mode="elastic"}} == 1')

    @needs_prometheus
    def test_counters_match_and_gauges_go_idle(self, synthetic_cluster):
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
#
# One Prometheus scrapes two servers. The session's `tidal_server` (two replicas) takes chat load. The
# "events" server started here is sized so that a short load makes every event a dashboard plots
# happen: speculative decoding with an echo drafter; a base KV region of 8 blocks under an elastic
# reserve, so three long decodes spill into the lent reserve and a long prompt then forces a reclaim
# that preempts one of them and migrates the others' reserve blocks; and the fleet controller (chunk policy,
# its TTFT SLO out of reach) raising the lowered token budget back to its limit after the load.

MAIN_JOB, EVENTS_JOB = "tidal", "tidal-events"
EVENTS_BASE_BLOCKS = 8          # 128 tokens: ElasticKV needs one sequence of max_model_len to fit in the base
EVENTS_MAX_MODEL_LEN = 128
EVENTS_BUDGET = 128             # so lend_step_tokens = 64: a step of more tokens needs the reserve back
EVENTS_START_BUDGET = 96        # above 64 (a long prompt can still trigger a reclaim); once the load finished, the
                                # chunk policy, whose TTFT SLO (1 ms) no request meets, doubles it up to the 128 limit
EVENTS_MAX_SEQS = 4             # the three decodes and the long prompt
DECODE_PROMPTS = tuple(f"{word}: " + " ".join(["ha"] * 10) for word in ("one", "two", "three"))
DECODE_TOKENS = 72              # " ha" over and over: the echo drafter's proposals are accepted
LONG_PROMPT = "Summarize: " + " ".join(f"item {i}," for i in range(18))    # ~80 tokens
LONG_PROMPT_TOKENS = 8
# Afterwards, two requests with one schema (a compile, then a cache hit): constrained, they decode plainly.
STRUCTURED = {"type": "json_schema", "json_schema": {"name": "n", "schema": {
    "type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99}}, "required": ["n"]}}}
SPILLED_BLOCKS = 3              # live reserve blocks before the long prompt: one sequence preempted, two migrated
LOAD_TIMEOUT_S = 300


def echo_drafter(folder: Path):
    """Saves a drafter for the default model whose first slot proposes the root token again (its layer adds
    nothing to the root's embedding, and the target's tied LM head maps that back to the token), so the target
    accepts a draft whenever it repeats a token. Returns the target's ModelConfig."""
    import torch

    from replicas.loaders import load_checkpoint
    from speculative.drafter import DominoDrafter, DrafterConfig

    model_config = load_checkpoint(None).model_config
    torch.manual_seed(0)
    drafter = DominoDrafter(DrafterConfig.for_target(model_config, num_layers=1))
    with torch.no_grad():
        for layer in drafter.backbone.layers:
            layer.attn.o_proj.weight.zero_()
            layer.down.weight.zero_()
    drafter.save(str(folder))
    return model_config


def events_server_flags(drafter: Path, model_config) -> list[str]:
    """The reserve is what the CPU KV budget holds beyond EVENTS_BASE_BLOCKS (float32 KV on CPU), all of it
    lendable: the lowered start budget grants none of it to the base."""
    from replicas.config import EngineConfig

    cfg, mc = EngineConfig(), model_config
    block_bytes = 2 * cfg.cache.block_size * mc.num_key_value_heads * mc.head_dim * 4 * mc.num_hidden_layers
    reserve = cfg.cache.kv_cache_bytes // block_bytes - EVENTS_BASE_BLOCKS
    return ["--replicas", "1", "--max-model-len", str(EVENTS_MAX_MODEL_LEN), "--max-num-seqs", str(EVENTS_MAX_SEQS),
            "--max-num-batched-tokens", str(EVENTS_BUDGET), "--knob", f"max_num_batched_tokens={EVENTS_START_BUDGET}",
            "--elastic", "elastic", "--reserve-blocks", str(reserve), "--no-elastic-budget-grants",
            "--speculative", "dominotree", "--drafter", str(drafter), "--spec-budget", "4", "--spec-policy", "knee",
            "--controller", "chunk", "--controller-interval", "1", "--ttft-slo-ms", "1"]


def replica_stats(base_url: str) -> list[dict]:
    """GET /stats: every replica's {"replica_id", "model", "stats", ...}."""
    import urllib.request

    with urllib.request.urlopen(f"{base_url}/stats", timeout=30) as r:
        return json.load(r)["data"]


@dataclass(frozen=True)
class Served:
    prom: object            # prometheus_util.PrometheusServer
    main_url: str
    events_url: str


@pytest.fixture(scope="module")
def served(tmp_path_factory, tidal_server, tidal_metrics_port, tidal_server_factory):
    if prometheus_binary() is None:
        pytest.skip("prometheus not installed (scripts/install-prometheus.sh)")
    main_url, main_port, start_server = tidal_server.rstrip("/"), int(tidal_metrics_port), tidal_server_factory
    drafter = tmp_path_factory.mktemp("echo-drafter")
    events = start_server(*events_server_flags(drafter, echo_drafter(drafter)))
    prom = None
    try:
        base = [d["stats"]["kv_blocks_total"] for d in replica_stats(events.url)]
        assert base == [EVENTS_BASE_BLOCKS], f"events server base KV region is {base} blocks, not the planned " \
                                             f"{EVENTS_BASE_BLOCKS} (did the CPU KV sizing change?)"
        prom = start_prometheus([
            ScrapeJob(MAIN_JOB, (f"127.0.0.1:{main_port}",), RAY_METRIC_RELABEL_CONFIGS),
            ScrapeJob(EVENTS_JOB, (f"127.0.0.1:{events.metrics_port}",), RAY_METRIC_RELABEL_CONFIGS),
        ])
        yield Served(prom, main_url, events.url)
    finally:
        if prom is not None:
            prom.stop()
        events.stop()


def chat_load(openai, base_url: str) -> int:
    """Eight chat completions, four at a time; returns the completion tokens the clients received."""
    # No retries: a retried request's first attempt would count tokens no client received.
    client = openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", timeout=LOAD_TIMEOUT_S, max_retries=0)
    model = client.models.list().data[0].id

    def complete(i: int) -> int:
        out = client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": f"Write one sentence about the number {i}."}],
            max_tokens=24, temperature=0)
        return out.usage.completion_tokens

    with ThreadPoolExecutor(max_workers=4) as pool:
        return sum(pool.map(complete, range(8)))


def event_load(openai, base_url: str) -> int:
    """The events server's load (see above); returns the completion tokens the clients received."""
    import time

    # No retries: a retried request's first attempt would count tokens no client received.
    client = openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", timeout=LOAD_TIMEOUT_S, max_retries=0)
    model = client.models.list().data[0].id

    def complete(prompt: str, max_tokens: int) -> int:
        out = client.completions.create(model=model, prompt=prompt, max_tokens=max_tokens, temperature=0)
        return out.usage.completion_tokens

    with ThreadPoolExecutor(max_workers=EVENTS_MAX_SEQS) as pool:
        decodes = [pool.submit(complete, p, DECODE_TOKENS) for p in DECODE_PROMPTS]
        deadline = time.monotonic() + LOAD_TIMEOUT_S
        while max(d["stats"]["reserve_blocks_used"] for d in replica_stats(base_url)) < SPILLED_BLOCKS:
            if all(f.done() for f in decodes) or time.monotonic() > deadline:
                received = sum(f.result() for f in decodes)
                raise AssertionError(f"the decodes ({received} tokens) never held {SPILLED_BLOCKS} reserve blocks")
            time.sleep(0.2)
        long_prompt = pool.submit(complete, LONG_PROMPT, LONG_PROMPT_TOKENS)
        received = sum(f.result() for f in [*decodes, long_prompt])
    for _ in range(2):
        received += client.completions.create(model=model, prompt="A number:", max_tokens=24, temperature=0,
                                              extra_body={"response_format": STRUCTURED}).usage.completion_tokens
    # The chunk controller judges a budget on `min_requests` requests that arrived under it within `window_s`: on
    # a slow machine the load's requests age out of that window before enough of them finish, so short requests
    # follow until it has raised the budget to its limit.
    deadline = time.monotonic() + LOAD_TIMEOUT_S
    while replica_stats(base_url)[0]["stats"]["max_num_batched_tokens"] < EVENTS_BUDGET:
        assert time.monotonic() < deadline, f"the chunk controller never raised the budget to {EVENTS_BUDGET}"
        with ThreadPoolExecutor(max_workers=EVENTS_MAX_SEQS) as pool:
            received += sum(pool.map(complete, [f"Count to {i}:" for i in range(EVENTS_MAX_SEQS)],
                                     [2] * EVENTS_MAX_SEQS))
        time.sleep(1)
    stats = replica_stats(base_url)[0]["stats"]
    happened = {k: stats[k] for k in ("spec_accepted_tokens", "preemptions", "reclaim_total", "blocks_migrated",
                                      "elastic_preemptions", "spec_constrained_plain", "grammar_cache_hits",
                                      "grammar_compiles", "grammar_mask_steps")}
    assert all(happened.values()), f"the events server's load missed an event: {happened}"
    return received


def engine_generation_tokens(base_url: str) -> int:
    """The replicas' own generation-token counters (each exported from 0 by its replica's recorder)."""
    return sum(d["stats"]["generation_tokens"] for d in replica_stats(base_url))


@needs_prometheus
def test_tidal_serve_metrics_under_load(served):
    openai = pytest.importorskip("openai")
    prom = served.prom
    urls = {MAIN_JOB: served.main_url, EVENTS_JOB: served.events_url}
    before = {job: engine_generation_tokens(url) for job, url in urls.items()}
    with ThreadPoolExecutor(max_workers=2) as pool:
        main, events = pool.submit(chat_load, openai, served.main_url), pool.submit(event_load, openai,
                                                                                    served.events_url)
        received = {MAIN_JOB: main.result(), EVENTS_JOB: events.result()}
    for job, got in received.items():
        counted = engine_generation_tokens(urls[job])
        assert counted - before[job] == got, f"{job}: the engines counted {counted - before[job]} generation " \
                                             f"tokens, the clients received {got}"
        expr = f'sum(tidal:generation_tokens_total{{job="{job}"}})'
        try:
            prom.wait_until(lambda expr=expr, counted=counted: prom.value(f"{expr} == {counted}"), WAIT_S,
                            f"{job}: exported generation tokens == the engines' {counted}")
        except AssertionError as e:
            raise AssertionError(f"{job}: Prometheus has {prom.value(expr)}; {e}") from None

    events = replica_stats(served.events_url)
    model = events[0]["model"]
    seen = assert_names_and_labels(prom, model)
    assert seen == {spec.exported_name for spec in METRICS.values()} - ONLY_AFTER_A_REFUSAL - ONLY_WITH_ASYNC_SCHEDULING
    assert not [n for n in prom.metric_names() if n.startswith("ray_tidal_")]
    # Every expression of every dashboard, with $replica = the events server's replica(s).
    assert_expressions_return_data(prom, dashboard_expressions(), model,
                                   replica="|".join(d["replica_id"] for d in events))
    setting = 'tidal:controller_setting{job="%s", knob="max_num_batched_tokens"}' % EVENTS_JOB
    prom.wait_until(lambda: prom.value(f"max({setting})") == EVENTS_BUDGET, WAIT_S,
                    f"the controller's restored budget {EVENTS_BUDGET} exported")
    assert prom.value(f'sum(tidal:spec_decode_num_accepted_tokens_per_pos_total{{job="{EVENTS_JOB}", '
                      f'position="0"}})') > 0
    for job in (MAIN_JOB, EVENTS_JOB):
        prom.wait_until(lambda job=job: prom.value(
                            f'max(tidal:kv_cache_usage_perc{{job="{job}", model_name="{model}"}}) == 0') == 0,
                        WAIT_S, f"{job}: KV usage back to 0 when idle")


if __name__ == "__main__" and sys.argv[1:2] == ["ray-driver"]:
    run_ray_driver(int(sys.argv[2]))
