"""bench.speculative's report: what one run measured (`Run`), the JSON report assembled from every engine's runs
(speed ratios, tau, acceptance by position, agreement with plain decoding, the tree builder sections) and the
summary table printed at the end. It measures nothing and imports nothing of bench.speculative: the runner hands
it the settings (`ReportConfig`) and the data."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Protocol

import torch

from replicas.loaders.default_model import default_model_path


class ReportConfig(Protocol):
    """The benchmark settings the report reads (bench.speculative.BenchConfig has them)."""
    model: Optional[str]
    modes: tuple[str, ...]
    batches: tuple[int, ...]
    temps: tuple[float, ...]
    seed: int
    max_tokens: int
    ignore_eos: bool
    gpu_memory_utilization: float
    spec_budget: int
    tree_rounds: int
    force_budget: Optional[int]


@dataclass
class Run:
    """One (engine, temperature, batch) measurement; the spec_* fields are the engine counters' increase."""
    outputs: list[list[int]]
    seconds: float
    decode_tok_s_per_request: float
    steps: int = 0
    graph_steps: int = 0                      # steps whose forward replayed a CUDA graph (decode or verify)
    verify_graph_steps: int = 0               # ... a verify graph
    drafts: int = 0
    draft_tokens: int = 0
    accepted: int = 0
    by_position: list[int] = field(default_factory=list)
    tokens: Optional[int] = None              # generated tokens over every pass (None: the outputs')
    passes: int = 1                           # times the prompts were run (bench.speculative --min-cell-seconds)
    repeats: list[dict] = field(default_factory=list)   # each repeat's tok/s, seconds, tokens and passes (merged)

    @property
    def output_tokens(self) -> int:
        return self.tokens if self.tokens is not None else sum(map(len, self.outputs))

    @property
    def tok_s(self) -> float:
        return self.output_tokens / self.seconds

    @staticmethod
    def merge(runs: list["Run"]) -> "Run":
        """Repeats of one cell as one run (tokens and seconds summed, the first repeat's outputs), each kept."""
        first = runs[0]
        depth = max(len(r.by_position) for r in runs)
        return Run(first.outputs, sum(r.seconds for r in runs),
                   sum(r.decode_tok_s_per_request for r in runs) / len(runs),
                   *(sum(getattr(r, k) for r in runs) for k in ("steps", "graph_steps", "verify_graph_steps",
                                                                  "drafts", "draft_tokens", "accepted")),
                   [sum(r.by_position[d] for r in runs if d < len(r.by_position)) for d in range(depth)],
                   tokens=sum(r.output_tokens for r in runs), passes=sum(r.passes for r in runs),
                   repeats=[dict(tok_s=r.tok_s, seconds=r.seconds, output_tokens=r.output_tokens, passes=r.passes)
                            for r in runs])

    def summary(self) -> dict:
        out = dict(tok_s=self.tok_s, output_tokens=self.output_tokens, requests=len(self.outputs),
                   seconds=self.seconds, passes=self.passes, repeats=self.repeats,
                   decode_tok_s_per_request=self.decode_tok_s_per_request,
                   steps=self.steps, graph_steps=self.graph_steps, verify_graph_steps=self.verify_graph_steps)
        if self.drafts:
            out.update(tau=1 + self.accepted / self.drafts, rounds=self.drafts, draft_tokens=self.draft_tokens,
                       accepted_tokens=self.accepted)
        return out


def temp_key(t: float) -> str:
    return f"t{t:g}"


def batch_key(b: int) -> str:
    return "speedup_b1" if b == 1 else f"throughput_ratio_b{b}"


def mode_report(cfg: ReportConfig, runs: dict, plain: dict, greedy: Optional[dict] = None) -> dict:
    """Per temperature: tau and acceptance per position over all batches, speed ratios against plain decoding,
    agreement with plain decoding (greedy: batch -> near-tie verdicts at T=0, from `greedy_agreement`)."""
    report = {}
    for t in cfg.temps:
        mine = [runs[(t, b)] for b in cfg.batches]
        drafts = sum(r.drafts for r in mine)
        depth = max((len(r.by_position) for r in mine), default=0)
        by_pos = [sum(r.by_position[d] for r in mine if d < len(r.by_position)) for d in range(depth)]
        entry = dict(tau=1 + sum(r.accepted for r in mine) / drafts if drafts else None)
        if not drafts:
            entry["tau_null_reason"] = "no verify round ran: the budget was 0 at every batch size run"
        for b in cfg.batches:
            entry[batch_key(b)] = runs[(t, b)].tok_s / plain[(t, b)].tok_s
        if 1 in cfg.batches:
            p = plain[(t, 1)].decode_tok_s_per_request
            entry["decode_speedup_b1"] = runs[(t, 1)].decode_tok_s_per_request / p if p else None
        entry["accept_rate_by_position"] = [c / drafts for c in by_pos] if drafts else []
        exact = {f"b{b}": _same_share(runs[(t, b)].outputs, plain[(t, b)].outputs) for b in cfg.batches}
        entry["outputs_identical_plain"] = exact
        if t == 0 and greedy is not None:
            entry["outputs_equal_plain"] = {f"b{b}": greedy[b]["share"] for b in cfg.batches}
            entry["greedy_flips"] = {f"b{b}": greedy[b]["flips"] for b in cfg.batches}
        else:
            entry["outputs_equal_plain"] = exact
        entry["runs"] = {f"b{b}": runs[(t, b)].summary() for b in cfg.batches}
        report[temp_key(t)] = entry
    return report


def _same_share(got: list[list[int]], want: list[list[int]]) -> float:
    return sum(a == w for a, w in zip(got, want)) / len(want)


def build_report(cfg: ReportConfig, results: dict, greedy: dict, drafter: Optional[str], tie: float, cuda: bool,
                 prompts: dict, warm_requests: int, identity: dict) -> dict:
    """The JSON report but its wall_seconds and config: the set-up, each engine's `measure` result, every mode's
    `mode_report` against plain decoding, and the tree sections (identity: the builder identity check's result,
    or `{"skipped": reason}`)."""
    plain = results["plain"]["runs"]
    report: dict = dict(
        device=torch.cuda.get_device_name() if cuda else "cpu", torch=torch.__version__,
        model=cfg.model or default_model_path(), drafter=drafter,
        seed=cfg.seed, warmup=dict(requests_per_temperature=warm_requests, max_tokens=min(cfg.max_tokens, 32)),
        prompts=prompts,
        max_tokens=cfg.max_tokens, ignore_eos=cfg.ignore_eos, batches=list(cfg.batches),
        temperatures={temp_key(t): t for t in cfg.temps}, near_tie_logit_gap=tie,
        engine=dict(gpu_memory_utilization=cfg.gpu_memory_utilization, enable_prefix_caching=False,
                    max_num_seqs=max(cfg.batches), spec_budget=cfg.spec_budget, force_budget=cfg.force_budget,
                    plain=results["plain"]["engine"],
                    speculative={m: results[m]["engine"] for m in cfg.modes},
                    note="runs[*].graph_steps counts steps that replayed a CUDA graph (decode or verify), "
                         "verify_graph_steps those that verified draft trees; policy: what each mode's budget "
                         "policy measured at start-up and why it chose each budget"),
        plain={temp_key(t): {f"b{b}": plain[(t, b)].summary() for b in cfg.batches} for t in cfg.temps})
    for mode in cfg.modes:       # start-up GEMM choices are timed: engines may decode with different kernels
        report["engine"]["speculative"][mode]["same_gemm_choices_as_plain"] = \
            results[mode]["engine"]["gemm_table"] == results["plain"]["engine"]["gemm_table"]
        report[mode] = mode_report(cfg, results[mode]["runs"], plain, greedy.get(mode))
        if "forced_runs" in results[mode]:
            report[mode]["forced"] = dict(budget=cfg.force_budget, note="budget forced at every batch size, "
                                          "bypassing the policy", **mode_report(cfg, results[mode]["forced_runs"],
                                                                               plain, greedy.get(f"{mode}@forced")))
            report[mode]["forced"]["round"] = results[mode].get("round")
            report[mode]["forced"]["round_breakdown"] = results[mode].get("round_breakdown")
    report.update(mode_summaries(report))
    report.update(tree_sections(cfg, {m: results[m].get("tree_build") for m in cfg.modes}, identity))
    return report


MODES = ("dominotree", "chain", "ddtree")        # the report's mode sections, in order of preference


def mode_summaries(report: dict) -> dict:
    """The top-level keys derived from the report's mode sections (measured now or kept by --update)."""
    return {"round_overhead_ms": round_overhead(report), "outputs_equal_plain": outputs_equal_plain(report)}


def round_overhead(report: dict) -> Optional[dict]:
    """b<batch> -> what a forced round costs beyond draft + verify (bench/round_cost.py), ms, from the report's
    mode sections (those measured now and those kept by --update): DominoTree's where it is there, else chain's,
    else DDTree's; the larger over temperatures (null where a temperature saw too few rounds). None without a
    forced run."""
    rounds = {m: report[m]["forced"]["round"] for m in MODES
              if (report.get(m) or {}).get("forced", {}).get("round")}
    if not rounds:
        return None
    by_temp = next(iter(rounds.values()))
    batches = sorted({b for per_batch in by_temp.values() for b in per_batch}, key=lambda k: int(k[1:]))
    worst = {}
    for b in batches:
        seen = [per_batch[b]["overhead_ms"] for per_batch in by_temp.values() if b in per_batch]
        worst[b] = None if None in seen else max(seen)
    return worst


def outputs_equal_plain(report: dict) -> dict:
    """mode -> the smallest share of T=0 requests equal to plain decoding (near-tie rule) over the batch sizes,
    from the forced run where there is one (the policy may not speculate at all), for every mode section in the
    report (measured now or kept by --update); null for a mode whose T=0 was not run."""
    out = {}
    for mode in MODES:
        section = report.get(mode)
        if not section:
            continue
        t0 = (section.get("forced") or section).get("t0")
        out[mode] = min(t0["outputs_equal_plain"].values(), default=None) if t0 else None
    return out


def tree_sections(cfg: ReportConfig, builds: dict[str, Optional[dict]], identity: dict) -> dict:
    """tree_build_ms_b16 (DominoTree's builder if measured) and the builder identity count; null when skipped."""
    out: dict = dict(tree_build_ms_b16=None, tree_build=dict(skipped="needs CUDA"),
                     builder_bit_identical_cases=identity.get("identical"), builder_identity=identity)
    builds = {m: b for m, b in builds.items() if b is not None}
    if builds:
        mode = "dominotree" if "dominotree" in builds else next(iter(builds))
        out["tree_build_ms_b16"] = builds[mode]["eager_ms"]
        out["tree_build"] = dict(
            mode=mode, budget=cfg.spec_budget, batch=1, rounds=cfg.tree_rounds,
            timer="CUDA events over back-to-back rounds after 20 warm-up rounds",
            builder="prepare_round + build_frontier, eager: the engine's path (speculative/speculator.py); "
                    "graph_ms: GraphTreeBuilder replaying the same (the engine does not use it yet)",
            by_mode=builds)
    return out


def format_table(report: dict, cfg: ReportConfig) -> str:
    cols = ["tau"] + [batch_key(b) for b in cfg.batches]
    heads = ["tau"] + [("speedup_b1" if b == 1 else f"ratio_b{b}") for b in cfg.batches]
    lines = [f"{'mode':14s}{'temp':6s}" + "".join(f"{h:>12s}" for h in heads) + f"{'equal_plain':>14s}  budgets"]
    for mode in cfg.modes:
        budgets = report["engine"]["speculative"][mode].get("budget_by_batch", {})
        rows = [(mode, report[mode], "/".join(str(v) for v in budgets.values()))]
        if "forced" in report[mode]:
            rows.append((f"{mode}@{cfg.force_budget}", report[mode]["forced"], "forced"))
        for name, rep, note in rows:
            for t in cfg.temps:
                row = rep[temp_key(t)]
                equal = min(row["outputs_equal_plain"].values(), default=None)
                lines.append(f"{name:14s}{temp_key(t):6s}" + "".join(
                    f"{row[c]:12.2f}" if row.get(c) is not None else f"{'-':>12s}" for c in cols)
                    + (f"{equal:14.2f}" if equal is not None else f"{'-':>14s}") + f"  {note}")
    return "\n".join(lines)
