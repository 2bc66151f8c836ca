"""Speculative decoding benchmark: accept length and speed of chain / DDTree / DominoTree against tidal's own
plain decoding, the GPU tree builder's cost per round, and its bit-identity with the reference builder.

    python -m bench.speculative [--model PATH] [--drafter DIR] [--prompts bench/data/sharegpt_heldout.json]
        [--num-prompts 32] [--num-prompts-b1 8] [--max-tokens 128] [--modes chain,ddtree,dominotree]
        [--batches 1,8,32] [--temps 0,1] [--device auto] [--out bench/results/speculative.json]
    python -m bench.speculative --export-prompts bench/data/sharegpt_heldout.json --split heldout --limit 256

Workload: ShareGPT first human turns (held-out split), chat-formatted with one user turn like the drafter's
training data, at most --max-prompt-tokens each. A run keeps `b` requests in flight (a finished one is replaced at
once); batch 1 uses --num-prompts-b1 requests, larger batches --num-prompts. Prefix caching is off (every run
prefills cold and the drafter sees every context token), token ids only (no detokenization), one seed per
request. One engine per method, one after another: plain decoding (CUDA graphs where the engine captures them),
then each speculative mode; every engine warms up first. Throughput = generated tokens / wall time of the run.

tau = tokens per verify round, bonus included = 1 + spec_accepted_tokens / spec_drafts: `spec_drafts` counts one
per sequence per round, `spec_accepted_tokens` the accepted draft tokens (the bonus token is not among them).
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Optional

import torch

from replicas import LLM, SamplingParams
from replicas.loaders.default_model import default_model_path
from bench.tree_builder import builder_identity, time_tree_build

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
    tree_rounds: int = 200                    # timed tree builds per mode (CUDA)
    builder_cases: int = 1000                 # random reference-vs-GPU builder cases (CUDA)
    out: str = "bench/results/speculative.json"


@dataclass
class Run:
    """One (engine, temperature, batch) measurement; the spec_* fields are the engine counters' increase."""
    outputs: list[list[int]]
    seconds: float
    decode_tok_s_per_request: float
    steps: int = 0
    graph_steps: int = 0                      # steps whose forward replayed a CUDA graph
    drafts: int = 0
    draft_tokens: int = 0
    accepted: int = 0
    by_position: list[int] = field(default_factory=list)

    @property
    def output_tokens(self) -> int:
        return sum(map(len, self.outputs))

    @property
    def tok_s(self) -> float:
        return self.output_tokens / self.seconds

    def summary(self) -> dict:
        out = dict(tok_s=self.tok_s, output_tokens=self.output_tokens, requests=len(self.outputs),
                   seconds=self.seconds, decode_tok_s_per_request=self.decode_tok_s_per_request,
                   steps=self.steps, graph_steps=self.graph_steps)
        if self.drafts:
            out.update(tau=1 + self.accepted / self.drafts, rounds=self.drafts, draft_tokens=self.draft_tokens,
                       accepted_tokens=self.accepted)
        return out


def temp_key(t: float) -> str:
    return f"t{t:g}"


def batch_key(b: int) -> str:
    return "speedup_b1" if b == 1 else f"throughput_ratio_b{b}"


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
    """[replays so far]: wraps the runner's decode-graph replay with a counter (the engine keeps none)."""
    box, graphs = [0], engine.runner.graphs
    if graphs is not None:
        replay = graphs.run

        def counted(step):
            box[0] += 1
            return replay(step)
        graphs.run = counted
    return box


def drive(llm: LLM, prompts: list[list[int]], params: list[SamplingParams], concurrency: int, tag: str,
          replays: list[int]) -> Run:
    """Closed loop: keep `concurrency` requests in the engine until every prompt is done."""
    engine = llm.engine
    before, replays_before = engine.get_stats(), replays[0]
    index: dict[str, int] = {}
    outputs: list[list[int]] = [[] for _ in prompts]
    queue = list(range(len(prompts)))[::-1]

    def submit() -> None:
        i = queue.pop()
        rid = f"{tag}-{i}"
        engine.add_request(rid, prompts[i], params[i], stream=False)
        index[rid] = i

    _sync()
    start = time.perf_counter()
    while queue and len(engine.requests) < concurrency:
        submit()
    while engine.has_unfinished:
        for out in engine.step():
            if out.finished:
                outputs[index[out.request_id]] = list(out.outputs[0].token_ids)
                if queue:
                    submit()
    _sync()
    seconds = time.perf_counter() - start
    timings = [t for t in engine.finished_timings if t.request_id in index]
    decode_tokens = sum(max(t.num_generation_tokens - 1, 0) for t in timings)
    decode_s = sum(t.finish_time - t.first_token_time for t in timings)
    after = engine.get_stats()
    old_pos = before.spec_accepted_by_position
    by_pos = [a - (old_pos[d] if d < len(old_pos) else 0) for d, a in enumerate(after.spec_accepted_by_position)]
    delta = lambda name: getattr(after, name) - getattr(before, name)
    return Run(outputs, seconds, decode_tokens / decode_s if decode_s > 0 else 0.0, delta("num_steps"),
               replays[0] - replays_before, delta("spec_drafts"), delta("spec_draft_tokens"),
               delta("spec_accepted_tokens"), by_pos)


def measure(cfg: BenchConfig, mode: str, sets: dict[int, list[list[int]]], warm: list[list[int]]) -> dict:
    """One engine for `mode` ("plain" or a speculative method): warm-up, then every (temperature, batch) run."""
    kw = dict(model=cfg.model, device=cfg.device, seed=cfg.seed, max_num_seqs=max(cfg.batches),
              enable_prefix_caching=False, enforce_eager=False, gpu_memory_utilization=cfg.gpu_memory_utilization)
    if mode != "plain":
        kw.update(speculative=mode, drafter=cfg.drafter, spec_budget=cfg.spec_budget,
                  allow_random_drafter=cfg.allow_random_drafter)
    llm = LLM(**kw)
    try:
        engine = llm.engine
        result: dict = dict(runs={}, engine=dict(device=str(engine.runner.device),
                                                 cuda_graphs=engine.runner.graphs is not None))
        spec, replays = engine.speculator, count_graph_replays(engine)
        if spec is not None:
            result["engine"]["budget_by_batch"] = {f"b{b}": spec.budget(b) for b in cfg.batches}
        for t in cfg.temps:
            if warm:
                drive(llm, warm, sampling(cfg, t, len(warm), min(cfg.max_tokens, 32)),
                      min(len(warm), max(cfg.batches)), f"warm-{mode}-{temp_key(t)}", replays)
            for b in cfg.batches:
                started = time.perf_counter()
                run = drive(llm, sets[b], sampling(cfg, t, len(sets[b]), cfg.max_tokens), b,
                            f"{mode}-{temp_key(t)}-b{b}", replays)
                result["runs"][(t, b)] = run
                print(f"  {mode:10s} {temp_key(t):4s} b{b:<3d} {run.tok_s:9.1f} tok/s"
                      + (f"  tau {1 + run.accepted / run.drafts:.2f}" if run.drafts else "")
                      + f"  ({time.perf_counter() - started:.1f} s)", flush=True)
        if spec is not None and engine.runner.device.type == "cuda":
            result["tree_build"] = time_tree_build(spec, cfg.spec_budget, cfg.tree_rounds)
        return result
    finally:
        llm.shutdown()


def mode_report(cfg: BenchConfig, runs: dict, plain: dict) -> dict:
    """Per temperature: tau and acceptance per position over all batches, speed ratios against plain decoding."""
    report = {}
    for t in cfg.temps:
        mine = [runs[(t, b)] for b in cfg.batches]
        drafts = sum(r.drafts for r in mine)
        depth = max((len(r.by_position) for r in mine), default=0)
        by_pos = [sum(r.by_position[d] for r in mine if d < len(r.by_position)) for d in range(depth)]
        entry = dict(tau=1 + sum(r.accepted for r in mine) / drafts if drafts else None)
        for b in cfg.batches:
            entry[batch_key(b)] = runs[(t, b)].tok_s / plain[(t, b)].tok_s
        if 1 in cfg.batches:
            p = plain[(t, 1)].decode_tok_s_per_request
            entry["decode_speedup_b1"] = runs[(t, 1)].decode_tok_s_per_request / p if p else None
        entry["accept_rate_by_position"] = [c / drafts for c in by_pos] if drafts else []
        entry["outputs_equal_plain"] = {f"b{b}": _same_share(runs[(t, b)].outputs, plain[(t, b)].outputs)
                                        for b in cfg.batches}
        entry["runs"] = {f"b{b}": runs[(t, b)].summary() for b in cfg.batches}
        report[temp_key(t)] = entry
    return report


def _same_share(got: list[list[int]], want: list[list[int]]) -> float:
    return sum(a == w for a, w in zip(got, want)) / len(want)


@dataclass
class BenchResult:
    report: dict
    prompts: dict[int, list[list[int]]]                     # batch -> prompt token ids
    outputs: dict[tuple[str, float, int], list[list[int]]]  # (mode or "plain", temperature, batch) -> token ids


def drafter_in_use(cfg: BenchConfig, model_config) -> str:
    """What the speculative engines load: --drafter, else the engine's default (a drafter bundled for this target
    shape, replicas/speculation.py), else a random one if allowed."""
    if cfg.drafter:
        return cfg.drafter
    try:
        from speculative.drafters import bundled_drafter
    except ImportError:                     # a tree without bundled drafters
        bundled_drafter = lambda _: None
    found = bundled_drafter(model_config)
    if found is None and not cfg.allow_random_drafter:
        raise SystemExit("no drafter is bundled for this model: pass --drafter DIR (the `drafter/` folder "
                         "python -m speculative.train writes), or --allow-random-drafter for a smoke test")
    return found or "random (allow_random_drafter)"


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
        _free()
    plain = results["plain"]["runs"]
    cuda = results["plain"]["engine"]["device"].startswith("cuda")
    report: dict = dict(
        device=torch.cuda.get_device_name() if cuda else "cpu", torch=torch.__version__,
        model=cfg.model or default_model_path(), drafter=drafter,
        seed=cfg.seed, warmup=dict(requests_per_temperature=len(warm), max_tokens=min(cfg.max_tokens, 32)),
        prompts=dict(path=cfg.prompts, split=cfg.split, in_file=len(texts), skipped_over_max_tokens=too_long,
                     max_prompt_tokens=cfg.max_prompt_tokens, chat_template="one user turn",
                     requests_per_batch={f"b{b}": n for b, n in counts.items()},
                     mean_prompt_tokens=sum(map(len, eligible[:top])) / top),
        max_tokens=cfg.max_tokens, ignore_eos=cfg.ignore_eos, batches=list(cfg.batches),
        temperatures={temp_key(t): t for t in cfg.temps},
        engine=dict(gpu_memory_utilization=cfg.gpu_memory_utilization, enable_prefix_caching=False,
                    max_num_seqs=max(cfg.batches), spec_budget=cfg.spec_budget, plain=results["plain"]["engine"],
                    speculative={m: results[m]["engine"] for m in cfg.modes},
                    note="runs[*].graph_steps counts steps that replayed a decode CUDA graph; the graphs take no "
                         "tree mask and no drafter hidden states, so speculative steps run eagerly"),
        plain={temp_key(t): {f"b{b}": plain[(t, b)].summary() for b in cfg.batches} for t in cfg.temps})
    for mode in cfg.modes:
        report[mode] = mode_report(cfg, results[mode]["runs"], plain)
    report.update(tree_sections(cfg, {m: results[m].get("tree_build") for m in cfg.modes}, cuda))
    report["wall_seconds"] = time.perf_counter() - started
    outputs = {(m, t, b): r.outputs for m, res in results.items() for (t, b), r in res["runs"].items()}
    return BenchResult(report, sets, outputs)


def tree_sections(cfg: BenchConfig, builds: dict[str, Optional[dict]], cuda: bool) -> dict:
    """tree_build_ms_b16 (DominoTree's builder if measured) and the builder identity count; null off CUDA."""
    out: dict = dict(tree_build_ms_b16=None, tree_build=dict(skipped="needs CUDA"),
                     builder_bit_identical_cases=None, builder_identity=dict(skipped="needs CUDA"))
    builds = {m: b for m, b in builds.items() if b is not None}
    if builds:
        mode = "dominotree" if "dominotree" in builds else next(iter(builds))
        out["tree_build_ms_b16"] = builds[mode]["eager_ms"]
        out["tree_build"] = dict(
            mode=mode, budget=cfg.spec_budget, batch=1, rounds=cfg.tree_rounds,
            timer="CUDA events over back-to-back rounds after 20 warm-up rounds",
            builder="prepare_round + build_frontier, eager: the engine's path (replicas/speculation.py); "
                    "graph_ms: GraphTreeBuilder replaying the same (the engine does not use it yet)",
            by_mode=builds)
    if cuda and cfg.builder_cases > 0:
        started = time.perf_counter()
        identity = builder_identity(cfg.builder_cases, "cuda", cfg.seed)
        identity["seconds"] = time.perf_counter() - started
        out.update(builder_bit_identical_cases=identity["identical"], builder_identity=identity)
    elif cuda:
        out["builder_identity"] = dict(skipped="--builder-cases 0")
    return out


def _sync() -> None:
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


def _free() -> None:
    gc.collect()
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


def format_table(report: dict, cfg: BenchConfig) -> str:
    cols = ["tau"] + [batch_key(b) for b in cfg.batches]
    heads = ["tau"] + [("speedup_b1" if b == 1 else f"ratio_b{b}") for b in cfg.batches]
    lines = [f"{'mode':12s}{'temp':6s}" + "".join(f"{h:>12s}" for h in heads)]
    for mode in cfg.modes:
        for t in cfg.temps:
            row = report[mode][temp_key(t)]
            lines.append(f"{mode:12s}{temp_key(t):6s}" + "".join(
                f"{row[c]:12.2f}" if row.get(c) is not None else f"{'-':>12s}" for c in cols))
    return "\n".join(lines)


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
    p.add_argument("--tree-rounds", type=int, default=d.tree_rounds)
    p.add_argument("--builder-cases", type=int, default=d.builder_cases)
    p.add_argument("--out", default=d.out)
    p.add_argument("--export-prompts", metavar="PATH", help="write --limit prompts of --split to PATH and exit")
    p.add_argument("--limit", type=int, default=256)
    return p.parse_args(argv)


def config_from(args: argparse.Namespace) -> BenchConfig:
    modes = tuple(m for m in args.modes.split(",") if m)
    if not set(modes) <= {"chain", "ddtree", "dominotree"}:
        raise SystemExit(f"--modes: choose from chain, ddtree, dominotree (got {args.modes})")
    return BenchConfig(
        model=args.model, drafter=args.drafter, allow_random_drafter=args.allow_random_drafter, prompts=args.prompts,
        split=args.split, num_prompts=args.num_prompts, num_prompts_b1=args.num_prompts_b1,
        max_tokens=args.max_tokens, max_prompt_tokens=args.max_prompt_tokens, modes=modes,
        batches=tuple(sorted({int(b) for b in args.batches.split(",") if b})),
        temps=tuple(float(t) for t in args.temps.split(",") if t), device=args.device, seed=args.seed,
        warmup=args.warmup, ignore_eos=args.ignore_eos, gpu_memory_utilization=args.gpu_memory_utilization,
        spec_budget=args.spec_budget, tree_rounds=args.tree_rounds, builder_cases=args.builder_cases, out=args.out)


def main(argv: Optional[list[str]] = None) -> Optional[BenchResult]:
    args = parse_args(argv)
    if args.export_prompts:
        n = export_prompts(args.export_prompts, args.split, args.limit)
        print(f"{n} {args.split} prompts -> {args.export_prompts}")
        return None
    cfg = config_from(args)
    result = run_bench(cfg)
    result.report["config"] = {k: list(v) if isinstance(v, tuple) else v for k, v in asdict(cfg).items()}
    os.makedirs(os.path.dirname(os.path.abspath(cfg.out)), exist_ok=True)
    with open(cfg.out, "w") as f:
        json.dump(result.report, f, indent=2)
    print(format_table(result.report, cfg))
    print(cfg.out)
    return result


if __name__ == "__main__":
    main()
