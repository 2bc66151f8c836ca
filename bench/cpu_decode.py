"""CPU decode with quantized weights (one run, a few minutes on 2 cores): the default model (SmolLM2-135M-Instruct
Q4_1 GGUF) with `quantization=auto` (linear weights stay Q4_1, replicas/kernels/quant_cpu.py) against
`quantization=none` (dequantized to float32), in one process.

    python -m bench.cpu_decode [--out bench/results/cpu_decode.json] [--tokens 256] [--reps 3]

(a) Batch-1 decode tok/s: one held-out ShareGPT prompt (bench/data/sharegpt_heldout.json, the first), T=0,
ignore_eos, --tokens generated tokens per cell; counted = generated tokens / wall time of `LLM.generate`
(the prompt's prefill is inside the cell). One warm-up cell per path, then --reps rounds alternating the paths
(quantized, dequantized), so machine noise hits both; reported: every cell and the median per path.
(b) Greedy agreement: the first --prompts held-out prompts in the chat template, T=0, --agree-tokens tokens;
per prompt the first position where the paths differ and the dequantized path's top-2 logprob gap there
(`logprobs=2`); reported: identical outputs, tokens matching before the first difference (of the dequantized
outputs' tokens), and the gaps.
(c) Perplexity of both paths on a fixed text: Python's own LICENSE.txt (the stdlib directory, or
/usr/lib/python3.X), its first --ppl-tokens tokens, teacher-forced in one prefill; the quantized path runs the
kernel for every row there (its decode numerics) rather than dequantizing above MAX_ROWS.
Seed 0; torch threads as the engine leaves them.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from datetime import datetime, timezone

import torch

from bench.provenance import source
from replicas import LLM, SamplingParams
from replicas.kernels import quant_cpu

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PATHS = ("auto", "none")


def license_text() -> tuple[str, str]:
    for d in (os.path.dirname(os.__file__), f"/usr/lib/python{sys.version_info.major}.{sys.version_info.minor}"):
        path = os.path.join(d, "LICENSE.txt")
        if os.path.isfile(path):
            with open(path, encoding="utf-8") as f:
                return path, f.read()
    raise FileNotFoundError("Python's LICENSE.txt is not installed here")


def prompt_logits(llm: LLM, ids: list[int]) -> torch.Tensor:
    """[len(ids), vocab] float32 logits, on the CPU, of one teacher-forced prefill through the engine's runner."""
    from replicas.sequence import Sequence
    from replicas.scheduler import ScheduledBatch
    from replicas.step_input import StepInput
    engine = llm.engine
    seq = Sequence("ppl", 0, ids, SamplingParams(temperature=0.0, max_tokens=1), 0, 0.0)
    engine.block_manager.allocate(seq, len(ids))
    batch = ScheduledBatch([seq], [len(ids)])
    step = StepInput.from_batch(batch, engine.config.cache.block_size)
    step.sample_indices = torch.arange(len(ids)).numpy()
    try:
        with torch.no_grad():
            return engine.runner.execute(step).float().cpu()
    finally:
        engine.block_manager.free(seq)


def perplexity(llm: LLM, ids: list[int], kernel_rows: bool) -> float:
    saved = quant_cpu.MAX_ROWS
    quant_cpu.MAX_ROWS = len(ids) if kernel_rows else saved
    try:
        logits = prompt_logits(llm, ids)
    finally:
        quant_cpu.MAX_ROWS = saved
    nll = torch.nn.functional.cross_entropy(logits[:-1], torch.tensor(ids[1:]))
    return float(torch.exp(nll))


def provenance(argv: list[str]) -> dict:
    code = source()
    return {"date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "commit": code["commit"], "dirty": code["tree_dirty"],
            "machine": f"{platform.machine()}, {os.cpu_count()} CPU cores, torch {torch.__version__} "
                       f"({torch.backends.cpu.get_cpu_capability()}), load average {os.getloadavg()[0]:.1f} at start",
            "command": "python -m bench.cpu_decode " + " ".join(argv), "seed": 0}


def main(argv: list[str] | None = None) -> dict:
    argv = sys.argv[1:] if argv is None else argv
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=os.path.join(REPO, "bench/results/cpu_decode.json"))
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--agree-tokens", type=int, default=32)
    ap.add_argument("--ppl-tokens", type=int, default=512)
    args = ap.parse_args(argv)
    prov = provenance(argv)
    with open(os.path.join(REPO, "bench/data/sharegpt_heldout.json"), encoding="utf-8") as f:
        heldout = json.load(f)
    llms = {p: LLM(quantization=p, seed=0) for p in PATHS}
    tok = llms["none"].tokenizer
    decode_prompt = tok.encode_chat([{"role": "user", "content": heldout[0]}])
    cell = SamplingParams(temperature=0.0, max_tokens=args.tokens, ignore_eos=True)

    def run_cell(path: str) -> float:
        t = time.perf_counter()
        out = llms[path].generate([decode_prompt], cell)[0].outputs[0]
        return len(out.token_ids) / (time.perf_counter() - t)

    for p in PATHS:
        run_cell(p)                                     # warm-up
    cells: dict[str, list[float]] = {p: [] for p in PATHS}
    for _ in range(args.reps):
        for p in PATHS:
            cells[p].append(round(run_cell(p), 2))
    tps = {p: statistics.median(v) for p, v in cells.items()}
    print(f"batch-1 decode tok/s: quantized {cells['auto']}, dequantized {cells['none']}, "
          f"speed-up {tps['auto'] / tps['none']:.2f}x", flush=True)

    prompts = [tok.encode_chat([{"role": "user", "content": q}]) for q in heldout[:args.prompts]]
    sp = SamplingParams(temperature=0.0, max_tokens=args.agree_tokens, logprobs=2)
    got = [o.outputs[0] for o in llms["auto"].generate(prompts, sp)]
    want = [o.outputs[0] for o in llms["none"].generate(prompts, sp)]
    first_diff, gaps, matched = [], [], 0
    for a, b in zip(got, want):
        k = next((j for j in range(min(len(a.token_ids), len(b.token_ids))) if a.token_ids[j] != b.token_ids[j]),
                 None)
        if k is None and len(a.token_ids) != len(b.token_ids):
            k = min(len(a.token_ids), len(b.token_ids))
        first_diff.append(k)
        matched += len(b.token_ids) if k is None else k
        if k is not None and k < len(b.token_ids):
            top = sorted((lp.logprob for lp in b.logprobs[k].values()), reverse=True)
            gaps.append(round(top[0] - top[1], 4) if len(top) > 1 else None)
    agreement = {"prompts": len(prompts), "identical": sum(k is None for k in first_diff),
                 "matched_token_fraction": round(matched / sum(len(b.token_ids) for b in want), 4),
                 "first_difference": first_diff, "dequantized_top2_gap_there": gaps}
    print(f"greedy agreement: {agreement}", flush=True)

    text_path, text = license_text()
    ids = tok.encode(text)[:args.ppl_tokens]
    ppl = {"text": text_path, "tokens": len(ids), "quantized": round(perplexity(llms["auto"], ids, True), 4),
           "dequantized": round(perplexity(llms["none"], ids, False), 4)}
    print(f"perplexity: {ppl}", flush=True)
    for llm in llms.values():
        llm.shutdown()
    result = {"provenance": {**prov, "warm_up": "one cell per path",
                             "counted": "generated tokens / wall time of LLM.generate, batch 1, prefill inside"},
              "decode_tok_s": {"quantized": tps["auto"], "dequantized": tps["none"], "cells": cells,
                               "speedup": round(tps["auto"] / tps["none"], 2), "llama_cpp_reference": 135},
              "greedy_agreement": agreement, "perplexity": ppl,
              "kernel": "built" if quant_cpu.available() else "unavailable (dequantized per matmul)"}
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)
    return result


if __name__ == "__main__":
    main()
