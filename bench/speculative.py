"""Speculative decoding benchmark: accept length and speed of chain / DDTree / DominoTree against tidal's own
plain decoding, the GPU tree builder's cost per round, and its bit-identity with the reference builder.

    python -m bench.speculative [--model PATH] [--drafter DIR] [--prompts bench/data/sharegpt_heldout.json]
        [--num-prompts 32] [--num-prompts-b1 8] [--max-tokens 128] [--modes chain,ddtree,dominotree]
        [--batches 1,8,32] [--temps 0,1] [--device auto] [--force-budget 16] [--min-cell-seconds 5] [--repeats 2]
        [--min-rounds 16] [--projection llama3-8b] [--tie 0.25] [--out bench/results/speculative.json] [--update]
    python -m bench.speculative --export-prompts bench/data/sharegpt_heldout.json --split heldout --limit 256

Workload: ShareGPT first human turns (held-out split), chat-formatted with one user turn like the drafter's
training data, at most --max-prompt-tokens each. A run keeps `b` requests in flight (a finished one is replaced at
once; the prompts are queued again until the run has lasted --min-cell-seconds, and each cell runs --repeats
times); batch 1 uses --num-prompts-b1 requests, larger batches --num-prompts. Prefix caching is off (every run
prefills cold and the drafter sees every context token), token ids only (no detokenization), one seed per
request. One engine per method, one after another: plain decoding (CUDA graphs where the engine captures them),
then each speculative mode; every engine warms up first. Throughput = generated tokens / wall time of the run.

tau = tokens per verify round, bonus included = 1 + spec_accepted_tokens / spec_drafts: `spec_drafts` counts one
per sequence per round, `spec_accepted_tokens` the accepted draft tokens (the bonus token is not among them).
Each mode's `engine.speculative.<mode>.policy` is what its budget policy saw at start-up (verify and draft ms by
batch size and nodes, graphed or not) and why it chose each budget; tau is null when it chose 0 at every batch
size run. `--force-budget N` then reruns every (temperature, batch) with N nodes at every batch size, bypassing
the policy: `<mode>.forced` holds that tau, acceptance by position and speed, apart from the policy-driven figures.

`--update` measures only --modes and keeps the other modes' sections of an existing --out as they are, each
stamped with the provenance of the run that measured it (`<mode>.measured_by`) and listed in `kept_modes`: their
ratios stay against the plain engine of their own run. A GPU call can then re-measure one mode at a time.

Greedy agreement (`outputs_equal_plain`, T=0): the share of requests whose tokens equal plain decoding's, or
first differ where plain's top-2 logits are within --tie of each other (the near-tie rule of
tests/support/greedy.py; the gap is read from a plain engine's logprobs at that point). In a closed loop one
near-tie flip changes a request's length, hence later batches and their numerics, so exact equality
(`outputs_identical_plain`) can fall far below 1 with no bug. At T>0 both are exact equality.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Optional

import torch

from replicas import LLM, SamplingParams
from bench.projection import projection
from bench.provenance import provenance, repo_path
from bench.round_cost import MIN_ROUNDS, RoundLog, breakdown, round_cost
from bench.shapes import SHAPES
from bench.speculative_report import MODES, Run, build_report, format_table, mode_summaries, temp_key
from bench.tree_builder import builder_identity, time_tree_build
from speculative.train_loop import LOG_NAME, last_log_record

DEFAULT_PROMPTS = str(Path(__file__).resolve().parent / "data" / "sharegpt_heldout.json")


@dataclass(frozen=True)
class BenchConfig:
    model: Optional[str] = None               # None: the embedded SmolLM2 (TIDAL_DEFAULT_MODEL overrides)
    drafter: Optional[str] = None             # folder saved by DominoDrafter.save; None: the engine's default
    allow_random_drafter: bool = False
    prompts: str = DEFAULT_PROMPTS
    split: str = "heldout"
    num_prompts: int = 32
    num_prompts_b1: int = 8
    max_tokens: int = 128
    max_prompt_tokens: int = 1024
    modes: tuple[str, ...] = ("chain", "ddtree", "dominotree")
    batches: tuple[int, ...] = (1, 8, 32)
    temps: tuple[float, ...] = (0.0, 1.0)
    device: str = "auto"
    seed: int = 0
    warmup: int = 8                           # requests per temperature before measuring, per engine
    ignore_eos: bool = False
    gpu_memory_utilization: float = 0.3
    spec_budget: int = 16
    spec_policy: str = "measured"             # the engines' budget policy (EngineConfig spec_policy)
    tree_rounds: int = 200                    # timed tree builds per mode (CUDA)
    builder_cases: int = 1000                 # random reference-vs-GPU builder cases (CUDA)
    force_budget: Optional[int] = None        # also run every mode with this budget at every batch size
    min_rounds: int = MIN_ROUNDS              # forced rounds at a batch size needed to report its round overhead
    projection: Optional[str] = None          # a bench.shapes name (or config folder): projected speedups there
    min_cell_seconds: float = 5.0             # a (temperature, batch) run queues its prompts again until this long
    repeats: int = 2                          # runs per (temperature, batch); the JSON keeps each
    tie: Optional[float] = None               # near-tie logit gap; None: 1e-3 for float32 engines, else 0.25
    out: str = "bench/results/speculative.json"


# ---- prompts ------------------------------------------------------------------------------------------------

def export_prompts(path: str, split: str, limit: int) -> int:
    from speculative.train_data import sharegpt_prompts
    prompts = sharegpt_prompts(split, limit=limit)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        json.dump(prompts, f, ensure_ascii=False)
    return len(prompts)


def chat_prompts(tokenizer, texts: list[str], max_prompt_tokens: int) -> tuple[list[list[int]], int]:
    """Token ids of each text as one user turn; prompts longer than max_prompt_tokens are skipped (and counted)."""
    ids = [tokenizer.encode_chat([{"role": "user", "content": t}], add_generation_prompt=True) for t in texts]
    kept = [p for p in ids if len(p) <= max_prompt_tokens]
    return kept, len(ids) - len(kept)


# ---- runs ---------------------------------------------------------------------------------------------------

def sampling(cfg: BenchConfig, temperature: float, count: int, max_tokens: int) -> list[SamplingParams]:
    return [SamplingParams(temperature=temperature, max_tokens=max_tokens, seed=cfg.seed * 1_000_003 + i,
                           ignore_eos=cfg.ignore_eos, detokenize=False) for i in range(count)]


def count_graph_replays(engine) -> list[int]:
    """[replays so far, verify replays so far]: wraps the runner's graph replay with counters (the engine keeps
    none)."""
    box, graphs = [0, 0], engine.runner.graphs
    if graphs is not None:
        replay = graphs.run

        def counted(step):
            box[0] += 1
            box[1] += step.trees is not None
            return replay(step)
        graphs.run = counted
    return box


def drive(llm: LLM, prompts: list[list[int]], params: list[SamplingParams], concurrency: int, tag: str,
          replays: list[int], min_seconds: float = 0.0) -> Run:
    """Closed loop: keep `concurrency` requests in the engine until every prompt is done; while the run is younger
    than `min_seconds`, the prompts are queued again (same params and seeds) as the queue runs dry, so the batch
    stays full. `outputs` are the first pass's; tokens and seconds count every pass."""
    engine = llm.engine
    before, replays_before = engine.get_stats(), list(replays)
    index: dict[str, tuple[int, int]] = {}
    outputs: list[list[int]] = [[] for _ in prompts]
    queue = [(0, i) for i in range(len(prompts))][::-1]
    passes, tokens = 1, 0

    def submit() -> None:
        nonlocal passes
        if not queue and time.perf_counter() - start < min_seconds:
            queue.extend((passes, i) for i in reversed(range(len(prompts))))
            passes += 1
        if queue:
            k, i = queue.pop()
            rid = f"{tag}-p{k}-{i}"
            engine.add_request(rid, prompts[i], params[i], stream=False)
            index[rid] = (k, i)

    _sync()
    start = time.perf_counter()
    while (queue or time.perf_counter() - start < min_seconds) and len(engine.requests) < concurrency:
        submit()
    while engine.has_unfinished:
        for out in engine.step():
            if out.finished:
                k, i = index[out.request_id]
                tokens += len(out.outputs[0].token_ids)
                if k == 0:
                    outputs[i] = list(out.outputs[0].token_ids)
                submit()
    _sync()
    seconds = time.perf_counter() - start
    timings = [t for t in engine.finished_timings if t.request_id in index]
    decode_tokens = sum(max(t.num_generation_tokens - 1, 0) for t in timings)
    decode_s = sum(t.finish_time - t.first_token_time for t in timings)
    after = engine.get_stats()
    old_pos = before.spec_accepted_by_position
    by_pos = [a - (old_pos[d] if d < len(old_pos) else 0) for d, a in enumerate(after.spec_accepted_by_position)]

    def delta(name: str) -> int:
        return getattr(after, name) - getattr(before, name)

    return Run(outputs, seconds, decode_tokens / decode_s if decode_s > 0 else 0.0, delta("num_steps"),
               replays[0] - replays_before[0], replays[1] - replays_before[1], delta("spec_drafts"),
               delta("spec_draft_tokens"), delta("spec_accepted_tokens"), by_pos, tokens=tokens, passes=passes)


def engine_kwargs(cfg: BenchConfig, mode: str) -> dict:
    kw = dict(model=cfg.model, device=cfg.device, seed=cfg.seed, max_num_seqs=max(cfg.batches),
              enable_prefix_caching=False, enforce_eager=False, gpu_memory_utilization=cfg.gpu_memory_utilization)
    if mode != "plain":
        kw.update(speculative=mode, drafter=cfg.drafter, spec_budget=cfg.spec_budget, spec_policy=cfg.spec_policy,
                  allow_random_drafter=cfg.allow_random_drafter)
    return kw


def measure(cfg: BenchConfig, mode: str, sets: dict[int, list[list[int]]], warm: list[list[int]]) -> dict:
    """One engine for `mode` ("plain" or a speculative method): warm-up, then every (temperature, batch) run;
    with --force-budget, every run again with that budget at every batch size."""
    llm = LLM(**engine_kwargs(cfg, mode))
    try:
        engine = llm.engine
        result: dict = dict(runs={}, engine=dict(device=str(engine.runner.device), dtype=str(engine.runner.dtype),
                                                 cuda_graphs=engine.runner.graphs is not None))
        table = engine.runner.gemm_table or {}
        result["engine"]["gemm_table"] = {f"{n}x{k}:{str(dtype).removeprefix('torch.')}":
                                          {str(m): str(c) for m, c in sorted(by_m.items())}
                                          for (n, k, dtype), by_m in sorted(table.items(), key=str)}
        spec, replays = engine.speculator, count_graph_replays(engine)
        if spec is not None:
            result["engine"]["budget_by_batch"] = {f"b{b}": spec.budget(b) for b in cfg.batches}
            result["engine"]["policy"] = spec.policy.describe() if spec.policy is not None else None
            result["engine"]["speculator_enabled"] = spec.enabled
        result["runs"] = measure_runs(cfg, llm, mode, sets, warm, replays)
        if spec is not None and cfg.force_budget:
            from speculative.cost_model import FixedBudgetPolicy
            spec.use_policy(FixedBudgetPolicy(cfg.force_budget), engine.runner)
            if engine.runner.graphs is not None:
                result["engine"]["forced_verify_graphs"] = sorted(
                    f"b{b}n{n}" for b, n in engine.runner.graphs.verify_shapes(spec.aux_layers))
            log = RoundLog(spec)
            result["forced_runs"] = measure_runs(cfg, llm, f"{mode}@{cfg.force_budget}", sets, warm, replays, log)
            result["round"] = round_cost(engine, log, cfg.batches, cfg.force_budget, min_rounds=cfg.min_rounds)
            result["round_breakdown"] = {f"b{b}": profile_rounds(cfg, llm, sets[b], b, log, replays)
                                         for b in cfg.batches}
        if spec is not None and engine.runner.device.type == "cuda":
            result["tree_build"] = time_tree_build(spec, cfg.spec_budget, cfg.tree_rounds)
        return result
    finally:
        llm.shutdown()


def measure_runs(cfg: BenchConfig, llm: LLM, tag: str, sets: dict[int, list[list[int]]], warm: list[list[int]],
                 replays: list[int], log: Optional[RoundLog] = None) -> dict:
    runs = {}
    for t in cfg.temps:
        if log is not None:
            log.temp = temp_key(t)
        if warm:
            drive(llm, warm, sampling(cfg, t, len(warm), min(cfg.max_tokens, 32)),
                  min(len(warm), max(cfg.batches)), f"warm-{tag}-{temp_key(t)}", replays)
        for b in cfg.batches:
            started = time.perf_counter()
            repeats = [drive(llm, sets[b], sampling(cfg, t, len(sets[b]), cfg.max_tokens), b,
                             f"{tag}-{temp_key(t)}-b{b}-r{r}", replays, cfg.min_cell_seconds)
                       for r in range(cfg.repeats)]
            run = runs[(t, b)] = Run.merge(repeats)
            print(f"  {tag:13s} {temp_key(t):4s} b{b:<3d} {run.tok_s:9.1f} tok/s ("
                  + " / ".join(f"{r.tok_s:.1f}" for r in repeats) + ")"
                  + (f"  tau {1 + run.accepted / run.drafts:.2f}" if run.drafts else "")
                  + f"  ({time.perf_counter() - started:.1f} s)", flush=True)
    return runs


def profile_rounds(cfg: BenchConfig, llm: LLM, prompts: list[list[int]], b: int, log: RoundLog,
                   replays: list[int]) -> dict:
    """bench.round_cost.breakdown of `b` greedy requests at batch b (64 tokens each)."""
    log.temp = "profiled"
    before = log.count
    parts = breakdown(llm.engine, lambda: drive(llm, prompts[:b], sampling(cfg, 0.0, b, 64), b, f"profile-b{b}",
                                                replays))
    rounds = log.count - before
    per = max(1, rounds)
    return dict(rounds=rounds,
                ms_per_round={k: {m: v / per for m, v in part.items()} for k, part in parts["parts"].items()},
                top_kernels=[dict(name=k["name"], device_ms_per_round=k["device_ms"] / per,
                                  calls_per_round=k["calls"] / per) for k in parts["kernels"]])


def _first_difference(a: list[int], b: list[int]) -> Optional[int]:
    k = next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), None)
    return k if k is not None or len(a) == len(b) else min(len(a), len(b))


def greedy_agreement(cfg: BenchConfig, prompts: dict[int, list[list[int]]], plain: dict[int, list[list[int]]],
                     others: dict[str, dict[int, list[list[int]]]], tie: float) -> dict[str, dict[int, dict]]:
    """The near-tie rule (tests/support/greedy.py) for every run against plain greedy: where a request first
    differs, plain's top-2 logit gap at that point (a plain engine's logprobs, one batched call for all runs);
    agreeing = identical, or first differing at a gap below `tie`. name -> batch -> {share, flips}."""
    where = [(name, b, i, k) for name, outs in others.items() for b in cfg.batches
             for i, (got, want) in enumerate(zip(outs[b], plain[b]))
             if (k := _first_difference(got, want)) is not None]
    gaps = []
    if where:
        llm = LLM(**{**engine_kwargs(cfg, "plain"), "enforce_eager": True})
        try:
            outs = llm.generate([prompts[b][i] + plain[b][i][:k] for _, b, i, k in where],
                                SamplingParams(temperature=0.0, max_tokens=1, logprobs=2, detokenize=False))
        finally:
            llm.shutdown()
        for o in outs:
            top = sorted((v.logprob for v in o.outputs[0].logprobs[0].values()), reverse=True)
            gaps.append(top[0] - top[1])
    result = {name: {b: dict(share=1.0, flips=[]) for b in cfg.batches} for name in others}
    for (name, b, i, k), gap in zip(where, gaps):
        result[name][b]["flips"].append(dict(request=i, position=k, gap=gap, near_tie=gap < tie))
    for name, by_batch in result.items():
        for b, verdict in by_batch.items():
            bad = sum(not f["near_tie"] for f in verdict["flips"])
            verdict["share"] = 1.0 - bad / len(plain[b])
    return result


@dataclass
class BenchResult:
    report: dict
    prompts: dict[int, list[list[int]]]                     # batch -> prompt token ids
    outputs: dict[tuple[str, float, int], list[list[int]]]  # (mode or "plain", temperature, batch) -> token ids


def drafter_in_use(cfg: BenchConfig, model_config) -> str:
    """What the speculative engines load: --drafter, else the engine's default (a drafter bundled for this target
    shape, speculative/speculator.py), else a random one if allowed."""
    if cfg.drafter:
        return cfg.drafter
    try:
        from speculative.drafters import bundled_drafter
    except ImportError:                     # a tree without bundled drafters
        found = None
    else:
        found = bundled_drafter(model_config)
    if found is None and not cfg.allow_random_drafter:
        raise SystemExit("no drafter is bundled for this model: pass --drafter DIR (the `drafter/` folder "
                         "python -m speculative.train writes), or --allow-random-drafter for a smoke test")
    return found or "random (allow_random_drafter)"


def check_builders(cfg: BenchConfig, cuda: bool) -> dict:
    """The GPU builder against the reference on --builder-cases random rounds (CUDA only)."""
    if not cuda:
        return dict(skipped="needs CUDA")
    if cfg.builder_cases <= 0:
        return dict(skipped="--builder-cases 0")
    started = time.perf_counter()
    identity = builder_identity(cfg.builder_cases, "cuda", cfg.seed)
    identity["seconds"] = time.perf_counter() - started
    return identity


def drafter_training(folder: str) -> dict:
    """The `train` section: how the drafter in use was trained, from its own log (`train_log.jsonl`, as
    `python -m speculative.train` writes it): the last record's MFU, sequence tokens/s and tokens seen (null
    where that log predates the field)."""
    last = last_log_record(folder)
    if last is None:
        return {"source": None, "note": f"{folder} has no {LOG_NAME}"}
    path = os.path.join(folder, LOG_NAME)
    return {"source": repo_path(path),
            "steps": last["step"], "mfu": last.get("mfu"), "tokens_per_s": last.get("seq_tokens_per_s"),
            "tokens_seen": last.get("tokens_seen"), "final_loss": last.get("final_loss"),
            "accept_len": last.get("accept_len"),
            "note": "the drafter's training log, last record: MFU and tokens/s over its last logging window"}


def run_bench(cfg: BenchConfig) -> BenchResult:
    from replicas.loaders import load_checkpoint
    started = time.perf_counter()
    torch.manual_seed(cfg.seed)
    checkpoint = load_checkpoint(cfg.model)
    drafter = drafter_in_use(cfg, checkpoint.model_config) if cfg.modes else None
    with open(cfg.prompts, encoding="utf-8") as f:
        texts = json.load(f)
    eligible, too_long = chat_prompts(checkpoint.tokenizer, texts, cfg.max_prompt_tokens)
    counts = {b: cfg.num_prompts_b1 if b == 1 else cfg.num_prompts for b in cfg.batches}
    top = max(counts.values())
    if len(eligible) < top:
        raise SystemExit(f"{len(eligible)} prompts of at most {cfg.max_prompt_tokens} tokens; {top} needed")
    sets = {b: eligible[:n] for b, n in counts.items()}
    warm = (eligible[top:] or eligible)[:cfg.warmup]

    results = {}
    for mode in ("plain",) + cfg.modes:
        results[mode] = measure(cfg, mode, sets, warm)
        free_memory()
    plain = results["plain"]["runs"]
    cuda = results["plain"]["engine"]["device"].startswith("cuda")
    tie = cfg.tie if cfg.tie is not None else (1e-3 if results["plain"]["engine"]["dtype"] == "torch.float32"
                                               else 0.25)
    greedy = {}
    if 0.0 in cfg.temps:
        runs_of = {m: results[m]["runs"] for m in cfg.modes}
        runs_of.update({f"{m}@forced": results[m]["forced_runs"] for m in cfg.modes if "forced_runs" in results[m]})
        greedy = greedy_agreement(cfg, sets, {b: plain[(0.0, b)].outputs for b in cfg.batches},
                                  {name: {b: r[(0.0, b)].outputs for b in cfg.batches} for name, r in runs_of.items()},
                                  tie)
    prompts = dict(path=cfg.prompts, split=cfg.split, in_file=len(texts), skipped_over_max_tokens=too_long,
                   max_prompt_tokens=cfg.max_prompt_tokens, chat_template="one user turn",
                   requests_per_batch={f"b{b}": n for b, n in counts.items()},
                   mean_prompt_tokens=sum(map(len, eligible[:top])) / top)
    report = build_report(cfg, results, greedy, drafter, tie, cuda, prompts, len(warm), check_builders(cfg, cuda))
    if drafter and os.path.isdir(drafter):
        report["train"] = drafter_training(drafter)
    if cfg.projection:
        free_memory()
        measured = report["dominotree"].get("forced") or report["dominotree"]
        name = cfg.projection if cfg.projection in SHAPES else os.path.basename(cfg.projection.rstrip("/"))
        report["projection"] = {name: projection(
            cfg.projection, {temp_key(t): measured[temp_key(t)]["tau"] for t in cfg.temps
                             if measured[temp_key(t)]["tau"] is not None},
            cfg.batches, cfg.force_budget or cfg.spec_budget, cfg.device, cfg.seed,
            drafter if os.path.isdir(drafter) else None, cfg.gpu_memory_utilization)}
    report["wall_seconds"] = time.perf_counter() - started
    outputs = {(m, t, b): r.outputs for m, res in results.items() for (t, b), r in res["runs"].items()}
    outputs.update({(f"{m}@forced", t, b): r.outputs for m, res in results.items()
                    for (t, b), r in res.get("forced_runs", {}).items()})
    return BenchResult(report, sets, outputs)


def _sync() -> None:
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


def free_memory() -> None:
    gc.collect()
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    d = BenchConfig()
    p = argparse.ArgumentParser(prog="python -m bench.speculative", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=d.model, help="HF folder or .gguf (default: the embedded SmolLM2)")
    p.add_argument("--drafter", default=d.drafter,
                   help="drafter folder (DominoDrafter.save); default: the engine's, bundled for the target")
    p.add_argument("--allow-random-drafter", action="store_true", help="random drafter (smoke tests only)")
    p.add_argument("--prompts", default=d.prompts, help="JSON list of prompt strings")
    p.add_argument("--split", default=d.split, choices=("train", "heldout"), help="ShareGPT split (export; label)")
    p.add_argument("--num-prompts", type=int, default=d.num_prompts, help="requests per batch size > 1")
    p.add_argument("--num-prompts-b1", type=int, default=d.num_prompts_b1, help="requests at batch 1")
    p.add_argument("--max-tokens", type=int, default=d.max_tokens)
    p.add_argument("--max-prompt-tokens", type=int, default=d.max_prompt_tokens)
    p.add_argument("--modes", default=",".join(d.modes))
    p.add_argument("--batches", default=",".join(map(str, d.batches)))
    p.add_argument("--temps", default=",".join(f"{t:g}" for t in d.temps))
    p.add_argument("--device", default=d.device, choices=("auto", "cuda", "cpu"))
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--warmup", type=int, default=d.warmup, help="warm-up requests per temperature and engine")
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--gpu-memory-utilization", type=float, default=d.gpu_memory_utilization)
    p.add_argument("--spec-budget", type=int, default=d.spec_budget)
    p.add_argument("--spec-policy", choices=("measured", "knee", "fixed"), default=d.spec_policy,
                   help="the engines' budget policy (tidal serve --spec-policy)")
    p.add_argument("--tree-rounds", type=int, default=d.tree_rounds)
    p.add_argument("--builder-cases", type=int, default=d.builder_cases)
    p.add_argument("--force-budget", type=int, default=d.force_budget,
                   help="also rerun every mode with this many draft nodes at every batch size (bypasses the policy)")
    p.add_argument("--projection", metavar="SHAPE", default=d.projection,
                   help="also project DominoTree's speedups to this bench.shapes target (e.g. llama3-8b): its costs "
                        "measured with random weights, this run's tau (bench/projection.py)")
    p.add_argument("--min-cell-seconds", type=float, default=d.min_cell_seconds,
                   help="each (temperature, batch) run queues its prompts again until it has lasted this long")
    p.add_argument("--repeats", type=int, default=d.repeats, help="runs per (temperature, batch); each kept")
    p.add_argument("--min-rounds", type=int, default=d.min_rounds,
                   help="forced rounds at one batch size needed to report its round overhead (else null)")
    p.add_argument("--tie", type=float, default=d.tie,
                   help="near-tie logit gap for greedy agreement (default: 1e-3 float32 engines, 0.25 otherwise)")
    p.add_argument("--out", default=d.out)
    p.add_argument("--update", action="store_true",
                   help="keep the sections of modes not in --modes from the existing --out (each with its provenance)")
    p.add_argument("--export-prompts", metavar="PATH", help="write --limit prompts of --split to PATH and exit")
    p.add_argument("--limit", type=int, default=256)
    return p.parse_args(argv)


def config_from(args: argparse.Namespace) -> BenchConfig:
    modes = tuple(m for m in args.modes.split(",") if m)
    if not set(modes) <= {"chain", "ddtree", "dominotree"}:
        raise SystemExit(f"--modes: choose from chain, ddtree, dominotree (got {args.modes})")
    if args.projection and "dominotree" not in modes:
        raise SystemExit("--projection uses DominoTree's measured tau: include dominotree in --modes")
    return BenchConfig(
        model=args.model, drafter=args.drafter, allow_random_drafter=args.allow_random_drafter, prompts=args.prompts,
        split=args.split, num_prompts=args.num_prompts, num_prompts_b1=args.num_prompts_b1,
        max_tokens=args.max_tokens, max_prompt_tokens=args.max_prompt_tokens, modes=modes,
        batches=tuple(sorted({int(b) for b in args.batches.split(",") if b})),
        temps=tuple(float(t) for t in args.temps.split(",") if t), device=args.device, seed=args.seed,
        warmup=args.warmup, ignore_eos=args.ignore_eos, gpu_memory_utilization=args.gpu_memory_utilization,
        spec_budget=args.spec_budget, spec_policy=args.spec_policy, tree_rounds=args.tree_rounds,
        builder_cases=args.builder_cases, force_budget=args.force_budget or None, min_rounds=args.min_rounds,
        min_cell_seconds=args.min_cell_seconds, repeats=max(1, args.repeats), projection=args.projection,
        tie=args.tie, out=args.out)


def keep_other_modes(report: dict, out: str, modes: tuple[str, ...]) -> None:
    """--update: the sections of the modes not measured now, from the JSON already at `out`, stamped with the
    provenance of the run that measured them."""
    if not os.path.exists(out):
        return
    with open(out, encoding="utf-8") as f:
        old = json.load(f)
    kept = [m for m in MODES if m not in modes and m in old]
    for m in kept:
        report[m] = {**old[m], "measured_by": old[m].get("measured_by") or old.get("provenance")}
        engine = old.get("engine", {}).get("speculative", {}).get(m)
        if engine is not None:
            report["engine"]["speculative"][m] = engine
    if kept:
        report["kept_modes"] = kept
        report.update(mode_summaries(report))


def main(argv: Optional[list[str]] = None) -> Optional[BenchResult]:
    args = parse_args(argv)
    if args.export_prompts:
        n = export_prompts(args.export_prompts, args.split, args.limit)
        print(f"{n} {args.split} prompts -> {args.export_prompts}")
        return None
    cfg = config_from(args)
    result = run_bench(cfg)
    result.report["config"] = {k: list(v) if isinstance(v, tuple) else v for k, v in asdict(cfg).items()}
    argv = list(argv if argv is not None else sys.argv[1:])
    result.report["provenance"] = provenance(
        "bench.speculative", argv, result.report["engine"]["plain"]["device"], cfg.seed,
        warm_up=f"{cfg.warmup} requests per temperature and engine before its runs",
        counted="generated tokens over each run's wall time (prefill included); rounds as the engine times them")
    if args.update:
        keep_other_modes(result.report, cfg.out, cfg.modes)
    os.makedirs(os.path.dirname(os.path.abspath(cfg.out)), exist_ok=True)
    with open(cfg.out, "w") as f:
        json.dump(result.report, f, indent=2)
    print(format_table(result.report, cfg))
    print(cfg.out)
    return result


if __name__ == "__main__":
    main()
