"""The seed's controlled experiment (GPU): does lending the prefill reserve pay, or does the step budget?

    python -m bench.seed_experiment [--shape llama3-8b] [--duration-s 30] [--policies static32768,...]
                                    [--learn-s 0] [--repeats 2] [--max-seconds S] [--resume [--rerun auto]]
                                    [--out bench/results/seed_experiment.json]

One engine of the shape (random bf16 weights, `load_format="dummy"`, elastic KV built at the high budget, prefix
caching off: every policy replays the same prompts, which a cache would serve to the later ones) serves one
arrival trace per policy: a steady decode load (open-loop Poisson arrivals of medium prompts with long outputs)
and long prompts (8k to 32k tokens) injected at a fixed rate; ignore_eos, seed 0. Policies, each from the same
start (high budget, lending off, nothing granted):

- `static<B>`: the budget fixed at B, lending off (a budget below the sized one gives the reserve blocks its steps
  no longer need to the KV pool, as the chunk knob does at run time);
- `elastic`, `chunk`, `auto`: the fleet controller's policy (cluster/controller_policies.py) deciding every
  `--interval-s` from the engine's own stats and finished requests, applied through `LLMEngine.reconfigure`,
  as a replica applies them.

Every policy's trace starts with `--learn-s` seconds of arrivals that are served but not counted: the time a
controller policy spends learning the traffic (auto's round of trials) is then left out of its steady-state
figures, as it is for the static policies, whose first seconds are the same arrivals. `goodput_cold` counts the
whole trace, learning included, beside it. Per policy (over the counted requests, those arriving after the
learning prefix): TTFT (all requests, and the long prompts alone) and decode inter-token gaps (every gap of every
decode-load request, pooled) as median and p99; goodput = requests that met both SLOs (TTFT, and mean
inter-token latency as the controller judges it) per counted second of the trace; decode_tok_s = output tokens per
second of wall time until the last request finished. The SLOs are --ttft-slo-ms and --itl-slo-ms when given;
otherwise --slo-scale times the medians the first policy (the sized budget, static<high>) reached on the trace:
its per-request TTFT and mean inter-token latency. Every policy, the first included, is judged by the same
SLOs, which the controller's policies also steer by; a fixed SLO that no policy meets on a heavy trace would
rank them by a handful of requests. KV: the blocks lending adds (the reserve) against the blocks
the low budget grants. Requests still running `--drain-s` after the trace ends are cut and count as missed.
Each run also keeps `rounds`, the engine at every controller round (budget, lending, KV pool and usage, requests
running and waiting, preemptions, admission waits, tokens generated): where a policy's backlog began.

Every policy runs `--repeats` times, interleaved (repeat r starts from the r-th policy); figures are means over
the runs, each run kept. `--max-seconds` ends a call before a run that would not fit, `--resume` continues the
result at `--out` (same settings), so the repeats of a long trace spread over several calls; `--rerun` with it
measures the policies it names again (their code changed), keeping the others' runs and the SLOs.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time
from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch

from bench.provenance import provenance
from bench.shapes import SHAPES, write_shape
from cluster.controller import Controller
from cluster.controller_policies import ChunkPolicy, ControllerConfig, ReplicaView
from cluster.recent_requests import RecentRequests
from replicas import SamplingParams
from replicas.config import EngineConfig
from replicas.device import resolve_device
from replicas.engine import LLMEngine

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# a run's `rounds`: the engine at each controller round (counters since the run's start), every policy alike
AUTO_VERDICT = ("scores", "loads", "queue")     # what auto's state says of each arm after a round of trials
ROUND_COLUMNS = ("t_s", "max_num_batched_tokens", "elastic", "kv_blocks_total", "kv_usage", "running", "waiting",
                 "preemptions", "kv_admission_waits", "generation_tokens")


@dataclass(frozen=True)
class Arrival:
    at_s: float
    request_id: str
    kind: str               # "decode" | "long"
    prompt_tokens: int
    max_tokens: int


def make_trace(args) -> list[Arrival]:
    """Poisson decode arrivals and long prompts every `long_every_s`, over `learn_s` + `duration_s` (seeded)."""
    rng = random.Random(args.seed)
    span = args.learn_s + args.duration_s
    out, t, n = [], 0.0, 0
    lo, hi = args.decode_prompt_tokens
    olo, ohi = args.decode_output_tokens
    while True:
        t += rng.expovariate(args.decode_rate)
        if t >= span:
            break
        out.append(Arrival(t, f"d{n}", "decode", rng.randint(lo, hi), rng.randint(olo, ohi)))
        n += 1
    llo, lhi = args.long_tokens
    t = args.long_every_s / 2
    while t < span:
        out.append(Arrival(t, f"l{n}", "long", rng.randint(llo, lhi), args.long_output_tokens))
        n += 1
        t += args.long_every_s
    return sorted(out, key=lambda a: a.at_s)


class EngineFleet:
    """One in-process engine as the controller's fleet (what a replica's describe/apply do, without Ray)."""

    def __init__(self, engine: LLMEngine, budget_limit: int):
        self.engine, self.budget_limit = engine, budget_limit
        self.recent = RecentRequests()
        self.state: dict = {}

    def views(self) -> list[ReplicaView]:
        return [ReplicaView("seed", self.engine.get_stats(), self.budget_limit, self.engine.elastic is not None,
                            self.recent.since(time.time() - 120), self.state)]

    def apply(self, payload: dict[str, dict]) -> list:
        mine = payload["seed"]
        self.state = mine["state"]
        for knob, value, _ in mine["decisions"]:
            self.engine.reconfigure(**{knob: value})
        return mine["decisions"]


def quantiles_ms(values: list[float]) -> dict:
    if not values:
        return {"median": None, "p99": None, "n": 0}
    a = np.asarray(values) * 1e3
    return {"median": round(float(np.median(a)), 2), "p99": round(float(np.percentile(a, 99)), 2), "n": len(a)}


def slo_met(requests: list[tuple[float, float]], ttft_slo_ms: float, itl_slo_ms: float) -> int:
    """How many (TTFT s, mean inter-token latency s) requests met both SLOs."""
    return sum(1 for ttft, itl in requests if ttft * 1e3 <= ttft_slo_ms and itl * 1e3 <= itl_slo_ms)


def calibrated_slos(requests: list[tuple[float, float]], scale: float) -> tuple[float, float]:
    """(TTFT, ITL) SLOs in ms: `scale` times the medians of a reference run's requests."""
    if not requests:
        raise SystemExit("the first policy's run finished no request: no SLOs to set; pass --ttft-slo-ms/--itl-slo-ms")
    return (round(scale * statistics.median(t for t, _ in requests) * 1e3, 1),
            round(scale * statistics.median(i for _, i in requests) * 1e3, 2))


def run_policy(engine: LLMEngine, policy: str, trace: list[Arrival], args, vocab: int) -> dict:
    high, low = args.budgets
    static_budget = int(policy[len("static"):]) if policy.startswith("static") else high
    engine.reconfigure(max_num_batched_tokens=high, elastic="off")
    engine.reconfigure(max_num_batched_tokens=static_budget)
    engine.finished_timings.clear()
    fleet = EngineFleet(engine, high)
    controller = None
    if not policy.startswith("static"):
        window_s = 4 * args.trial_cycles * args.trial_rounds * args.interval_s       # a round of trials
        controller = Controller(fleet, ControllerConfig(
            policy=policy, interval_s=args.interval_s, ttft_slo_ms=args.ttft_slo_ms, itl_slo_ms=args.itl_slo_ms,
            min_budget=low, min_requests=args.min_requests, window_s=window_s, cooldown_rounds=1,
            trial_rounds=args.trial_rounds, trial_cycles=args.trial_cycles, exploit_rounds=1 << 20))
    rng = np.random.default_rng(args.seed)
    prompts = {a.request_id: rng.integers(3, vocab - 1, a.prompt_tokens).tolist() for a in trace}
    kinds = {a.request_id: a.kind for a in trace}
    counted = {a.request_id for a in trace if a.at_s >= args.learn_s}
    before = engine.get_stats()
    timings, decisions, budgets, kv_usage, auto_timeline, auto_choices, rounds = [], [], [], [], [], [], []
    start = time.monotonic()
    next_tick, i = start + args.interval_s, 0
    while True:
        now = time.monotonic()
        while i < len(trace) and start + trace[i].at_s <= now:
            a = trace[i]
            engine.add_request(a.request_id, prompts[a.request_id],
                               SamplingParams(temperature=0.0, max_tokens=a.max_tokens, ignore_eos=True,
                                              detokenize=False), arrival_time=start + a.at_s, stream=False)
            i += 1
        if now >= next_tick:
            s = engine.get_stats()
            rounds.append([round(now - start, 2), s.max_num_batched_tokens, s.elastic_mode, s.kv_blocks_total,
                           round(s.kv_cache_usage, 4), s.num_running, s.num_waiting, s.preemptions - before.preemptions,
                           s.kv_admission_waits - before.kv_admission_waits,
                           s.generation_tokens - before.generation_tokens])
            if controller is not None:
                decided = controller.step(time.time())
                decisions += [(round(now - start, 2), d.knob, d.value, d.reason)
                              for ds in decided.values() for d in ds]
                arm_phase = [fleet.state.get("arm"), fleet.state.get("phase")]
                if policy == "auto" and (not auto_timeline or auto_timeline[-1][1:] != arm_phase):
                    if arm_phase[1] == "exploit" and auto_timeline and auto_timeline[-1][2] == "judge":
                        auto_choices.append({"t_s": round(now - start, 2), "arm": arm_phase[0],
                                             **{k: fleet.state.get(k) for k in AUTO_VERDICT}})
                    auto_timeline.append([round(now - start, 2), *arm_phase])
            next_tick = now + args.interval_s
        if now - start > args.learn_s + args.duration_s + args.drain_s:
            break
        if engine.has_unfinished:
            engine.step()
            s = engine.get_stats()
            budgets.append(s.max_num_batched_tokens)
            kv_usage.append(s.kv_cache_usage)
        elif i < len(trace):
            time.sleep(min(0.01, max(0.0, start + trace[i].at_s - time.monotonic())))
        else:
            break
        done = engine.drain_finished_timings()
        fleet.recent.add(done)
        timings += done
    cut = list(engine.requests)
    for rid in cut:
        engine.abort(rid)
    while engine.has_unfinished:
        engine.step()
    engine.drain_finished_timings()
    wall = time.monotonic() - start
    after = engine.get_stats()
    served = [t for t in timings if t.finish_reason != "abort"]
    timings = [t for t in served if t.request_id in counted]
    learning = [t for t in served if t.request_id not in counted]
    ttft = [t.first_token_time - t.arrival_time for t in timings]
    ttft_long = [t.first_token_time - t.arrival_time for t in timings if kinds[t.request_id] == "long"]
    gaps = [g for t in timings if kinds[t.request_id] == "decode" for g in t.inter_token_latencies]

    def latencies(done: list) -> list[tuple[float, float]]:
        return [(t.first_token_time - t.arrival_time,
                 (t.finish_time - t.first_token_time) / max(1, t.num_generation_tokens - 1)) for t in done]
    out_tokens = sum(t.num_generation_tokens for t in served)
    last = max((t.finish_time for t in served), default=start + 1e-9) - start
    return {"policy": policy, "requests": len(counted), "requests_learning": len(trace) - len(counted),
            "finished": len(timings), "cut": len(cut),
            "request_latencies_s": latencies(timings), "learning_latencies_s": latencies(learning),
            "request_arrivals_s": [round(t.arrival_time - start, 3) for t in timings],   # s into the trace, same order
            "learning_arrivals_s": [round(t.arrival_time - start, 3) for t in learning],
            "decode_tok_s": round(out_tokens / last, 1),
            "ttft_ms": quantiles_ms(ttft),
            "ttft_long_ms": quantiles_ms(ttft_long), "decode_itl_ms": quantiles_ms(gaps),
            "kv_usage_max": round(max(kv_usage, default=0.0), 4),
            "preemptions": after.preemptions - before.preemptions,
            "lends": after.lend_total - before.lend_total, "reclaims": after.reclaim_total - before.reclaim_total,
            "lends_refused": after.lend_refused - before.lend_refused,
            "budget_final": after.max_num_batched_tokens, "budget_median": statistics.median(budgets or [0]),
            "elastic_final": after.elastic_mode, "granted_final": after.reserve_granted_blocks,
            "decisions": decisions,
            "auto_state": {k: fleet.state.get(k) for k in ("arm", "phase", *AUTO_VERDICT)}
            if policy == "auto" else None,
            "auto_timeline": auto_timeline if policy == "auto" else None,   # [t, arm, phase] on change
            "auto_choices": auto_choices if policy == "auto" else None,       # each round of trials' verdict
            "chunk_evidence": ChunkPolicy.evidence_report(fleet.state) if policy in ("chunk", "auto") else None,
            "rounds": rounds, "rounds_columns": ROUND_COLUMNS,
            "wall_s": round(wall, 1)}


def build_engine(args) -> LLMEngine:
    high = args.budgets[0]
    overrides = dict(max_position_embeddings=131072)
    if args.num_layers:
        overrides["num_hidden_layers"] = args.num_layers
    folder = write_shape(args.shape, 1, **overrides)
    flat = dict(model=folder, load_format="dummy", seed=args.seed, elastic="elastic", max_num_seqs=args.max_num_seqs,
                max_num_batched_tokens=high, max_model_len=max(high, args.long_tokens[1] + 512),
                gpu_memory_utilization=args.gpu_memory_utilization, device=args.device,
                enable_prefix_caching=False)
    if args.device == "cpu":
        flat.update(num_kv_blocks=args.num_kv_blocks, reserve_blocks=args.reserve_blocks, dtype="float32")
    return LLMEngine(EngineConfig.from_flat(**flat))


def warm_up(engine: LLMEngine, args, vocab: int, trace: list[Arrival]) -> None:
    """A long prompt at each budget and a decode batch, then the trace's first `--warmup-s` seconds at the high
    budget (not counted): graphs, kernels and the allocator reach the state the trace keeps them in, so the
    first policy measured does not pay for what the others find ready."""
    rng = np.random.default_rng(1)
    for budget in args.budgets:
        engine.reconfigure(max_num_batched_tokens=budget)
        engine.add_request(f"warm{budget}", rng.integers(3, vocab - 1, args.long_tokens[1]).tolist(),
                           SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, detokenize=False),
                           stream=False)
        for k in range(min(8, args.max_num_seqs)):
            engine.add_request(f"warm{budget}-{k}", rng.integers(3, vocab - 1, 64).tolist(),
                               SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, detokenize=False),
                               stream=False)
        while engine.has_unfinished:
            engine.step()
    engine.drain_finished_timings()
    if args.warmup_s > 0:
        prefix = [a for a in trace if a.at_s < args.warmup_s]
        short = argparse.Namespace(**{**vars(args), "duration_s": args.warmup_s, "drain_s": 0.0, "learn_s": 0.0})
        run_policy(engine, f"static{args.budgets[0]}", prefix, short, vocab)


def summarize(rows: dict[str, list[dict]], engine: LLMEngine, args) -> dict:
    """The trace's figures over every repeat: each policy's goodput and decode throughput as the mean of its runs
    (and each run's), auto against the better static both from the means and per repeat."""
    high, low = args.budgets
    bm, kv = engine.block_manager, engine.runner.kv
    out = {}
    for b in (low, high):
        runs = rows.get(f"static{b}")
        if runs:
            for key, field, q in (("ttft_median_ms", "ttft_ms", "median"), ("ttft_p99_ms", "ttft_ms", "p99"),
                                  ("itl_median_ms", "decode_itl_ms", "median"), ("itl_p99_ms", "decode_itl_ms", "p99")):
                values = [r[field][q] for r in runs if r[field][q] is not None]
                out[f"{key}_chunk{b}"] = round(statistics.median(values), 2) if values else None
    out["kv_gain_elastic_blocks"] = kv.reserve_blocks_built
    out["kv_gain_lower_chunk_blocks"] = kv.grant_target(low, high)
    out["kv_blocks_base"] = bm.num_base - sum(kv.grants)
    out["reserve_fraction"] = round(kv.reserve_blocks_built / max(1, bm.num_base - sum(kv.grants)), 5)
    out["policies"] = {name: {"goodput": round(statistics.mean(r["goodput"] for r in runs), 4),
                              "goodput_repeats": [r["goodput"] for r in runs],
                              "goodput_cold": round(statistics.mean(r["goodput_cold"] for r in runs), 4),
                              "goodput_cold_repeats": [r["goodput_cold"] for r in runs],
                              "decode_tok_s": round(statistics.mean(r["decode_tok_s"] for r in runs), 1),
                              "decode_tok_s_repeats": [r["decode_tok_s"] for r in runs]}
                       for name, runs in rows.items() if runs}
    statics = [p for p in (f"static{high}", f"static{low}") if rows.get(p)]
    if rows.get("auto") and statics:
        best = max(out["policies"][p]["goodput"] for p in statics)
        out["auto_goodput_vs_best_static"] = round(out["policies"]["auto"]["goodput"] / max(best, 1e-9), 4)
        paired = [rows["auto"][r]["goodput"] / max(max(rows[p][r]["goodput"] for p in statics), 1e-9)
                  for r in range(min(len(rows[p]) for p in ["auto", *statics]))]
        out["auto_goodput_vs_best_static_repeats"] = [round(x, 4) for x in paired]
        best_cold = max(out["policies"][p]["goodput_cold"] for p in statics)
        auto_cold = out["policies"]["auto"]["goodput_cold"]
        out["auto_goodput_cold_vs_best_static"] = round(auto_cold / max(best_cold, 1e-9), 4)
        out["auto_chose"] = [r.get("auto_choices") or [r["auto_state"]] for r in rows["auto"]]   # per run
    out["repeats"] = min((len(runs) for runs in rows.values()), default=0)
    out["runs"] = rows
    return out


def result_runs(result: dict) -> dict[str, list[dict]]:
    """Each policy's runs, one per repeat (a result written before repeats held one run per policy)."""
    return {name: runs if isinstance(runs, list) else [runs] for name, runs in result["tp1"]["runs"].items()}


def plot(result: dict, path: str) -> None:
    """The figure docs/controller.md shows, from a result JSON: each policy's TTFT distribution, its goodput and
    decode throughput, the step budget each controller policy set over the trace, and (runs that kept `rounds`)
    the prompts waiting at each round: where a backlog began."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    repeats = result_runs(result)
    runs = {name: rs[0] for name, rs in repeats.items()}        # distributions and budgets: the first repeat's
    color = {name: f"C{i}" for i, name in enumerate(runs)}
    queued = {name: r for name, r in runs.items() if r.get("rounds")}
    fig, axes = plt.subplots(1, 3 + bool(queued), figsize=(15 + 5 * bool(queued), 4.6))
    cdf, bars, budget = axes[:3]
    for name, r in runs.items():
        ttft = sorted(t for t, _ in r["request_latencies_s"])
        cdf.step(ttft, np.arange(1, len(ttft) + 1) / r["requests"], where="post", label=name, color=color[name])
    cdf.set(xscale="log", xlabel="TTFT (s)", ylabel="share of the trace's counted requests", title="TTFT")
    cdf.axvline(result["slo"]["ttft_ms"] / 1e3, color="grey", ls=":", label="TTFT SLO")
    cdf.legend(fontsize=8)
    names = list(runs)
    x = np.arange(len(names))
    def mean_and_span(key: str) -> tuple[list[float], np.ndarray]:
        values = [[r[key] for r in repeats[n]] for n in names]
        means = [float(np.mean(v)) for v in values]
        return means, np.array([[m - min(v) for m, v in zip(means, values)], [max(v) - m for m, v in zip(means, values)]])
    goodput, goodput_span = mean_and_span("goodput")
    decode, decode_span = mean_and_span("decode_tok_s")
    bars.bar(x - 0.2, goodput, 0.4, yerr=goodput_span, capsize=3, color=[color[n] for n in names])
    tok = bars.twinx()
    tok.bar(x + 0.2, decode, 0.4, yerr=decode_span, capsize=3, color=[color[n] for n in names], alpha=0.4,
            hatch="//")
    count = min(len(v) for v in repeats.values())
    bars.set(xticks=x, ylabel="goodput: requests meeting both SLOs per s (solid)",
             title=f"goodput (solid), decode tok/s (hatched): mean of {count} run{'s' * (count > 1)}"
                   + (", bars min to max" if count > 1 else ""))
    bars.set_xticklabels(names, rotation=20, fontsize=8)
    tok.set_ylabel("decode tok/s (hatched)")
    high = max(r["budget_final"] for r in runs.values())          # every run starts at the sized budget
    for name, r in runs.items():
        if name.startswith("static"):
            continue
        steps = [(0.0, high)] + [(t, v) for t, knob, v, _ in r["decisions"]
                                                       if knob == "max_num_batched_tokens"]
        steps.append((r["wall_s"], steps[-1][1]))
        budget.step([t for t, _ in steps], [v for _, v in steps], where="post", label=name, color=color[name])
        lends = [t for t, knob, v, _ in r["decisions"] if knob == "elastic" and v != "off"]
        budget.scatter(lends, [steps[0][1]] * len(lends), marker="^", s=40, color=color[name])
    learn_s = result.get("trace", {}).get("learn_s", 0.0)
    if learn_s:
        budget.axvline(learn_s, color="grey", ls=":", label="counted from")
    budget.set(yscale="log", xlabel="time into the trace (s)", ylabel="max_num_batched_tokens",
               title="budget set by the controller (^: lending on)")
    budget.legend(fontsize=8)
    if queued:
        queue = axes[3]
        for name, r in queued.items():
            t, waiting = (r["rounds_columns"].index(c) for c in ("t_s", "waiting"))
            queue.plot([x[t] for x in r["rounds"]], [x[waiting] for x in r["rounds"]], label=name, color=color[name])
        if learn_s:
            queue.axvline(learn_s, color="grey", ls=":")
        queue.set(xlabel="time into the trace (s)", ylabel="requests waiting", title="queue at each round")
        queue.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


RUN_ONLY_FLAGS = ("out", "plot", "resume", "rerun", "max_seconds", "repeats")   # not what a run measures


def start_or_resume(args, argv: list[str], config: dict) -> tuple[dict, dict[str, list[dict]]]:
    """(result, runs so far by policy): a new result, or with --resume the one at --out, whose settings must be
    these (its SLOs then judge the new runs too)."""
    this_call = provenance(
        "bench.seed_experiment", argv, args.device, args.seed,
        warm_up=f"one long prompt at each budget and 8 short requests, then the trace's first {args.warmup_s} s at "
                f"the high budget; not counted (in every call)",
        counted=f"every request arriving after the first {args.learn_s} s of the trace (goodput_cold: every request); "
                "cut requests count as missed", torch=torch.__version__)
    if not (args.resume and os.path.exists(args.out)):
        result = {"provenance": this_call, "config": config, "tp2_status": "not run: no two-GPU machine was lent"}
        if args.ttft_slo_ms is not None:
            result["slo"] = {"ttft_ms": args.ttft_slo_ms, "itl_ms": args.itl_slo_ms, "set_by": "given"}
        return result, {}
    with open(args.out) as f:
        result = json.load(f)
    if result.get("config") != json.loads(json.dumps(config)):
        raise SystemExit(f"--resume: {args.out} was run with other settings; give the same flags or a new --out")
    if "slo" in result:
        args.ttft_slo_ms, args.itl_slo_ms = result["slo"]["ttft_ms"], result["slo"]["itl_ms"]
    result.setdefault("resumed_by", []).append(this_call)
    runs = result_runs(result) if "tp1" in result else {}
    for policy in args.rerun:                    # measured again: their earlier runs are dropped, the others stand
        runs.pop(policy, None)
    return result, runs


def main(argv: Optional[list[str]] = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="llama3-8b", choices=sorted(SHAPES))
    ap.add_argument("--device", default=resolve_device().type, choices=("cuda", "cpu"))
    ap.add_argument("--budgets", default="32768,8192", help="the high (sized) and the low step budget")
    ap.add_argument("--policies", default=None, help="default: static<high>,static<low>,elastic,chunk,auto")
    ap.add_argument("--duration-s", type=float, default=25.0, help="arrivals per policy run")
    ap.add_argument("--learn-s", type=float, default=0.0,
                    help="arrivals before the counted --duration-s, served but not counted (the controller's learning)")
    ap.add_argument("--drain-s", type=float, default=10.0, help="after the arrivals, before cutting what is left")
    ap.add_argument("--warmup-s", type=float, default=10.0,
                    help="the trace's first seconds replayed before the measured runs (not counted)")
    ap.add_argument("--decode-rate", type=float, default=4.0,
                    help="decode-load arrivals per second (Poisson); the default is a load the sized engine carries")
    ap.add_argument("--decode-prompt-tokens", default="1024,3072")
    ap.add_argument("--decode-output-tokens", default="256,512")
    ap.add_argument("--long-every-s", type=float, default=2.0)
    ap.add_argument("--long-tokens", default="8192,32768")
    ap.add_argument("--long-output-tokens", type=int, default=32)
    ap.add_argument("--ttft-slo-ms", type=float, default=None, help="with --itl-slo-ms: fixed SLOs")
    ap.add_argument("--itl-slo-ms", type=float, default=None)
    ap.add_argument("--slo-scale", type=float, default=2.0,
                    help="without fixed SLOs: this times the first policy's median TTFT and mean inter-token latency")
    ap.add_argument("--interval-s", type=float, default=1.0, help="controller round")
    ap.add_argument("--trial-rounds", type=int, default=5,
                    help="auto: rounds of one trial (and of its settling before the first)")
    ap.add_argument("--min-requests", type=int, default=4, help="finished requests a controller judgment needs")
    ap.add_argument("--trial-cycles", type=int, default=2,
                    help="auto: A B B A cycles of trials; short trials, many of them, so that both arms see the "
                         "trace's busy and quiet stretches alike")
    ap.add_argument("--max-num-seqs", type=int, default=128)
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.3,
                    help="sizes the KV pool so that the steady load fills it (KV pressure is what lending is for)")
    ap.add_argument("--num-kv-blocks", type=int, default=1024, help="CPU only (no measured sizing)")
    ap.add_argument("--reserve-blocks", type=int, default=128, help="CPU only")
    ap.add_argument("--num-layers", type=int, default=None, help="fewer layers than the shape (smoke runs only)")
    ap.add_argument("--tp", type=int, default=1, choices=(1,), help="TP=2 needs a two-GPU machine (not built here)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=os.path.join(REPO, "bench", "results", "seed_experiment.json"))
    ap.add_argument("--repeats", type=int, default=2,
                    help="runs of every policy, interleaved: repeat r runs the policies in turn from the r-th on")
    ap.add_argument("--resume", action="store_true",
                    help="continue the --out result of the same settings: keep its runs and SLOs, run what is missing")
    ap.add_argument("--rerun", type=lambda s: s.split(","), default=[], metavar="POLICIES",
                    help="with --resume: drop these policies' runs and run them again (their code changed); "
                         "once: a later --resume without it continues them")
    ap.add_argument("--max-seconds", type=float, default=0.0,
                    help="stop before a run that would end past this many seconds (a result --resume continues)")
    ap.add_argument("--plot", metavar="JSON", default=None,
                    help="run nothing: draw the figure of a result JSON into the .png beside it")
    argv = sys.argv[1:] if argv is None else argv
    args = ap.parse_args(argv)
    if args.plot:
        with open(args.plot) as f:
            result = json.load(f)
        plot(result, os.path.splitext(args.plot)[0] + ".png")
        return result
    if (args.ttft_slo_ms is None) != (args.itl_slo_ms is None):
        ap.error("--ttft-slo-ms and --itl-slo-ms go together (or neither: SLOs from the first policy's run)")
    if args.repeats < 1:
        ap.error("--repeats is at least 1")
    if args.rerun and not args.resume:
        ap.error("--rerun goes with --resume")
    args.budgets = tuple(int(x) for x in args.budgets.split(","))
    for name in ("decode_prompt_tokens", "decode_output_tokens", "long_tokens"):
        setattr(args, name, tuple(int(x) for x in getattr(args, name).split(",")))
    high, low = args.budgets
    policies = (args.policies or f"static{high},static{low},elastic,chunk,auto").split(",")
    if args.ttft_slo_ms is None and not policies[0].startswith("static"):
        ap.error("without fixed SLOs the first policy sets them, so it must be a static one")

    t0 = time.time()
    config = {k: v for k, v in vars(args).items() if k not in RUN_ONLY_FLAGS}
    result, rows = start_or_resume(args, argv, config)
    wall_before = result.get("wall_seconds", 0.0)
    plan = [(r, p) for r in range(args.repeats) for p in policies[r % len(policies):] + policies[:r % len(policies)]]
    todo = [(r, p) for r, p in plan if not any(run.get("repeat", 0) == r for run in rows.get(p, []))]
    engine = build_engine(args)
    vocab = engine.model_config.vocab_size
    trace = make_trace(args)
    warm_up(engine, args, vocab, trace)
    result["trace"] = {"requests": len(trace), "long": sum(a.kind == "long" for a in trace),
                       "learn_s": args.learn_s, "duration_s": args.duration_s}
    run_seconds = args.learn_s + args.duration_s + args.drain_s + 15.0
    for repeat, policy in todo:
        if args.max_seconds and time.time() - t0 + run_seconds > args.max_seconds:
            print(f"stopping before repeat {repeat} of {policy}: --max-seconds {args.max_seconds} would pass; "
                  f"continue with --resume", flush=True)
            break
        started = time.time()
        r = run_policy(engine, policy, trace, args, vocab)
        run_seconds = max(run_seconds, time.time() - started + 5.0)
        r["repeat"] = repeat
        if args.ttft_slo_ms is None:                 # the first policy's run sets the SLOs everyone is judged by
            args.ttft_slo_ms, args.itl_slo_ms = calibrated_slos(r["request_latencies_s"], args.slo_scale)
            result["slo"] = {"ttft_ms": args.ttft_slo_ms, "itl_ms": args.itl_slo_ms,
                             "set_by": f"{args.slo_scale} x the medians of {policy}'s requests"}
        met = slo_met(r["request_latencies_s"], args.ttft_slo_ms, args.itl_slo_ms)
        met_learning = slo_met(r["learning_latencies_s"], args.ttft_slo_ms, args.itl_slo_ms)
        r.update(goodput=round(met / args.duration_s, 4), slo_attainment=round(met / max(1, r["requests"]), 4),
                 goodput_cold=round((met + met_learning) / (args.learn_s + args.duration_s), 4))
        rows.setdefault(policy, []).append(r)
        rows[policy].sort(key=lambda run: run["repeat"])
        print(f"{policy:>12} r{repeat}: goodput {r['goodput']:.3f}/s  decode {r['decode_tok_s']:.0f} tok/s  "
              f"TTFT {r['ttft_ms']['median']}/{r['ttft_ms']['p99']} ms  ITL {r['decode_itl_ms']['median']}/"
              f"{r['decode_itl_ms']['p99']} ms  KV max {r['kv_usage_max']:.2f}  cut {r['cut']}  "
              f"budget {r['budget_final']} elastic {r['elastic_final']}", flush=True)
        result["tp1"] = summarize({p: rows[p] for p in policies if p in rows}, engine, args)
        result["wall_seconds"] = round(wall_before + time.time() - t0, 1)
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    if "tp1" not in result:
        raise SystemExit("no run fitted in --max-seconds")
    tp1 = result["tp1"]
    print(f"\nKV blocks: base {tp1['kv_blocks_base']}, lending adds {tp1['kv_gain_elastic_blocks']}, "
          f"budget {low} grants {tp1['kv_gain_lower_chunk_blocks']} (reserve fraction {tp1['reserve_fraction']})")
    print(f"{'policy':>12} {'goodput/s':>10} {'cold':>7} {'decode tok/s':>13}  (mean of {tp1['repeats']} or more runs; "
          f"each run's goodput)")
    for name, p in tp1["policies"].items():
        print(f"{name:>12} {p['goodput']:>10.3f} {p['goodput_cold']:>7.3f} {p['decode_tok_s']:>13.0f}  "
              f"{p['goodput_repeats']}")
    if "auto_goodput_vs_best_static" in tp1:
        print(f"auto / best static goodput: {tp1['auto_goodput_vs_best_static']} (per repeat "
              f"{tp1['auto_goodput_vs_best_static_repeats']}; cold {tp1['auto_goodput_cold_vs_best_static']}; "
              f"auto chose {tp1['auto_chose']})")
    missing = len(plan) - sum(len(runs) for runs in rows.values())
    if missing:
        print(f"{missing} runs of {len(plan)} still to run: the same command with --resume")
    print(f"wrote {args.out}")
    return result


if __name__ == "__main__":
    main()
