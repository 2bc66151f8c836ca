"""Drafter training throughput: the product Trainer (speculative/train_loop.py) per configuration, its own log.

    python -m bench.drafter_train [--device auto] [--configs online:16:32,cached:16:32] [--steps 30]
        [--log-every 10] [--pairs 2048] [--seed 0] [--out bench/results/drafter_train.json]
    python -m bench.drafter_train --device cpu --layers 2 --configs online:2:4,cached:2:4 --steps 4 --log-every 2
        --pairs 16   (smoke)

Target: the bundled drafter's target shape (`smollm2-135m` in bench/shapes.py) with random bf16 weights (float32
on the CPU): a step's time does not depend on weight values. Drafter: the bundled one's shape (2 layers, block
16). Pairs: synthetic token ids with the regenerated ShareGPT data's lengths (prompt
20-300, response 60-512 tokens, uniform), so batches pad as real ones do.

A configuration is `features:batch:anchors[:compile[:sparse]][:fullvocab]` (features `online` or `cached`;
`sparse`: a compiled loss attends through the FlexAttention block mask, `--sparse-attention`, instead of the dense
boolean mask; `fullvocab`: the vocabulary loss on the batch's whole logits, `--vocab-loss full`, the baseline of the
chunked one). Each runs `--steps` steps through `Trainer.train`; its first logging window (warm-up: allocator, cuDNN
plans, the compile) is dropped and the rest averaged, each kept under `repeats` (a window of at least 5 s on the
GPU: `--log-every` of about 150 steps there). Counted, as the Trainer logs them: step_ms, MFU (the
drafter's forward and backward FLOPs at each batch's longest sequence, its attention over the (query, key) pairs
the mask lets through, over the device's bf16 dense peak; the target's forward not counted), sequence and query
tokens per second, peak memory; for `cached`, the seconds the feature cache took to build.
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional

import torch

from bench.provenance import REPO, provenance
from bench.shapes import SHAPES

SHAPE = "smollm2-135m"                  # the bundled drafter's target (speculative/drafters/smollm2-135m-instruct)
KEYS = ("step_ms", "mfu", "seq_tokens_per_s", "query_tokens_per_s")


def random_target(device: torch.device, layers: Optional[int]):
    """The bundled drafter's target shape (bench.shapes), random weights, as a transformers model."""
    from transformers import AutoConfig, AutoModelForCausalLM
    shape = {k: v for k, v in SHAPES[SHAPE].items() if k != "architectures"}
    if layers:
        shape["num_hidden_layers"] = layers
    hf = AutoConfig.for_model(**shape)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    return AutoModelForCausalLM.from_config(hf).to(device, dtype), hf


def synthetic_pairs(count: int, seed: int) -> list:
    rng = random.Random(seed)
    vocab = SHAPES[SHAPE]["vocab_size"]
    return [([rng.randrange(vocab) for _ in range(rng.randint(20, 300))],
             [rng.randrange(vocab) for _ in range(rng.randint(60, 512))]) for _ in range(count)]


OPTIONS = ("compile", "sparse", "fullvocab")


def parse_config(text: str) -> dict:
    parts = text.split(":")
    options = parts[3:]
    if len(parts) < 3 or parts[0] not in ("online", "cached") or not set(options) <= set(OPTIONS) \
            or len(set(options)) != len(options) or ("sparse" in options and "compile" not in options):
        raise argparse.ArgumentTypeError(f"{text!r}: want features:batch:anchors[:compile[:sparse]][:fullvocab]")
    return {"target_features": parts[0], "batch_size": int(parts[1]), "anchors_per_seq": int(parts[2]),
            "compile": "compile" in options, "sparse_attention": "sparse" in options,
            "vocab_loss": "full" if "fullvocab" in options else "chunked"}


def run_config(model, hf, pairs, device, spec: dict, steps: int, log_every: int, seed: int) -> dict:
    from replicas.config import ModelConfig
    from speculative.drafter import DominoDrafter, DrafterConfig
    from speculative.train_data import PairBatcher
    from speculative.train_loop import HFTarget, TrainConfig, Trainer
    cfg = TrainConfig(steps=steps, seq_len=1024, log_every=log_every, checkpoint_every=10 ** 9, warmup_steps=10,
                      seed=seed, **spec)
    dcfg = DrafterConfig.for_target(ModelConfig.from_hf(hf.to_dict()), num_layers=2, block_size=16)
    torch.manual_seed(seed)
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as out:
        trainer = Trainer(DominoDrafter(dcfg).to(device), HFTarget(model, dcfg.target_layer_ids),
                          PairBatcher(pairs, cfg.batch_size, cfg.seq_len, cfg.anchors_per_seq, seed=seed), cfg, out)
        records = trainer.train()
    timed = records[1:]
    result = {**spec, "steps": steps, "windows": len(timed),
              **{k: statistics.mean(r[k] or 0.0 for r in timed) for k in KEYS},
              "repeats": [{k: r[k] for k in KEYS} for r in timed],              # each counted window's figures
              "peak_memory_gib": records[-1]["peak_memory_gib"],
              "feature_cache_s": trainer.feature_seconds,
              "feature_cache_gib": trainer.features.nbytes / 2 ** 30 if trainer.features is not None else None,
              "wall_s": time.perf_counter() - start}
    del trainer
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    return result


def report(rows: list[dict], device: torch.device, hf, args: argparse.Namespace, argv: list[str]) -> dict:
    """The result over the configurations run so far, with the speed ratios between those that pair up."""
    by = {(r["target_features"], r["batch_size"], r["anchors_per_seq"], r["compile"]): r for r in rows
          if not r["sparse_attention"] and r["vocab_loss"] == "chunked"}
    speedup = {f"b{b}_a{a}{'_compiled' if c else ''}": by[("online", b, a, c)]["step_ms"] / r["step_ms"]
               for (f, b, a, c), r in by.items() if f == "cached" and ("online", b, a, c) in by}
    setting = ("target_features", "batch_size", "anchors_per_seq", "compile", "sparse_attention")
    chunked = {tuple(r[k] for k in setting): r for r in rows if r["vocab_loss"] == "chunked"}
    vocab_speedup = {"_".join(str(v) for v in key): r["step_ms"] / chunked[key]["step_ms"]
                     for r in rows if r["vocab_loss"] == "full" and (key := tuple(r[k] for k in setting)) in chunked}
    return {"device": str(device), "target": f"{SHAPE} shape (bench.shapes), random weights",
            "target_layers": hf.num_hidden_layers, "pairs": args.pairs, "configs": rows,
            "cached_over_online_speed": speedup, "chunked_over_full_vocab_speed": vocab_speedup, "method": __doc__,
            "provenance": provenance("bench.drafter_train", argv, str(device), args.seed,
                                     warm_up=f"the first logging window ({args.log_every} steps) of each "
                                             "configuration is dropped",
                                     counted="the Trainer's own log windows after the warm-up, averaged "
                                             "(each window's figures under `repeats`)")}


def main(argv: Optional[list[str]] = None) -> dict:
    argv = sys.argv[1:] if argv is None else argv
    p = argparse.ArgumentParser(prog="python -m bench.drafter_train", description=__doc__.split("\n")[0])
    p.add_argument("--device", default="auto", choices=("auto", "cuda", "cpu"))
    p.add_argument("--configs", type=lambda s: [parse_config(c) for c in s.split(",")],
                   default="online:16:32,cached:16:32")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--log-every", type=int, default=10)
    p.add_argument("--pairs", type=int, default=2048)
    p.add_argument("--layers", type=int, default=None, help="target layers (default: the shape's)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=Path(REPO) / "bench" / "results" / "drafter_train.json")
    args = p.parse_args(argv)
    if args.steps < 2 * args.log_every:
        p.error("--steps must be at least two logging windows (the first is the warm-up)")
    cuda = torch.cuda.is_available() if args.device == "auto" else args.device == "cuda"
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    model, hf = random_target(device, args.layers)
    pairs = synthetic_pairs(args.pairs, args.seed)
    rows = []
    for spec in args.configs:
        row = run_config(model, hf, pairs, device, spec, args.steps, args.log_every, args.seed)
        rows.append(row)
        mfu = f"{row['mfu']:.2%}" if row["mfu"] else "n/a"
        kind = (" compiled" if row["compile"] else "") + (" sparse" if row["sparse_attention"] else "") \
            + (" full-vocab" if row["vocab_loss"] == "full" else "")
        print(f"{row['target_features']:>6} b{row['batch_size']} A{row['anchors_per_seq']}{kind}: "
              f"{row['step_ms']:8.1f} ms/step  mfu {mfu}  {row['seq_tokens_per_s']:,.0f} seq tok/s  "
              f"{row['query_tokens_per_s']:,.0f} query tok/s", flush=True)
        result = report(rows, device, hf, args, argv)
        args.out.parent.mkdir(parents=True, exist_ok=True)      # after every configuration: a cut run keeps them
        args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"cached / online step speed: {result['cached_over_online_speed']}; chunked / full vocabulary loss: "
          f"{result['chunked_over_full_vocab_speed']}; wrote {args.out}")
    return result


if __name__ == "__main__":
    main()
