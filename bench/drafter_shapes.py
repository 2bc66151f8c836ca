"""Drafter depth and width by measurement: tau against draft cost for DominoTree drafters of several shapes,
trained alike on the same data.

    python -m bench.drafter_shapes --pairs PAIRS.jsonl [--regenerate 4000 --regenerate-seconds 90]
        [--model PATH] [--layers 1,2,3] [--widths 1536] [--steps 1000] [--batch-size 16] [--anchors-per-seq 128]
        [--lr 6e-4] [--seed 0] [--train-args "..."] [--work build/drafter_shapes]
        [--prompts bench/data/sharegpt_heldout.json] [--num-prompts 8] [--max-tokens 128] [--budget 16]
        [--min-cell-seconds 5] [--repeats 2] [--max-seconds 0] [--resume] [--out bench/results/drafter_shapes.json]

Data: --pairs as `python -m speculative.train` reads it; with --regenerate N the target first answers N ShareGPT
train-split prompts through tidal's engine into it (greedy, as the bundled drafter's data), once for every shape.
Training: every shape from scratch with the same pairs, steps, batch, anchors, learning rate and seed (`python -m
speculative.train --launcher local` in a subprocess, one device), so shapes differ only in depth (`--layers`:
transformer layers, and as many target layers read) and width (`--widths`: the MLP's hidden size).
Measurement, per trained drafter: DominoTree at batch 1, T=0, --budget nodes in every round (the fixed policy),
over held-out ShareGPT prompts in a closed loop as in bench.speculative (each cell at least --min-cell-seconds,
--repeats times, each repeat kept): tau = 1 + accepted / rounds, accept rate by depth, tok/s against the plain
engine's in the same call (`speedup_b1`), the share of requests whose tokens equal plain decoding's, and from the
speculative engine's start-up profile the draft ms (context update, drafter pass, tree build) at batch 1 and 8
and the verify ms of 1 + budget tokens at batch 1. `bound_speedup_b1` = tau x plain_ms / (draft_ms + verify_ms):
what the shape would give if a round cost only its two parts. `choice`: the shape with the highest measured
speedup_b1 (each shape's against the plain engine of its own call). The JSON is written after every shape;
--resume keeps the shapes already in --out when the settings match and measures the others; --max-seconds stops
before a shape whose training would not fit.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from dataclasses import replace
from typing import Optional

import torch

from bench.provenance import REPO, provenance, repo_path
from bench.speculative import (DEFAULT_PROMPTS, BenchConfig, chat_prompts, count_graph_replays, drive, engine_kwargs,
                               free_memory, sampling)
from bench.speculative_report import Run
from replicas import LLM
from speculative.profile import measure_verify_profile
from speculative.train_loop import last_log_record

# Settings that must match for --resume to keep a shape measured by an earlier call.
SAME_RUN_KEYS = ("model", "pairs_lines", "steps", "batch_size", "anchors_per_seq", "lr", "seed", "train_args",
                 "prompts", "num_prompts", "max_tokens", "budget")
# What a shape's training needs beyond its steps (compile, target features), for --max-seconds.
TRAIN_START_S = 90.0
EVAL_S = 60.0


def shape_name(layers: int, width: int) -> str:
    return f"L{layers}-W{width}"


def regenerate_pairs(args) -> Optional[dict]:
    from speculative.train_data import count_lines, passes_of, regenerate_to_file, sharegpt_prompts
    if not args.regenerate or count_lines(args.pairs) >= args.regenerate:
        return None
    os.makedirs(os.path.dirname(os.path.abspath(args.pairs)), exist_ok=True)
    stats = regenerate_to_file(args.pairs, passes_of(sharegpt_prompts("train", limit=args.regenerate), 1, 1.0),
                               args.model, args.max_response, seconds=args.regenerate_seconds)
    free_memory()
    return stats


def train_shape(args, layers: int, width: int, deadline: Optional[float]) -> dict:
    """Train one shape in a subprocess (continuing its folder's checkpoint if an earlier call stopped it)."""
    folder = os.path.join(args.work, shape_name(layers, width))
    cmd = [sys.executable, "-m", "speculative.train", "--pairs", args.pairs, "--out", folder, "--layers", str(layers),
           "--intermediate-size", str(width), "--steps", str(args.steps), "--batch-size", str(args.batch_size),
           "--anchors-per-seq", str(args.anchors_per_seq), "--lr", str(args.lr), "--seed", str(args.seed),
           "--launcher", "local", "--device", args.device, *args.train_args.split()]
    if args.model:
        cmd += ["--target", args.model]
    if os.path.isdir(os.path.join(folder, "checkpoints")):
        cmd += ["--resume", folder]
    if deadline:
        cmd += ["--max-seconds", str(max(1.0, deadline - time.time() - EVAL_S))]
    started = time.perf_counter()
    subprocess.run(cmd, check=True, cwd=REPO)
    drafter = os.path.join(folder, "drafter")
    last = last_log_record(drafter if os.path.isdir(drafter) else folder) or {}
    return dict(folder=drafter, finished=os.path.isdir(drafter), seconds=round(time.perf_counter() - started, 1),
                steps=last.get("step"), tokens_seen=last.get("tokens_seen"), final_loss=last.get("final_loss"),
                accept_len_teacher_forced=last.get("accept_len"), mfu=last.get("mfu"), step_ms=last.get("step_ms"))


def measure_engine(cfg: BenchConfig, mode: str, prompts: list[list[int]], warm: list[list[int]],
                   profile_batches: tuple[int, ...] = ()) -> dict:
    """One engine (plain or DominoTree with cfg.drafter) at batch 1, T=0: its repeats, and for a speculative one
    the start-up profile's draft and verify ms and the drafter's parameter count."""
    llm = LLM(**engine_kwargs(cfg, mode))
    try:
        engine = llm.engine
        replays = count_graph_replays(engine)
        drive(llm, warm, sampling(cfg, 0.0, len(warm), 32), 1, f"warm-{mode}", replays)
        repeats = [drive(llm, prompts, sampling(cfg, 0.0, len(prompts), cfg.max_tokens), 1, f"{mode}-r{r}", replays,
                         cfg.min_cell_seconds) for r in range(cfg.repeats)]
        run = Run.merge(repeats)
        out = dict(tok_s=run.tok_s, repeats=run.repeats, outputs=run.outputs)
        if mode != "plain":
            spec, n = engine.speculator, cfg.spec_budget
            profile = measure_verify_profile(engine.runner, spec, profile_batches, [n], warmup=3, iters=20)
            out.update(tau=1 + run.accepted / run.drafts if run.drafts else None, rounds=run.drafts,
                       accept_rate_by_depth=[c / run.drafts for c in run.by_position] if run.drafts else [],
                       draft_ms={f"b{b}": 1e3 * profile.draft_time(b) for b in profile_batches
                                 if b in profile.draft_seconds},
                       verify_ms_b1=1e3 * profile.step_time(1, n), plain_ms_b1=1e3 * profile.step_time(1, 0),
                       drafter_parameters=sum(p.numel() for p in spec.drafter.parameters()))
        return out
    finally:
        llm.shutdown()
        free_memory()


def shape_result(trained: dict, measured: dict, plain: dict) -> dict:
    outputs = measured.pop("outputs")
    draft, verify, plain_ms = measured["draft_ms"].get("b1"), measured["verify_ms_b1"], measured["plain_ms_b1"]
    tau = measured["tau"]
    return dict(train=trained, **measured, plain_tok_s_b1=plain["tok_s"],
                speedup_b1=measured["tok_s"] / plain["tok_s"],
                bound_speedup_b1=tau * plain_ms / (draft + verify) if tau and draft else None,
                outputs_identical_plain=sum(a == b for a, b in zip(outputs, plain["outputs"])) / len(outputs))


def choose(shapes: dict) -> Optional[dict]:
    measured = {k: v for k, v in shapes.items() if v.get("speedup_b1") is not None}
    if not measured:
        return None
    best = max(measured, key=lambda k: measured[k]["speedup_b1"])
    return dict(shape=best, speedup_b1=measured[best]["speedup_b1"], tau=measured[best]["tau"],
                rule="the highest measured speedup_b1 (tok/s at batch 1 over plain decoding's, same call)")


def run_bench(args, argv: list[str]) -> dict:
    from replicas.loaders import load_checkpoint
    from speculative.train_data import count_lines
    started = time.time()
    deadline = started + args.max_seconds if args.max_seconds else None
    regenerated = regenerate_pairs(args)
    settings = dict(model=args.model, pairs=args.pairs, pairs_lines=count_lines(args.pairs), steps=args.steps,
                    batch_size=args.batch_size, anchors_per_seq=args.anchors_per_seq, lr=args.lr, seed=args.seed,
                    train_args=args.train_args, prompts=repo_path(args.prompts), num_prompts=args.num_prompts,
                    max_tokens=args.max_tokens, budget=args.budget, min_cell_seconds=args.min_cell_seconds,
                    repeats=args.repeats)
    report: dict = dict(settings=settings, shapes={})
    if args.resume and os.path.exists(args.out):
        with open(args.out) as f:
            earlier = json.load(f)
        mismatch = [k for k in SAME_RUN_KEYS if earlier.get("settings", {}).get(k) != settings[k]]
        if mismatch:
            raise SystemExit(f"--resume: {args.out} was measured with other settings ({', '.join(mismatch)})")
        report["shapes"] = earlier.get("shapes", {})

    tokenizer = load_checkpoint(args.model).tokenizer
    with open(args.prompts, encoding="utf-8") as f:
        eligible, _ = chat_prompts(tokenizer, json.load(f), 1024)
    prompts, warm = eligible[:args.num_prompts], eligible[args.num_prompts:args.num_prompts + 4]
    # batches: the engines' max_num_seqs (8, for the draft profile at batch 8); every run keeps one in flight
    cfg = BenchConfig(model=args.model, batches=(1, 8), temps=(0.0,), num_prompts_b1=args.num_prompts,
                      max_tokens=args.max_tokens, device=args.device, seed=args.seed, spec_budget=args.budget,
                      spec_policy="fixed", min_cell_seconds=args.min_cell_seconds, repeats=args.repeats)
    plain = measure_engine(cfg, "plain", prompts, warm)
    print(f"plain  b1 {plain['tok_s']:8.1f} tok/s", flush=True)
    for layers, width in [(l, w) for l in args.layers for w in args.widths]:
        name = shape_name(layers, width)
        if name in report["shapes"]:
            continue
        if deadline and deadline - time.time() < TRAIN_START_S + EVAL_S:
            print(f"--max-seconds: {name} and later shapes left for --resume", flush=True)
            break
        trained = train_shape(args, layers, width, deadline)
        if not trained["finished"]:
            print(f"{name}: training stopped at step {trained['steps']}; --resume continues it", flush=True)
            break
        measured = measure_engine(replace(cfg, drafter=trained["folder"]), "dominotree", prompts, warm,
                                  profile_batches=(1, 8))
        trained["folder"] = repo_path(trained["folder"])
        s = report["shapes"][name] = dict(layers=layers, intermediate_size=width,
                                          **shape_result(trained, measured, plain))
        print(f"{name} tau {s['tau']:.2f}  draft {s['draft_ms']['b1']:.2f} ms  speedup_b1 {s['speedup_b1']:.2f}"
              f"  bound {s['bound_speedup_b1']:.2f}", flush=True)
        write(args, report, plain, regenerated, argv)
    return write(args, report, plain, regenerated, argv)


def write(args, report: dict, plain: dict, regenerated: Optional[dict], argv: list[str]) -> dict:
    report["plain"] = {k: v for k, v in plain.items() if k != "outputs"}
    report["choice"] = choose(report["shapes"])
    if regenerated:
        report["regeneration"] = regenerated
    report["method"] = __doc__
    report["provenance"] = provenance(
        "bench.drafter_shapes", argv, "cuda" if torch.cuda.is_available() and args.device != "cpu" else "cpu",
        args.seed, warm_up="4 requests per engine before its runs",
        counted="generated tokens over each run's wall time (prefill included); tau from the engine's counters")
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(report, f, indent=2)
    return report


def format_table(report: dict) -> str:
    rows = ["| shape | parameters | tau (b1, T=0) | draft ms b1 / b8 | verify ms b1 | speedup b1 | bound b1 | "
            "train tokens |", "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for name, s in report["shapes"].items():
        draft = s["draft_ms"]
        rows.append(f"| {name} | {s['drafter_parameters'] / 1e6:.1f}M | {s['tau']:.2f} | {draft.get('b1', 0):.2f} / "
                    f"{draft.get('b8', 0):.2f} | {s['verify_ms_b1']:.2f} | {s['speedup_b1']:.2f} | "
                    f"{s['bound_speedup_b1']:.2f} | {s['train']['tokens_seen']} |")
    return "\n".join(rows)


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.drafter_shapes", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="HF folder or .gguf (default: the embedded SmolLM2)")
    p.add_argument("--pairs", required=True, help="jsonl of {prompt_ids, response_ids} (speculative.train's)")
    p.add_argument("--regenerate", type=int, default=0, help="answer this many train-split prompts into --pairs")
    p.add_argument("--regenerate-seconds", type=float, default=0.0, help="stop regenerating after this long")
    p.add_argument("--max-response", type=int, default=512)
    p.add_argument("--layers", type=_ints, default=[1, 2, 3], help="depths to compare (transformer layers)")
    p.add_argument("--widths", type=_ints, default=[1536], help="MLP widths to compare")
    p.add_argument("--steps", type=int, default=1000)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--anchors-per-seq", type=int, default=128)
    p.add_argument("--lr", type=float, default=6e-4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--train-args", default="", help="further speculative.train flags, the same for every shape")
    p.add_argument("--device", default="auto", choices=("auto", "cuda", "cpu"))
    p.add_argument("--work", default="build/drafter_shapes", help="training folders, one per shape")
    p.add_argument("--prompts", default=DEFAULT_PROMPTS, help="held-out prompts (JSON list of strings)")
    p.add_argument("--num-prompts", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--budget", type=int, default=16, help="draft tree nodes per round")
    p.add_argument("--min-cell-seconds", type=float, default=5.0)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--max-seconds", type=float, default=0.0, help="> 0: stop before a shape that would not fit")
    p.add_argument("--resume", action="store_true", help="keep the shapes already measured in --out")
    p.add_argument("--out", default="bench/results/drafter_shapes.json")
    return p.parse_args(argv)


def main(argv: Optional[list[str]] = None) -> dict:
    argv = list(argv if argv is not None else sys.argv[1:])
    args = parse_args(argv)
    report = run_bench(args, argv)
    print(format_table(report))
    if report["choice"]:
        print(f"choice: {report['choice']['shape']}")
    print(args.out)
    return report


if __name__ == "__main__":
    main()
