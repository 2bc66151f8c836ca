"""Where a speculative round's draft side spends its time: the context update, the drafter pass, the tree build
and the verify rows (the `draft:*` labels in speculative/speculator.py `Speculator.propose`), per mode.

    python -m bench.draft_round [--model PATH] [--modes dominotree,chain,ddtree] [--batch 1] [--nodes 16]
        [--context 256] [--rounds 30] [--device cuda|cpu] [--allow-random-drafter]
        [--out bench/results/draft_round.json]

Per mode: an engine with that method (the bundled drafter for SmolLM2 unless --drafter), `--batch` stand-in
sequences with a `--context`-token drafter context, driven by the start-up profile's own round
(speculative/profile.draft_round: the previous round's context update, the draft block, the tree, its verify
rows). 5 warm-up rounds; then `--rounds` rounds timed with the device synchronised around each (median
wall ms per round); then the same rounds under torch.profiler: per label the host time per round and, on CUDA,
the device time of the kernels launched inside it, and the ten kernels with the most device time. Seed 0.
"""
from __future__ import annotations

import argparse
import json
import os
from typing import Optional

import torch
from torch.profiler import ProfilerActivity, profile

from replicas import LLM
from replicas.device import resolve_device
from speculative.profile import draft_round, median_seconds

LABELS = ("draft:context", "draft:drafter", "draft:tree", "draft:rows")


def _device_us(evt) -> float:
    return getattr(evt, "device_time_total", None) or getattr(evt, "cuda_time_total", 0.0)


def _self_device_us(evt) -> float:
    return getattr(evt, "self_device_time_total", None) or getattr(evt, "self_cuda_time_total", 0.0)


def profile_mode(mode: str, args: argparse.Namespace) -> dict:
    torch.manual_seed(0)
    llm = LLM(model=args.model, speculative=mode, drafter=args.drafter, allow_random_drafter=args.allow_random_drafter,
              device=args.device, max_num_seqs=max(8, args.batch), gpu_memory_utilization=0.3, spec_budget=args.nodes)
    try:
        runner, spec = llm.engine.runner, llm.engine.speculator
        cuda = runner.device.type == "cuda"
        hidden = runner.model_config.hidden_size
        aux = [torch.zeros(args.context, hidden, dtype=runner.dtype, device=runner.device) for _ in spec.aux_layers]
        round_, done = draft_round(spec, args.batch, args.nodes, aux, args.context)
        sync = torch.cuda.synchronize if cuda else (lambda: None)
        try:
            wall = median_seconds(round_, runner.device, 5, args.rounds)
            activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
            with profile(activities=activities) as prof:
                for _ in range(args.rounds):
                    round_()
                    sync()
        finally:
            done()
        rows = prof.key_averages()
        labels = {e.key: {"host_ms": e.cpu_time_total / 1e3 / args.rounds,
                          "device_ms": _device_us(e) / 1e3 / args.rounds} for e in rows if e.key in LABELS}
        kernels = sorted((e for e in rows if e.key not in LABELS and _self_device_us(e) > 0),
                         key=_self_device_us, reverse=True)[:10]
        return {"wall_ms_per_round": wall * 1e3,
                "labels": {k: labels.get(k) for k in LABELS},
                "top_kernels": [{"name": e.key[:120], "device_ms_per_round": _self_device_us(e) / 1e3 / args.rounds,
                                 "calls_per_round": e.count / args.rounds} for e in kernels],
                "speculator_enabled": spec.enabled}
    finally:
        llm.shutdown()


def report(res: dict) -> None:
    print(f"\ndraft side per round on {res['device']} (batch {res['batch']}, {res['nodes']} nodes, "
          f"{res['context']}-token context, {res['rounds']} rounds)")
    print(f"{'mode':<12}{'wall ms':>9}" + "".join(f"{k.split(':')[1] + ' host/dev':>24}" for k in LABELS))
    for mode, r in res["modes"].items():
        cells = "".join(f"{v['host_ms']:>12.3f}/{v['device_ms']:<11.3f}" if v else f"{'-':>24}"
                        for v in r["labels"].values())
        print(f"{mode:<12}{r['wall_ms_per_round']:>9.3f}{cells}")
    for mode, r in res["modes"].items():
        print(f"{mode}: top kernels (device ms per round, calls per round)")
        for k in r["top_kernels"]:
            print(f"  {k['device_ms_per_round']:8.3f} {k['calls_per_round']:6.1f}  {k['name']}")


def main(argv: Optional[list[str]] = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="HF folder or .gguf (default: the embedded SmolLM2)")
    ap.add_argument("--drafter", default=None, help="drafter folder (default: the bundled one for the model)")
    ap.add_argument("--allow-random-drafter", action="store_true", help="random drafter (smoke runs only)")
    ap.add_argument("--modes", default="dominotree,chain,ddtree")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--nodes", type=int, default=16)
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--device", default=resolve_device().type, choices=["cuda", "cpu"])
    ap.add_argument("--out", default="bench/results/draft_round.json")
    args = ap.parse_args(argv)
    res = {"device": torch.cuda.get_device_name() if args.device == "cuda" else "CPU", "torch": torch.__version__,
           "seed": 0, "batch": args.batch, "nodes": args.nodes, "context": args.context, "rounds": args.rounds,
           "warmup_rounds": 5, "method": __doc__.strip(),
           "modes": {m: profile_mode(m, args) for m in args.modes.split(",")}}
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)
    report(res)
    return res


if __name__ == "__main__":
    main()
