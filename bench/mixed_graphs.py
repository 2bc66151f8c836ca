"""Mixed-graph benchmark (GPU): what replaying a CUDA graph saves on steps that carry prefill chunks.

    python -m bench.mixed_graphs [--shape smollm2-135m] [--iters 30] [--out bench/results/mixed_graphs.json]

One engine (random bf16 weights of the shape, TP 1, default EngineConfig); each scenario's step is built once
(`StepInput.from_batch` over sequences whose earlier tokens count as cached) and run through the model runner
(`execute`: forward and logits, no sampling) alternately with its mixed graphs and without them (eager), so
both see the same machine state; wall time from the call to the device being idle again (what a request's
TTFT pays for the step), median over --iters of each after 3 warm-up runs of each. Scenarios: a lone prompt
of P new tokens (P = 32, 128, 512, 1024: TTFT at idle), 63 decodes at context 256 beside one 128-token chunk
(a request joining a busy batch), and the 64-decode step alone (a decode graph in both: the floor).
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from bench.engine import fake_batch, make_llm, release
from replicas.scheduler import ScheduledBatch
from replicas.sequence import Sequence
from replicas.step_input import StepInput

# scenario -> groups of (sequences, context, new tokens each)
SCENARIOS = {"prefill_32": [(1, 32, 32)], "prefill_128": [(1, 128, 128)], "prefill_512": [(1, 512, 512)],
             "prefill_1024": [(1, 1024, 1024)], "decode_63_plus_chunk_128": [(63, 256, 1), (1, 128, 128)],
             "decode_64": [(64, 256, 1)]}


def build_step(engine, groups: list[tuple[int, int, int]]) -> tuple[StepInput, list[Sequence]]:
    seqs, new_tokens = [], []
    for count, ctx, new in groups:
        batch, group = fake_batch(engine, count, ctx, new)
        seqs += group
        new_tokens += batch.num_new_tokens
    return StepInput.from_batch(ScheduledBatch(seqs, new_tokens), engine.config.cache.block_size), seqs


def wall_ms(runner, step) -> float:
    torch.cuda.synchronize()
    t = time.perf_counter()
    runner.execute(step)
    torch.cuda.synchronize()
    return (time.perf_counter() - t) * 1e3


def measure(llm, iters: int) -> dict:
    engine, runner = llm.engine, llm.engine.runner
    graphs = runner.graphs
    mixed = graphs.mixed[()]
    out = {}
    for name, groups in SCENARIOS.items():
        step, seqs = build_step(engine, groups)
        times = {"graph": [], "eager": []}
        for i in range(iters + 3):
            for mode in ("graph", "eager"):
                graphs.mixed[()] = mixed if mode == "graph" else {}
                t = wall_ms(runner, step)
                if i >= 3:
                    times[mode].append(t)
        graphs.mixed[()] = mixed
        graphed = graphs.can_run(step)
        release(engine, seqs)
        g, e = statistics.median(times["graph"]), statistics.median(times["eager"])
        out[name] = {"tokens": step.num_tokens, "sequences": len(seqs), "graph_ms": g, "eager_ms": e,
                     "speedup": e / g, "graph_replayed": graphed}
    return out


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", default="smollm2-135m")
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--out", default="bench/results/mixed_graphs.json")
    args = ap.parse_args(argv)
    llm = make_llm(args.shape, device="cuda", gpu_memory_utilization=0.5)
    try:
        results = measure(llm, args.iters)
    finally:
        llm.shutdown()
    doc = {"device": torch.cuda.get_device_name(), "shape": args.shape, "iters": args.iters, "warmup": 3,
           "method": "runner.execute wall ms, device synchronised, graph and eager interleaved, medians",
           "scenarios": results}
    with open(args.out, "w") as f:
        json.dump(doc, f, indent=1)
    print(f"{'scenario':28} {'tokens':>6} {'eager ms':>9} {'graph ms':>9} {'speedup':>8}")
    for name, r in results.items():
        print(f"{name:28} {r['tokens']:6d} {r['eager_ms']:9.2f} {r['graph_ms']:9.2f} {r['speedup']:7.1f}x"
              + ("" if r["graph_replayed"] else "  (no graph)"))
    return doc


if __name__ == "__main__":
    main()
