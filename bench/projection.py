"""Projected DominoTree speedups at a larger target: `python -m bench.speculative --projection llama3-8b`.

A projection, not a measurement of speculation at that size: the target runs with random bf16 weights
(`load_format="dummy"`) and the drafter with random weights, so nothing is accepted there. What is measured at
the target's shape, per batch size b, with the engine the GPU serves:

    plain_ms    one plain decode step (the start-up profile's timer, graphed where the engine graphs it)
    verify_ms   the target's forward over b x (1 + nodes) tree tokens
    draft_ms    the drafting half of a round (context update, drafter pass, tree build, verify rows)
    round_ms    the engine's whole round (the median decode-only round at exactly b)

as bench/round_cost.py's `round_cost` measures them.

The drafter is the bundled drafter's shape scaled to the target: its layer count and block size, the target's
widths, and the head's GRU and correction rank at hidden/4 and hidden/16 (`DrafterConfig.for_target`). The
projected speedup at batch b and temperature t is tau_t x plain_ms / round_ms, with tau_t the DominoTree tau
measured on the real SmolLM2 pair in the same run (a per-request decode rate ratio; prefill left out): it
assumes the larger pair accepts as the small one does.
"""
from __future__ import annotations

import json
import os
import random
import shutil
import tempfile
from typing import Optional

import torch

from bench.round_cost import RoundLog, round_cost
from bench.shapes import SHAPES, write_shape
from replicas import LLM, SamplingParams
from replicas.config import ModelConfig
from speculative.drafter import DominoDrafter, DrafterConfig

ROUNDS = 64                 # decode tokens per request in the timed closed loop (ignore EOS)
PROMPT_TOKENS = 256


def scaled_drafter(target_folder: str, like: Optional[str], seed: int) -> tuple[str, dict]:
    """A random drafter for the target in `target_folder`, shaped like the drafter folder `like` (its layers and
    block size; None: DrafterConfig.for_target's defaults), saved to a temporary folder: (folder, its config)."""
    with open(os.path.join(target_folder, "config.json")) as f:
        target = ModelConfig.from_hf(json.load(f))
    kw = {}
    if like is not None:
        with open(os.path.join(like, "config.json")) as f:
            small = json.load(f)
        kw = dict(num_layers=small["num_layers"], block_size=small["block_size"])
    cfg = DrafterConfig.for_target(target, **kw)
    torch.manual_seed(seed)
    drafter = DominoDrafter(cfg).to(torch.bfloat16)
    folder = tempfile.mkdtemp(prefix="tidal-projection-drafter-")
    drafter.save(folder)
    del drafter
    return folder, json.loads(cfg.to_json())


def projection(shape: str, taus: dict[str, float], batches: tuple[int, ...], nodes: int, device: str, seed: int,
               like: Optional[str], gpu_memory_utilization: float = 0.3) -> dict:
    """The projection.<shape> section: measured costs per batch and projected speedups per temperature key."""
    folder = shape if os.path.isdir(shape) else write_shape(shape)
    drafter, drafter_cfg = scaled_drafter(folder, like, seed)
    llm = LLM(model=folder, load_format="dummy", device=device, seed=seed, speculative="dominotree",
              drafter=drafter, spec_budget=nodes, spec_policy="fixed", max_num_seqs=max(batches),
              enable_prefix_caching=False, gpu_memory_utilization=gpu_memory_utilization)
    try:
        engine = llm.engine
        log = RoundLog(engine.speculator)
        log.temp = "t0"
        vocab = engine.model_config.vocab_size
        rng = random.Random(seed)
        for b in batches:
            prompts = [[rng.randrange(vocab) for _ in range(PROMPT_TOKENS)] for _ in range(b)]
            params = SamplingParams(temperature=0.0, max_tokens=ROUNDS, ignore_eos=True, detokenize=False)
            llm.generate(prompts, params)
        by_batch = round_cost(engine, log, batches, nodes).get("t0", {})
        for row in by_batch.values():
            row["speedup"] = {t: tau * row["plain_ms"] / row["round_ms"] for t, tau in taus.items()}
        out = dict(shape=shape if shape in SHAPES else os.path.basename(folder.rstrip("/")), nodes=nodes,
                   label="projection: random weights at this shape; tau from the real SmolLM2 pair of this run",
                   tau=taus, drafter=drafter_cfg, weights="random bf16 (load_format=dummy)", by_batch=by_batch)
        for b, row in by_batch.items():
            for t, value in row["speedup"].items():
                name = "speedup_b1" if b == "b1" else f"throughput_ratio_{b}"
                out[name if t == "t0" else f"{name}_{t}"] = value
        return out
    finally:
        llm.shutdown()
        shutil.rmtree(drafter, ignore_errors=True)
