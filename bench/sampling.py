"""Random-row sampling cost: the sampler's torch ops against the fused Gumbel-max kernel (replicas/kernels/gumbel.py).

    python -m bench.sampling [--device cuda] [--rows 1,17,256,544,4352] [--vocab 49152] [--seconds 1]
        [--repeats 3] [--out bench/results/sampling.json]
    python -m bench.sampling --device cpu --rows 1,8 --vocab 512 --seconds 0.05 --repeats 2   (smoke: torch only)

A cell is one `Sampler.forward` over R rows of float32 logits [R, V], every row at temperature 1 with its own
seed and position (a plain decode batch of R requests, or a verify step of R / 17 requests with 16-node trees),
timed back to back for --seconds after a warm-up, --repeats times, the two paths interleaved; CUDA time by
events. Counted: microseconds per call (median of the repeats) and the speedup; also whether both paths gave the
same tokens. The fused kernel needs CUDA, so on the CPU only the torch ops run.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Optional

import torch

from bench.provenance import REPO, provenance
from replicas.sampler import Sampler
from replicas.sampling_batch import SamplingBatch
from replicas.sampling_params import SamplingParams


def make_batch(rows: int, vocab: int, device: torch.device) -> SamplingBatch:
    params = [SamplingParams(temperature=1.0)] * rows
    empty = [[] for _ in range(rows)]
    return SamplingBatch.build(params, [1000 + i for i in range(rows)], [50 + i % 17 for i in range(rows)], empty,
                               empty, (0,), vocab, device)


def time_calls(sampler: Sampler, logits: torch.Tensor, batch: SamplingBatch, seconds: float) -> float:
    """Microseconds per call, back to back for `seconds` (CUDA events on a GPU)."""
    cuda = logits.is_cuda
    for _ in range(3):
        sampler(logits, batch)
    calls, elapsed = 0, 0.0
    while elapsed < seconds:
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
        t0 = time.perf_counter()
        for _ in range(10):
            sampler(logits, batch)
        if cuda:
            end.record()
            end.synchronize()
            elapsed += start.elapsed_time(end) / 1e3
        else:
            elapsed += time.perf_counter() - t0
        calls += 10
    return elapsed / calls * 1e6


def main(argv: Optional[list[str]] = None) -> dict:
    argv = sys.argv[1:] if argv is None else argv
    p = argparse.ArgumentParser(prog="python -m bench.sampling", description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=("cuda", "cpu"))
    p.add_argument("--rows", type=lambda s: [int(x) for x in s.split(",")], default="1,17,256,544,4352")
    p.add_argument("--vocab", type=int, default=49152)
    p.add_argument("--seconds", type=float, default=1.0)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=Path(REPO) / "bench" / "results" / "sampling.json")
    args = p.parse_args(argv)
    device = torch.device(args.device)
    paths = {"torch": Sampler(fused=False)}
    if device.type == "cuda":
        paths["fused"] = Sampler(fused=True)
    gen = torch.Generator().manual_seed(args.seed)
    cells = []
    for rows in args.rows:
        logits = (torch.randn(rows, args.vocab, generator=gen) * 3).to(device)
        batch = make_batch(rows, args.vocab, device)
        tokens = {name: s(logits, batch).token_ids.cpu() for name, s in paths.items()}
        us = {name: [] for name in paths}
        for _ in range(args.repeats):
            for name, sampler in paths.items():
                us[name].append(time_calls(sampler, logits, batch, args.seconds))
        cell = {"rows": rows, "us_each_repeat": us, "us_median": {k: statistics.median(v) for k, v in us.items()},
                "same_tokens": all(torch.equal(t, tokens["torch"]) for t in tokens.values())}
        if "fused" in us:
            cell["speedup"] = cell["us_median"]["torch"] / cell["us_median"]["fused"]
        cells.append(cell)
        print(f"rows {rows:>5}: " + "  ".join(f"{k} {v:9.1f} us" for k, v in cell["us_median"].items())
              + (f"  x{cell['speedup']:.1f}" if "speedup" in cell else "") + f"  same tokens {cell['same_tokens']}",
              flush=True)
    result = {"device": str(device), "vocab": args.vocab, "cells": cells, "method": __doc__,
              "provenance": provenance("bench.sampling", argv, str(device), args.seed,
                                       warm_up="3 calls per cell and path before its clock starts",
                                       counted="Sampler.forward calls back to back, per path, interleaved repeats")}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {args.out}")
    return result


if __name__ == "__main__":
    main()
