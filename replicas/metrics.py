"""tidal's metrics: one table of definitions and the recorder that turns engine snapshots into updates.

Every metric is exported as `tidal:<name>` (counters as `tidal:<name>_total`), with vLLM's names and buckets
where vLLM has the same metric. Two export paths share the table: Ray's metrics path in a Serve replica
(cluster/metrics.py) and prometheus_client in a standalone engine (replicas/metrics_server.py).

Counters travel as engine snapshots (`EngineStats`); `StatsRecorder` keeps the previous snapshot
and turns each new one into increments. Ratios (prefix hit rate, acceptance rate, tokens per step)
are pairs of counters divided in PromQL. Every gauge is set again on every snapshot, including the
ones that change rarely (controller settings, elastic modes left): Ray's metrics agent drops a gauge
series that was not refreshed within two export intervals.
"""
from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Iterable, Mapping, Protocol, Sequence

from replicas.stats import EngineStats, RequestTimings

PREFIX = "tidal"
BASE_LABELS = ("model_name", "replica", "tp_rank")


class Kind(str, Enum):
    COUNTER = "counter"
    GAUGE = "gauge"
    HISTOGRAM = "histogram"


@dataclass(frozen=True)
class MetricSpec:
    name: str                           # without prefix or `_total`
    kind: Kind
    help: str
    extra_labels: tuple[str, ...] = ()
    buckets: tuple[float, ...] = ()

    @property
    def labels(self) -> tuple[str, ...]:
        return BASE_LABELS + self.extra_labels

    @property
    def exported_name(self) -> str:
        """The family name Prometheus stores (after relabelling on the Ray path)."""
        suffix = "_total" if self.kind is Kind.COUNTER else ""
        return f"{PREFIX}:{self.name}{suffix}"

    @property
    def ray_name(self) -> str:
        return f"{PREFIX}_{self.name}"

    @property
    def series_names(self) -> tuple[str, ...]:
        if self.kind is Kind.HISTOGRAM:
            return tuple(f"{self.exported_name}_{s}" for s in ("bucket", "sum", "count"))
        return (self.exported_name,)


# vLLM's buckets for the same histograms.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
               20.0, 40.0, 80.0)
REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
                           60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
# Elastic KV: decommit takes a few ms, recommit tens of ms; the tail reaches seconds with migration.
ELASTIC_LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
# Grammars: a compile takes milliseconds to seconds (large schemas, large vocabularies); a step's bitmask fill
# tens of microseconds per row.
GRAMMAR_COMPILE_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
GRAMMAR_MASK_BUCKETS = (0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1)

C, G, H = Kind.COUNTER, Kind.GAUGE, Kind.HISTOGRAM
METRICS: dict[str, MetricSpec] = {s.name: s for s in (
    # serving (vLLM names)
    MetricSpec("num_requests_running", G, "Requests in the running batch."),
    MetricSpec("num_requests_waiting", G, "Requests waiting to be scheduled."),
    MetricSpec("kv_cache_usage_perc", G, "Fraction of KV-cache blocks in use (0 to 1)."),
    MetricSpec("prefix_cache_queries", C, "Prompt tokens looked up in the prefix cache."),
    MetricSpec("prefix_cache_hits", C, "Prompt tokens served from the prefix cache."),
    MetricSpec("num_preemptions", C, "Sequences preempted by the scheduler."),
    MetricSpec("num_kv_admission_waits", C,
               "Admissions stopped because the waiting queue's head did not fit in the free KV blocks."),
    MetricSpec("prompt_tokens", C,
               "Prompt tokens of requests that produced a first token (prefix-cache hits included)."),
    MetricSpec("generation_tokens", C, "Tokens generated."),
    MetricSpec("iteration_tokens", C, "Tokens scheduled, summed over engine steps (divide by num_steps)."),
    MetricSpec("num_steps", C, "Engine steps run."),
    MetricSpec("num_steps_ahead", C, "Engine steps launched before the last step's tokens were read back "
                                     "(async scheduling)."),
    MetricSpec("request_success", C, "Finished requests by finish reason.", ("finished_reason",)),
    MetricSpec("time_to_first_token_seconds", H, "Time to first token.", buckets=TTFT_BUCKETS),
    MetricSpec("inter_token_latency_seconds", H, "Time between streamed tokens.", buckets=ITL_BUCKETS),
    MetricSpec("e2e_request_latency_seconds", H, "Arrival to finish.", buckets=REQUEST_LATENCY_BUCKETS),
    MetricSpec("request_queue_time_seconds", H, "Arrival to first scheduling.", buckets=REQUEST_LATENCY_BUCKETS),
    MetricSpec("max_num_batched_tokens", G, "Token budget of one engine step."),
    # a serving replica's admission (cluster/admission.py)
    MetricSpec("num_requests_queued", G,
               "Generation requests a replica holds: admitted, not finished (running or waiting in the engine)."),
    MetricSpec("num_tokens_queued", G,
               "Prompt plus most output tokens of the requests a replica holds (what admission counts)."),
    MetricSpec("max_queued_tokens", G, "The token limit of a replica's admission; beyond it, a 503."),
    MetricSpec("num_requests_refused", C,
               "Generation requests refused with a 503 overloaded, by reason (tokens: the token limit; requests: "
               "the request-count bound).", ("reason",)),
    # elastic KV reserve
    MetricSpec("elastic_mode", G, "1 for the engine's current elastic KV mode, 0 for modes it left.", ("mode",)),
    MetricSpec("reserve_bytes", G, "Bytes of the prefill-activation reserve."),
    MetricSpec("reserve_lent_bytes", G, "Reserve bytes lent to the KV pool now."),
    MetricSpec("reserve_utilization", G, "Fraction of reserve KV blocks holding live KV (0 to 1)."),
    MetricSpec("reserve_granted_blocks", G, "Reserve blocks given to the KV pool for good while the step budget "
               "is below the one the reserve was sized for."),
    MetricSpec("elastic_lend", C, "Times the reserve was lent to the KV pool."),
    MetricSpec("elastic_reclaim", C, "Times the reserve was reclaimed for a prefill."),
    MetricSpec("elastic_lend_seconds", H, "Duration of one lend (map).", buckets=ELASTIC_LATENCY_BUCKETS),
    MetricSpec("elastic_reclaim_seconds", H, "Duration of one reclaim (migrate + unmap).",
               buckets=ELASTIC_LATENCY_BUCKETS),
    MetricSpec("blocks_migrated", C, "KV blocks moved out of the reserve before a reclaim, or out of a grant "
               "given back to the reserve."),
    MetricSpec("elastic_preemptions", C, "Sequences preempted because a reclaim found no free base block."),
    # speculative decoding (vLLM names)
    MetricSpec("spec_decode_num_drafts", C, "Draft rounds verified."),
    MetricSpec("spec_decode_num_draft_tokens", C, "Draft tokens proposed."),
    MetricSpec("spec_decode_num_accepted_tokens", C, "Draft tokens accepted."),
    MetricSpec("spec_decode_num_accepted_tokens_per_pos", C, "Accepted draft tokens by depth.", ("position",)),
    MetricSpec("spec_decode_constrained_plain", C,
               "Decode rows of constrained requests (grammar or logit_bias) that decoded plainly where they "
               "would have drafted."),
    # structured outputs
    MetricSpec("constrained_requests", C, "Requests with a grammar or logit_bias, by kind.", ("kind",)),
    MetricSpec("grammar_cache_hits", C, "Grammar requests served from the compiled-grammar cache."),
    MetricSpec("grammar_compile_seconds", H, "Duration of one grammar compile (a cache miss).",
               buckets=GRAMMAR_COMPILE_BUCKETS),
    MetricSpec("grammar_mask_seconds", H,
               "Host time to fill one step's grammar bitmask (on CUDA it overlaps the forward).",
               buckets=GRAMMAR_MASK_BUCKETS),
    # fleet controller
    MetricSpec("controller_decisions", C, "Controller decisions applied to a replica.", ("knob", "reason")),
    MetricSpec("controller_setting", G, "Value the controller last set for a knob.", ("knob",)),
)}
del C, G, H

# EngineStats monotonic counter field -> metric name.
COUNTER_FIELDS: tuple[tuple[str, str], ...] = (
    ("prompt_tokens", "prompt_tokens"),
    ("generation_tokens", "generation_tokens"),
    ("prefix_cache_queries", "prefix_cache_queries"),
    ("prefix_cache_hits", "prefix_cache_hits"),
    ("preemptions", "num_preemptions"),
    ("kv_admission_waits", "num_kv_admission_waits"),
    ("iteration_tokens_total", "iteration_tokens"),
    ("num_steps", "num_steps"),
    ("steps_ahead", "num_steps_ahead"),
    ("lend_total", "elastic_lend"),
    ("reclaim_total", "elastic_reclaim"),
    ("blocks_migrated", "blocks_migrated"),
    ("elastic_preemptions", "elastic_preemptions"),
    ("spec_drafts", "spec_decode_num_drafts"),
    ("spec_draft_tokens", "spec_decode_num_draft_tokens"),
    ("spec_accepted_tokens", "spec_decode_num_accepted_tokens"),
    ("spec_constrained_plain", "spec_decode_constrained_plain"),
    ("grammar_cache_hits", "grammar_cache_hits"),
)
# EngineStats counters by label value (a list: by index; a dict: by key) -> (metric name, label).
LABELLED_COUNTER_FIELDS: tuple[tuple[str, str, str], ...] = (
    ("spec_accepted_by_position", "spec_decode_num_accepted_tokens_per_pos", "position"),
    ("constrained_requests", "constrained_requests", "kind"),
)
# (EngineStats count of samples taken, EngineStats newest samples, histogram): the count's increase says how many
# of the newest samples are new since the previous snapshot.
LATENCY_FIELDS: tuple[tuple[str, str, str], ...] = (
    ("lend_total", "lend_latencies", "elastic_lend_seconds"),
    ("reclaim_total", "reclaim_latencies", "elastic_reclaim_seconds"),
    ("grammar_compiles", "grammar_compile_latencies", "grammar_compile_seconds"),
    ("grammar_mask_steps", "grammar_mask_latencies", "grammar_mask_seconds"),
)

class MetricSink(Protocol):
    """Where recorded values go: Ray's metrics path or a prometheus_client registry."""

    def inc(self, spec: MetricSpec, value: float, labels: dict[str, str]) -> None: ...
    def set(self, spec: MetricSpec, value: float, labels: dict[str, str]) -> None: ...
    def observe(self, spec: MetricSpec, values: Iterable[float], labels: dict[str, str]) -> None: ...


class StatsRecorder:
    """Turns successive `EngineStats` snapshots and finished-request timings into metric updates
    for one (model_name, replica, tp_rank). Counters start from zero, so the exported counter
    equals the engine's; a counter that goes backwards (engine restart) restarts from zero."""

    def __init__(self, sink: MetricSink, model_name: str, replica: str, tp_rank: int = 0):
        self.sink = sink
        self.labels = {"model_name": model_name, "replica": replica, "tp_rank": str(tp_rank)}
        self._prev = {field: 0 for field, _ in COUNTER_FIELDS}
        self._prev_labelled: dict[str, dict[str, int]] = {field: {} for field, _, _ in LABELLED_COUNTER_FIELDS}
        self._prev_samples = {count: 0 for count, _, _ in LATENCY_FIELDS}
        self._modes: set[str] = set()                 # elastic modes seen; all but the current one export 0
        self._settings: dict[str, float] = {}         # knob -> the value the controller last set
        self._prev_refused: dict[str, int] = {}

    def record(self, stats: EngineStats, timings: Sequence[RequestTimings] = ()) -> None:
        self._record_counters(stats)
        self._record_gauges(stats)
        self._record_latencies(stats)
        self._record_timings(timings)

    def record_controller_decision(self, knob: str, value: float, reason: str, applied: bool = True) -> None:
        """A decision of the fleet controller; one it only advised (`applied` False) leaves the setting as it was."""
        self.sink.inc(METRICS["controller_decisions"], 1, {**self.labels, "knob": knob, "reason": reason})
        if applied:
            self._settings[knob] = float(value)
            self.sink.set(METRICS["controller_setting"], float(value), {**self.labels, "knob": knob})

    def record_admission(self, requests: int, tokens: int, token_limit: int, refused: Mapping[str, int]) -> None:
        """A serving replica's admission: its queue now, its token limit, and its refusals since it started, by
        reason (monotonic counts, exported as increments)."""
        for name, value in (("num_requests_queued", requests), ("num_tokens_queued", tokens),
                            ("max_queued_tokens", token_limit)):
            self.sink.set(METRICS[name], float(value), self.labels)
        spec = METRICS["num_requests_refused"]
        for reason, now in refused.items():
            self._inc(spec, _increment(self._prev_refused.get(reason, 0), now), {**self.labels, "reason": reason})
            self._prev_refused[reason] = now

    def _record_counters(self, stats: EngineStats) -> None:
        """Exports each counter's increase since the previous snapshot."""
        for field, name in COUNTER_FIELDS:
            now = getattr(stats, field)
            self._inc(METRICS[name], _increment(self._prev[field], now), self.labels)
            self._prev[field] = now
        for field, name, label in LABELLED_COUNTER_FIELDS:
            values = getattr(stats, field)
            by_label = {str(k): v for k, v in (enumerate(values) if isinstance(values, list) else values.items())}
            prev = self._prev_labelled[field]
            for value, now in by_label.items():
                self._inc(METRICS[name], _increment(prev.get(value, 0), now), {**self.labels, label: value})
            self._prev_labelled[field] = by_label

    def _record_gauges(self, stats: EngineStats) -> None:
        values = {
            "num_requests_running": stats.num_running,
            "num_requests_waiting": stats.num_waiting,
            "kv_cache_usage_perc": stats.kv_cache_usage,
            "max_num_batched_tokens": stats.max_num_batched_tokens,
            "reserve_bytes": stats.reserve_bytes,
            "reserve_lent_bytes": stats.reserve_lent_bytes,
            "reserve_granted_blocks": stats.reserve_granted_blocks,
            "reserve_utilization": (stats.reserve_blocks_used / stats.reserve_blocks_total
                                    if stats.reserve_blocks_total else 0.0),
        }
        for name, value in values.items():
            self.sink.set(METRICS[name], float(value), self.labels)
        self._modes.add(stats.elastic_mode)
        for mode in self._modes:
            self.sink.set(METRICS["elastic_mode"], float(mode == stats.elastic_mode), {**self.labels, "mode": mode})
        # A decision arrives on another thread: iterate over a copy.
        for knob, value in list(self._settings.items()):
            self.sink.set(METRICS["controller_setting"], value, {**self.labels, "knob": knob})

    def _record_latencies(self, stats: EngineStats) -> None:
        # The stats carry the newest samples (not drained on read); their counts say how many are new.
        for count, field, name in LATENCY_FIELDS:
            now = getattr(stats, count)
            new = int(_increment(self._prev_samples[count], now))
            self._prev_samples[count] = now
            samples = list(getattr(stats, field, None) or [])[-new:] if new else []
            if samples:
                self.sink.observe(METRICS[name], samples, self.labels)

    def _record_timings(self, timings: Sequence[RequestTimings]) -> None:
        if not timings:
            return
        observe = self.sink.observe
        observe(METRICS["time_to_first_token_seconds"],
                [t.first_token_time - t.arrival_time for t in timings], self.labels)
        observe(METRICS["e2e_request_latency_seconds"], [t.finish_time - t.arrival_time for t in timings],
                self.labels)
        observe(METRICS["request_queue_time_seconds"], [t.scheduled_time - t.arrival_time for t in timings],
                self.labels)
        observe(METRICS["inter_token_latency_seconds"],
                [itl for t in timings for itl in t.inter_token_latencies], self.labels)
        finished: dict[str, int] = {}
        for t in timings:
            finished[t.finish_reason] = finished.get(t.finish_reason, 0) + 1
        for reason, count in finished.items():
            self.sink.inc(METRICS["request_success"], count, {**self.labels, "finished_reason": reason})

    def _inc(self, spec: MetricSpec, value: float, labels: dict[str, str]) -> None:
        if value > 0:   # Ray counters refuse zero increments
            self.sink.inc(spec, value, labels)


def _increment(before: float, now: float) -> float:
    return now - before if now >= before else now
