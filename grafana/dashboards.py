"""tidal's Grafana dashboards as code (grafana-foundation-sdk).

`python -m grafana.dashboards` writes `grafana/<name>.json`; a test checks the committed JSON equals
what this file generates. Every query reads `tidal:` metrics (see replicas/metrics.py) filtered by the
`model_name` and `replica` variables and aggregated `by` the labels a panel shows, so the extra
labels Ray adds to its series (WorkerId, SessionName, ...) never split a line.
"""
from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

from grafana_foundation_sdk.builders.dashboard import DatasourceVariable, QueryVariable, Row
from grafana_foundation_sdk.builders.dashboard import Dashboard as DashboardBuilder
from grafana_foundation_sdk.builders.prometheus import Dataquery
from grafana_foundation_sdk.builders.timeseries import Panel as TimeseriesPanel
from grafana_foundation_sdk.cog.encoder import JSONEncoder
from grafana_foundation_sdk.models.dashboard import DataSourceRef, VariableOption, VariableRefresh, VariableSort

OUT_DIR = Path(__file__).resolve().parent
DATASOURCE = DataSourceRef(type_val="prometheus", uid="${datasource}")
SEL = '{model_name=~"$model_name", replica=~"$replica"}'
QUANTILES = (0.5, 0.9, 0.99)


@dataclass(frozen=True)
class Target:
    expr: str
    legend: str


@dataclass(frozen=True)
class PanelDef:
    title: str
    unit: str
    targets: tuple[Target, ...]
    description: str = ""


@dataclass(frozen=True)
class RowDef:
    title: str
    panels: tuple[PanelDef, ...]


@dataclass(frozen=True)
class DashboardDef:
    name: str           # file stem
    uid: str
    title: str
    description: str
    rows: tuple[RowDef, ...]


def rate(metric: str, by: str = "replica", window: str = "$__rate_interval") -> str:
    return f"sum by ({by}) (rate({metric}{SEL}[{window}]))"


def gauge(metric: str, by: str = "replica", agg: str = "max") -> str:
    return f"{agg} by ({by}) ({metric}{SEL})"


def quantile_targets(histogram: str, label: str = "") -> tuple[Target, ...]:
    return tuple(
        Target(f"histogram_quantile({q}, sum by (le) (rate({histogram}_bucket{SEL}[$__rate_interval])))",
               f"{label}p{round(q * 100)}")
        for q in QUANTILES)


def latency_panel(title: str, histogram: str) -> PanelDef:
    return PanelDef(title, "s", quantile_targets(histogram))


SERVING = DashboardDef(
    "serving_overview", "tidal-serving-overview", "tidal / Serving overview",
    "Throughput, latency percentiles and queues of tidal replicas.",
    (
        RowDef("Throughput", (
            PanelDef("Generation throughput", "short",
                     (Target(rate("tidal:generation_tokens_total"), "{{replica}}"),), "Generated tokens per second."),
            PanelDef("Prompt throughput", "short",
                     (Target(rate("tidal:prompt_tokens_total"), "{{replica}}"),),
                     "Prompt tokens per second of requests reaching their first token (prefix-cache hits included)."),
            PanelDef("Finished requests by reason", "reqps",
                     (Target(rate("tidal:request_success_total", "finished_reason"), "{{finished_reason}}"),)),
            PanelDef("Tokens per engine step", "short",
                     (Target(f'{rate("tidal:iteration_tokens_total")} / {rate("tidal:num_steps_total")}',
                             "{{replica}}"),),
                     "Scheduled tokens (prefill chunks + decodes + drafts) per step."),
        )),
        RowDef("Latency", (
            latency_panel("Time to first token", "tidal:time_to_first_token_seconds"),
            latency_panel("Inter-token latency", "tidal:inter_token_latency_seconds"),
            latency_panel("End-to-end request latency", "tidal:e2e_request_latency_seconds"),
            latency_panel("Queue time", "tidal:request_queue_time_seconds"),
        )),
        RowDef("Queue and cache", (
            PanelDef("Running and waiting requests", "short", (
                Target(gauge("tidal:num_requests_running", agg="sum"), "running {{replica}}"),
                Target(gauge("tidal:num_requests_waiting", agg="sum"), "waiting {{replica}}"),
                Target(gauge("tidal:num_requests_queued", agg="sum"), "in the replica {{replica}}"),
            ), "In the replica: admitted and not finished (running, waiting in the engine, or being tokenized)."),
            PanelDef("Admitted tokens, of the limit", "percentunit", (
                Target(f'{gauge("tidal:num_tokens_queued")} / {gauge("tidal:max_queued_tokens")}', "{{replica}}"),),
                     "Prompt plus most output tokens of the requests in the replica, over its admission limit "
                     "(max_queued_tokens); at 1 new requests get a 503 with Retry-After."),
            PanelDef("KV cache usage", "percentunit", (Target(gauge("tidal:kv_cache_usage_perc"), "{{replica}}"),)),
            PanelDef("Prefix cache hit rate", "percentunit", (
                Target(f'{rate("tidal:prefix_cache_hits_total")} / {rate("tidal:prefix_cache_queries_total")}',
                       "{{replica}}"),), "Prompt tokens served from the prefix cache / tokens looked up."),
            PanelDef("Preemptions", "ops", (Target(rate("tidal:num_preemptions_total"), "{{replica}}"),)),
        )),
        RowDef("Structured outputs", (
            PanelDef("Constrained requests by kind", "reqps",
                     (Target(rate("tidal:constrained_requests_total", "kind"), "{{kind}}"),),
                     "Requests with a grammar (json_schema, json_object, a forced tool call) or a logit_bias."),
            PanelDef("Compiled-grammar cache hit rate", "percentunit", (
                Target(f'{rate("tidal:grammar_cache_hits_total")} / ({rate("tidal:grammar_cache_hits_total")}'
                       f' + {rate("tidal:grammar_compile_seconds_count")})', "{{replica}}"),),
                     "Grammar requests served from the cache / all grammar requests (hits + compiles)."),
            latency_panel("Grammar compile time", "tidal:grammar_compile_seconds"),
            PanelDef("Grammar mask time per step", "s", quantile_targets("tidal:grammar_mask_seconds"),
                     "Host time to fill one step's token bitmask; on CUDA it overlaps the forward."),
        )),
    ),
)

KV_ELASTIC = DashboardDef(
    "kv_elastic", "tidal-kv-elastic", "tidal / KV cache and elastic reserve",
    "KV usage and the prefill-activation reserve lent to the KV pool during decode.",
    (
        RowDef("KV cache and reserve", (
            PanelDef("KV cache usage", "percentunit", (Target(gauge("tidal:kv_cache_usage_perc"), "{{replica}}"),)),
            PanelDef("Reserve and lent bytes", "bytes", (
                Target(gauge("tidal:reserve_bytes", agg="sum"), "reserve {{replica}}"),
                Target(gauge("tidal:reserve_lent_bytes", agg="sum"), "lent {{replica}}"),
            )),
            PanelDef("Reserve utilization", "percentunit",
                     (Target(gauge("tidal:reserve_utilization"), "{{replica}}"),),
                     "Fraction of reserve blocks holding live KV."),
            PanelDef("Elastic mode", "short",
                     (Target(gauge("tidal:elastic_mode", "replica, mode"), "{{replica}} {{mode}}"),),
                     "1 marks each replica's current mode."),
        )),
        RowDef("Lend and reclaim", (
            PanelDef("Lend and reclaim events", "ops", (
                Target(rate("tidal:elastic_lend_total"), "lend {{replica}}"),
                Target(rate("tidal:elastic_reclaim_total"), "reclaim {{replica}}"),
            )),
            PanelDef("Lend and reclaim latency", "s",
                     quantile_targets("tidal:elastic_lend_seconds", "lend ")
                     + quantile_targets("tidal:elastic_reclaim_seconds", "reclaim ")),
            PanelDef("Blocks migrated and elastic preemptions", "ops", (
                Target(rate("tidal:blocks_migrated_total"), "migrated {{replica}}"),
                Target(rate("tidal:elastic_preemptions_total"), "preempted {{replica}}"),
            )),
            PanelDef("Step token budget", "short", (Target(gauge("tidal:max_num_batched_tokens"), "{{replica}}"),),
                     "max_num_batched_tokens: the reserve covers one step of this many tokens."),
        )),
    ),
)

SPEC_DECODE = DashboardDef(
    "spec_decode", "tidal-spec-decode", "tidal / Speculative decoding",
    "DominoTree drafts: acceptance rate, accept length and acceptance by tree depth.",
    (
        RowDef("Acceptance", (
            PanelDef("Draft acceptance rate", "percentunit", (Target(
                f'{rate("tidal:spec_decode_num_accepted_tokens_total")}'
                f' / {rate("tidal:spec_decode_num_draft_tokens_total")}', "{{replica}}"),),
                "Accepted draft tokens / proposed draft tokens."),
            PanelDef("Mean accept length", "short", (Target(
                f'1 + {rate("tidal:spec_decode_num_accepted_tokens_total")}'
                f' / {rate("tidal:spec_decode_num_drafts_total")}', "{{replica}}"),),
                "Tokens emitted per verify round: accepted drafts plus the target's own token."),
            PanelDef("Acceptance by position", "percentunit", (Target(
                f'{rate("tidal:spec_decode_num_accepted_tokens_per_pos_total", "position")}'
                f' / on() group_left() sum(rate(tidal:spec_decode_num_drafts_total{SEL}[$__rate_interval]))',
                "position {{position}}"),), "Fraction of rounds whose draft was accepted at this depth."),
            PanelDef("Draft and accepted tokens", "short", (
                Target(rate("tidal:spec_decode_num_draft_tokens_total"), "drafted {{replica}}"),
                Target(rate("tidal:spec_decode_num_accepted_tokens_total"), "accepted {{replica}}"),
            )),
            PanelDef("Constrained rows decoded plainly", "ops",
                     (Target(rate("tidal:spec_decode_constrained_plain_total"), "{{replica}}"),),
                     "Decode rows of requests with a grammar or logit_bias that did not draft where they would "
                     "have (docs/structured_outputs.md)."),
        )),
    ),
)

CONTROLLER = DashboardDef(
    "fleet_controller", "tidal-fleet-controller", "tidal / Fleet controller",
    "Settings the fleet controller chose per replica, its decisions, and the signals it reads.",
    (
        RowDef("Settings", (
            PanelDef("Controller setting per replica", "short",
                     (Target(gauge("tidal:controller_setting", "replica, knob"), "{{replica}} {{knob}}"),)),
            PanelDef("Engine step token budget", "short",
                     (Target(gauge("tidal:max_num_batched_tokens"), "{{replica}}"),),
                     "max_num_batched_tokens as the engine reports it."),
            PanelDef("Decisions by knob and reason", "short", (Target(
                f"sum by (knob, reason) (increase(tidal:controller_decisions_total{SEL}[$__rate_interval]))",
                "{{knob}} {{reason}}"),)),
        )),
        RowDef("Signals", (
            PanelDef("KV cache usage", "percentunit", (Target(gauge("tidal:kv_cache_usage_perc"), "{{replica}}"),)),
            PanelDef("Waiting requests", "short",
                     (Target(gauge("tidal:num_requests_waiting", agg="sum"), "{{replica}}"),)),
            PanelDef("Admissions that waited for KV", "ops",
                     (Target(rate("tidal:num_kv_admission_waits_total"), "{{replica}}"),),
                     "Steps at which the waiting queue's head did not fit in the free KV blocks; with preemptions "
                     "and KV usage, what makes chunk lower the budget."),
            PanelDef("Reserve lent", "bytes", (Target(gauge("tidal:reserve_lent_bytes", agg="sum"), "{{replica}}"),)),
            PanelDef("Reserve given to KV by the budget", "short",
                     (Target(gauge("tidal:reserve_granted_blocks", agg="sum"), "{{replica}}"),),
                     "Reserve blocks made KV for good while max_num_batched_tokens is below the one it was sized for."),
            PanelDef("TTFT p99", "s", (Target(quantile_targets("tidal:time_to_first_token_seconds")[-1].expr,
                                              "p99"),)),
        )),
    ),
)

DASHBOARDS: tuple[DashboardDef, ...] = (SERVING, KV_ELASTIC, SPEC_DECODE, CONTROLLER)


def _label_variable(name: str, label: str, query: str) -> QueryVariable:
    return (QueryVariable(name).label(label).datasource(DATASOURCE).query(query)
            .refresh(VariableRefresh.ON_TIME_RANGE_CHANGED).sort(VariableSort.ALPHABETICAL_ASC)
            .multi(True).include_all(True).all_value(".*")
            .current(VariableOption(selected=True, text=["All"], value=["$__all"])))


def build(d: DashboardDef) -> DashboardBuilder:
    board = (DashboardBuilder(d.title).uid(d.uid).description(d.description).tags(["tidal"])
             .refresh("10s").time("now-30m", "now")
             .with_variable(DatasourceVariable("datasource").label("Data source").type("prometheus"))
             .with_variable(_label_variable("model_name", "Model",
                                            "label_values(tidal:num_requests_running, model_name)"))
             .with_variable(_label_variable(
                 "replica", "Replica", 'label_values(tidal:num_requests_running{model_name=~"$model_name"}, replica)')))
    panel_id = 0
    for row in d.rows:
        panel_id += 1
        board = board.with_row(Row(row.title).id(panel_id))
        for p in row.panels:
            panel_id += 1
            panel = (TimeseriesPanel().id(panel_id).title(p.title).description(p.description)
                     .datasource(DATASOURCE).unit(p.unit))
            for i, t in enumerate(p.targets):
                panel = panel.with_target(Dataquery().expr(t.expr).legend_format(t.legend).ref_id(chr(ord("A") + i)))
            board = board.with_panel(panel)
    return board


def render(d: DashboardDef) -> str:
    return JSONEncoder(sort_keys=True, indent=2).encode(build(d).build()) + "\n"


def main(out_dir: Path = OUT_DIR) -> list[Path]:
    written = []
    for d in DASHBOARDS:
        path = out_dir / f"{d.name}.json"
        path.write_text(render(d))
        written.append(path)
    return written


if __name__ == "__main__":
    for p in main(Path(sys.argv[1]) if len(sys.argv) > 1 else OUT_DIR):
        print(p)
