"""The metrics recorder, the metric table, the standalone /metrics server and the dashboards' source."""
from __future__ import annotations

import json
import re
import urllib.request

import pytest
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

from cluster.metrics import RAY_METRIC_RELABEL_CONFIGS, RayMetricSink, ReplicaMetrics
from replicas.metrics import BASE_LABELS, METRICS, Kind, StatsRecorder
from replicas.metrics_server import PrometheusClientSink, start_metrics_server
from replicas.stats import EngineStats, RequestTimings
from tests.support import REPO

LABELS = {"model_name": "m", "replica": "r0", "tp_rank": "0"}

# The exported families, as dashboards and users see them (the contract of issue 6).
EXPECTED_FAMILIES = {
    "tidal:num_requests_running", "tidal:num_requests_waiting", "tidal:kv_cache_usage_perc",
    "tidal:prefix_cache_queries_total", "tidal:prefix_cache_hits_total", "tidal:num_preemptions_total",
    "tidal:num_kv_admission_waits_total",
    "tidal:prompt_tokens_total", "tidal:generation_tokens_total", "tidal:iteration_tokens_total",
    "tidal:num_steps_total", "tidal:num_steps_ahead_total", "tidal:request_success_total",
    "tidal:time_to_first_token_seconds",
    "tidal:inter_token_latency_seconds", "tidal:e2e_request_latency_seconds", "tidal:request_queue_time_seconds",
    "tidal:max_num_batched_tokens", "tidal:elastic_mode", "tidal:reserve_bytes", "tidal:reserve_lent_bytes",
    "tidal:reserve_utilization", "tidal:reserve_granted_blocks", "tidal:elastic_lend_total", "tidal:elastic_reclaim_total",
    "tidal:elastic_lend_seconds", "tidal:elastic_reclaim_seconds", "tidal:blocks_migrated_total",
    "tidal:elastic_preemptions_total", "tidal:spec_decode_num_drafts_total",
    "tidal:spec_decode_num_draft_tokens_total", "tidal:spec_decode_num_accepted_tokens_total",
    "tidal:spec_decode_num_accepted_tokens_per_pos_total", "tidal:controller_decisions_total",
    "tidal:controller_setting", "tidal:spec_decode_constrained_plain_total", "tidal:constrained_requests_total",
    "tidal:grammar_cache_hits_total", "tidal:grammar_compile_seconds", "tidal:grammar_mask_seconds",
    "tidal:num_requests_queued", "tidal:num_tokens_queued", "tidal:max_queued_tokens",
    "tidal:num_requests_refused_total",
}


class CallLog:
    """A MetricSink that keeps every call, to check the exact increments the recorder emits."""

    def __init__(self):
        self.calls: list[tuple[str, str, object, dict]] = []

    def inc(self, spec, value, labels):
        self.calls.append(("inc", spec.name, value, dict(labels)))

    def set(self, spec, value, labels):
        self.calls.append(("set", spec.name, value, dict(labels)))

    def observe(self, spec, values, labels):
        self.calls.append(("observe", spec.name, list(values), dict(labels)))

    def of(self, op: str, name: str) -> list[tuple[object, dict]]:
        return [(v, lab) for o, n, v, lab in self.calls if o == op and n == name]


def registry_recorder() -> tuple[StatsRecorder, CollectorRegistry]:
    registry = CollectorRegistry()
    return StatsRecorder(PrometheusClientSink(registry), "m", "r0", 0), registry


def timing(rid: str, reason: str = "stop", itl=(0.02, 0.03)) -> RequestTimings:
    return RequestTimings(rid, arrival_time=10.0, scheduled_time=10.5, first_token_time=11.0, finish_time=13.0,
                          num_prompt_tokens=5, num_generation_tokens=len(itl) + 1, finish_reason=reason,
                          inter_token_latencies=list(itl))


def test_table_names_and_labels():
    assert {s.exported_name for s in METRICS.values()} == EXPECTED_FAMILIES
    for spec in METRICS.values():
        assert spec.labels[:3] == BASE_LABELS
        assert (spec.kind is Kind.HISTOGRAM) == bool(spec.buckets)
        assert list(spec.buckets) == sorted(set(spec.buckets))
    assert METRICS["request_success"].extra_labels == ("finished_reason",)
    assert METRICS["spec_decode_num_accepted_tokens_per_pos"].extra_labels == ("position",)
    assert METRICS["controller_decisions"].extra_labels == ("knob", "reason")
    assert METRICS["controller_setting"].extra_labels == ("knob",)
    assert METRICS["elastic_mode"].extra_labels == ("mode",)
    assert METRICS["constrained_requests"].extra_labels == ("kind",)
    assert METRICS["num_requests_refused"].extra_labels == ("reason",)
    assert METRICS["time_to_first_token_seconds"].buckets[:3] == (0.001, 0.005, 0.01)   # vLLM's


def test_counter_snapshots_become_increments():
    log = CallLog()
    rec = StatsRecorder(log, "m", "r0", 0)
    rec.record(EngineStats(generation_tokens=10, prompt_tokens=4, num_steps=3))
    rec.record(EngineStats(generation_tokens=25, prompt_tokens=4, num_steps=5))
    assert log.of("inc", "generation_tokens") == [(10, LABELS), (15, LABELS)]
    assert log.of("inc", "prompt_tokens") == [(4, LABELS)]          # no zero increments (Ray refuses them)
    assert log.of("inc", "num_steps") == [(3, LABELS), (2, LABELS)]
    assert log.of("inc", "num_preemptions") == []
    rec.record(EngineStats(generation_tokens=7))                      # engine restarted: counts from zero again
    assert log.of("inc", "generation_tokens")[-1] == (7, LABELS)


def test_exported_counters_equal_engine_counters():
    rec, registry = registry_recorder()
    snapshots = [EngineStats(generation_tokens=g, prefix_cache_queries=q, prefix_cache_hits=h, preemptions=p,
                             lend_total=lend, spec_drafts=d, spec_draft_tokens=4 * d, spec_accepted_tokens=3 * d)
                 for g, q, h, p, lend, d in [(3, 10, 0, 0, 1, 2), (9, 30, 16, 1, 1, 5), (40, 30, 16, 2, 4, 9)]]
    for s in snapshots:
        rec.record(s)
    value = lambda family: registry.get_sample_value(family, LABELS)  # noqa: E731
    assert value("tidal:generation_tokens_total") == 40
    assert value("tidal:prefix_cache_queries_total") == 30
    assert value("tidal:prefix_cache_hits_total") == 16
    assert value("tidal:num_preemptions_total") == 2
    assert value("tidal:elastic_lend_total") == 4
    assert value("tidal:spec_decode_num_drafts_total") == 9
    assert value("tidal:spec_decode_num_draft_tokens_total") == 36
    assert value("tidal:spec_decode_num_accepted_tokens_total") == 27


def test_accepted_per_position_grows_with_new_positions():
    log = CallLog()
    rec = StatsRecorder(log, "m", "r0", 0)
    rec.record(EngineStats(spec_accepted_by_position=[3, 1]))
    rec.record(EngineStats(spec_accepted_by_position=[5, 1, 2]))
    incs = [(v, lab["position"]) for v, lab in log.of("inc", "spec_decode_num_accepted_tokens_per_pos")]
    assert incs == [(3, "0"), (1, "1"), (2, "0"), (2, "2")]


def test_constrained_requests_by_kind_and_grammar_latencies():
    log = CallLog()
    rec = StatsRecorder(log, "m", "r0", 0)
    rec.record(EngineStats(constrained_requests={"json_schema": 2}, grammar_compiles=1, grammar_cache_hits=1,
                           grammar_compile_latencies=[0.02], grammar_mask_steps=2,
                           grammar_mask_latencies=[1e-4, 2e-4], spec_constrained_plain=3))
    rec.record(EngineStats(constrained_requests={"json_schema": 2, "tool": 1}, grammar_compiles=1,
                           grammar_cache_hits=2, grammar_compile_latencies=[0.02], grammar_mask_steps=3,
                           grammar_mask_latencies=[1e-4, 2e-4, 3e-4], spec_constrained_plain=3))
    kinds = [(v, lab["kind"]) for v, lab in log.of("inc", "constrained_requests")]
    assert kinds == [(2, "json_schema"), (1, "tool")]
    assert [v for v, _ in log.of("inc", "grammar_cache_hits")] == [1, 1]
    assert [v for v, _ in log.of("inc", "spec_decode_constrained_plain")] == [3]
    assert [v for v, _ in log.of("observe", "grammar_compile_seconds")] == [[0.02]]
    assert [v for v, _ in log.of("observe", "grammar_mask_seconds")] == [[1e-4, 2e-4], [3e-4]]


def test_gauges_and_elastic_mode_switch():
    rec, registry = registry_recorder()
    rec.record(EngineStats(num_running=3, num_waiting=2, kv_blocks_total=200, kv_blocks_used=50,
                           max_num_batched_tokens=8192, elastic_mode="elastic", reserve_bytes=1 << 30,
                           reserve_lent_bytes=1 << 29, reserve_blocks_total=40, reserve_blocks_used=10))
    value = lambda family, **extra: registry.get_sample_value(family, {**LABELS, **extra})  # noqa: E731
    assert value("tidal:num_requests_running") == 3
    assert value("tidal:num_requests_waiting") == 2
    assert value("tidal:kv_cache_usage_perc") == 0.25
    assert value("tidal:max_num_batched_tokens") == 8192
    assert value("tidal:reserve_lent_bytes") == 1 << 29
    assert value("tidal:reserve_utilization") == 0.25
    assert value("tidal:elastic_mode", mode="elastic") == 1
    rec.record(EngineStats(elastic_mode="static"))
    assert value("tidal:elastic_mode", mode="elastic") == 0
    assert value("tidal:elastic_mode", mode="static") == 1
    assert value("tidal:kv_cache_usage_perc") == 0.0 and value("tidal:reserve_utilization") == 0.0


def test_request_timings_fill_histograms_and_success_counter():
    rec, registry = registry_recorder()
    rec.record(EngineStats(), [timing("a"), timing("b", "length", itl=(0.2,)), timing("c")])
    value = lambda family, **extra: registry.get_sample_value(family, {**LABELS, **extra})  # noqa: E731
    assert value("tidal:time_to_first_token_seconds_count") == 3
    assert value("tidal:time_to_first_token_seconds_sum") == pytest.approx(3.0)
    assert value("tidal:request_queue_time_seconds_sum") == pytest.approx(1.5)
    assert value("tidal:e2e_request_latency_seconds_sum") == pytest.approx(9.0)
    assert value("tidal:inter_token_latency_seconds_count") == 5
    assert value("tidal:inter_token_latency_seconds_bucket", le="0.025") == 2
    assert value("tidal:inter_token_latency_seconds_bucket", le="0.05") == 4
    assert value("tidal:request_success_total", finished_reason="stop") == 2
    assert value("tidal:request_success_total", finished_reason="length") == 1


def test_lend_and_reclaim_latencies_when_present():
    rec, registry = registry_recorder()
    rec.record(EngineStats())                                  # today's EngineStats: no latency lists
    assert registry.get_sample_value("tidal:elastic_lend_seconds_count", LABELS) is None
    stats = EngineStats(lend_total=2, reclaim_total=1)
    stats.lend_latencies = [0.003, 0.004]
    stats.reclaim_latencies = [0.04]
    rec.record(stats)
    assert registry.get_sample_value("tidal:elastic_lend_seconds_count", LABELS) == 2
    assert registry.get_sample_value("tidal:elastic_lend_seconds_bucket", {**LABELS, "le": "0.005"}) == 2
    assert registry.get_sample_value("tidal:elastic_reclaim_seconds_sum", LABELS) == pytest.approx(0.04)


def test_controller_decisions():
    rec, registry = registry_recorder()
    rec.record_controller_decision("max_num_batched_tokens", 4096, "kv_pressure")
    rec.record_controller_decision("max_num_batched_tokens", 2048, "kv_pressure")
    rec.record_controller_decision("elastic_lend", 1, "decode_heavy")
    decisions = {**LABELS, "knob": "max_num_batched_tokens", "reason": "kv_pressure"}
    assert registry.get_sample_value("tidal:controller_decisions_total", decisions) == 2
    assert registry.get_sample_value("tidal:controller_setting",
                                     {**LABELS, "knob": "max_num_batched_tokens"}) == 2048
    assert registry.get_sample_value("tidal:controller_setting", {**LABELS, "knob": "elastic_lend"}) == 1


def test_admission_gauges_and_refusals_by_reason():
    rec, registry = registry_recorder()
    rec.record_admission(3, 900, 4096, {"tokens": 0, "requests": 0})
    rec.record_admission(5, 4000, 4096, {"tokens": 2, "requests": 0})
    rec.record_admission(0, 0, 4096, {"tokens": 7, "requests": 1})
    value = lambda family, **extra: registry.get_sample_value(family, {**LABELS, **extra})  # noqa: E731
    assert (value("tidal:num_requests_queued"), value("tidal:num_tokens_queued")) == (0, 0)
    assert value("tidal:max_queued_tokens") == 4096
    assert value("tidal:num_requests_refused_total", reason="tokens") == 7
    assert value("tidal:num_requests_refused_total", reason="requests") == 1


def test_replica_metrics_records_through_ray_without_a_cluster():
    # Ray validates tag keys on every record (even with no cluster connected): a label the table
    # does not declare, or one it declares but the recorder does not pass, raises here.
    m = ReplicaMetrics("m", "r0", tp_rank=1)
    assert isinstance(m.sink, RayMetricSink) and m.labels["tp_rank"] == "1"
    stats = EngineStats(generation_tokens=5, spec_accepted_by_position=[1], elastic_mode="elastic")
    stats.lend_latencies = [0.01]
    m.record(stats, [timing("a")])
    m.record_controller_decision("max_num_batched_tokens", 4096, "kv_pressure")
    m.record_admission(2, 300, 4096, {"tokens": 1, "requests": 1})


def test_ray_relabel_rule_restores_tidal_names():
    rule = RAY_METRIC_RELABEL_CONFIGS[0]
    prom_to_python = rule["replacement"].replace("${1}", r"\1")
    for spec in METRICS.values():
        ray_exported = "ray_" + spec.ray_name + ("_total" if spec.kind is Kind.COUNTER else "")
        match = re.fullmatch(rule["regex"], ray_exported)
        assert match and match.expand(prom_to_python) == spec.exported_name
    assert re.fullmatch(rule["regex"], "ray_tasks") is None


def test_standalone_metrics_server_serves_the_same_names():
    polls = []

    def engine_stats():
        polls.append(1)
        s = EngineStats(num_running=1, kv_blocks_total=8, kv_blocks_used=2, generation_tokens=12,
                        spec_drafts=1, spec_draft_tokens=4, spec_accepted_tokens=2, spec_accepted_by_position=[1, 1])
        return s, ([timing("a")] if len(polls) == 1 else [])

    server = start_metrics_server(engine_stats, 0, model_name="m", replica="r0", addr="127.0.0.1", interval_s=30)
    try:
        # Prometheus asks for OpenMetrics first; the answer must still carry `tidal:` names.
        accept = "application/openmetrics-text;version=1.0.0,text/plain;version=0.0.4;q=0.5,*/*;q=0.1"
        request = urllib.request.Request(f"http://127.0.0.1:{server.port}/metrics", headers={"Accept": accept})
        text = urllib.request.urlopen(request, timeout=10).read().decode()
    finally:
        server.stop()
    samples = {s.name: s for fam in text_string_to_metric_families(text) for s in fam.samples}
    assert samples["tidal:generation_tokens_total"].value == 12
    assert samples["tidal:generation_tokens_total"].labels == LABELS
    assert samples["tidal:kv_cache_usage_perc"].value == 0.25
    assert samples["tidal:time_to_first_token_seconds_count"].value == 1
    assert samples["tidal:request_success_total"].labels == {**LABELS, "finished_reason": "stop"}
    known = {name for spec in METRICS.values() for name in spec.series_names}
    assert set(samples) <= known          # no `_created`, no `tidal_` spellings


# ---- dashboards as code -------------------------------------------------------------------------

GRAFANA_DIR = REPO / "grafana"


def dashboards_module():
    pytest.importorskip("grafana_foundation_sdk", reason="grafana-foundation-sdk not installed (test extra)")
    import grafana.dashboards
    return grafana.dashboards


def test_committed_dashboards_equal_generated():
    dashboards = dashboards_module()
    for d in dashboards.DASHBOARDS:
        path = GRAFANA_DIR / f"{d.name}.json"
        assert path.exists(), f"{path} missing: run python -m grafana.dashboards"
        assert path.read_text() == dashboards.render(d), f"{path} is stale: run python -m grafana.dashboards"


def test_dashboards_have_variables_uids_and_known_metrics():
    dashboards = dashboards_module()
    known = {name for spec in METRICS.values() for name in spec.series_names}
    uids = set()
    for d in dashboards.DASHBOARDS:
        board = json.loads((GRAFANA_DIR / f"{d.name}.json").read_text())
        assert board["uid"] == d.uid and d.uid.startswith("tidal-")
        uids.add(board["uid"])
        variables = {v["name"]: v for v in board["templating"]["list"]}
        assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
        assert {"model_name", "replica"} <= set(variables)
        panels = [p for p in board["panels"] if p["type"] != "row"]
        assert panels and len({p["id"] for p in board["panels"]}) == len(board["panels"])
        for p in panels:
            assert p["datasource"]["uid"] == "${datasource}"
            for t in p["targets"]:
                used = set(re.findall(r"tidal:[a-z0-9_]+", t["expr"]))
                assert used and used <= known, (p["title"], used - known)
                assert '$model_name' in t["expr"] and '$replica' in t["expr"]
    assert len(uids) == len(dashboards.DASHBOARDS)


def test_observability_doc_lists_every_metric():
    doc = (REPO / "docs" / "observability.md").read_text()
    missing = [spec.exported_name for spec in METRICS.values() if f"`{spec.exported_name}`" not in doc]
    assert not missing, f"docs/observability.md lacks {missing}"
