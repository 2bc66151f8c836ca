"""Elastic KV benchmark (GPU): VMM commit/decommit, reserve sizing per TP rank, lend/reclaim cycles under
load, the static-commit crash, and the study's negative result (lowering max_num_batched_tokens vs lending).

    python -m bench.elastic [--model llama3-8b|qwen3-0.6b] [--budget 32768]
                            [--sections vmm,sizing,cycles,static,negative] [--out bench/results/elastic.json]

Random bf16 weights of the named shape (load_format="dummy"), token-id prompts, ignore_eos, seed 0.
vmm: the whole reserve of every layer mapped (create + map + set access) and unmapped, 30 times after 3
warm-ups, median and p99; once at the card's size (16 GiB over 36 layers) and once at the model's measured
reserve; handles released right after mapping (default) and right after unmapping. sizing: the reserve of
one rank measured on this GPU for TP 1, 2 and 4 by profiling the per-rank shard shape (heads, KV heads and
MLP width divided by TP; full-vocabulary logits kept, as rank 0 gathers them); weights counted as 1/TP of the
full model. cycles: one step-indexed arrival script replayed on an elastic and an "off" engine of the same
base; prefill stall = steps from a request's arrival to its first scheduled step, elastic minus off.
static: tests/gpu/test_elastic_gpu.py's burst in subprocesses (Qwen3-0.6B shape, 8 GiB given to the engine).
negative: the same timed Poisson load (median TTFT) on "off" engines at 32768/16384/8192-token budgets and
an elastic engine at 32768, with the KV blocks each one has. Each section merges its keys into --out.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import random
import statistics
import subprocess
import sys
import time

import numpy as np
import torch

from bench.shapes import SHAPES, write_shape
from memory.kv_layout import LAYERS_PER_RANGE, layers_per_range
from memory.reserve import profile_reserve
from memory.vmm import VmmKVPool, VmmLayout, allocation_granularity
from replicas import SamplingParams
from replicas.config import EngineConfig
from replicas.engine import LLMEngine
from replicas.model_runner import ModelRunner

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Llama-3-8B at Llama 3.1's context: the negative section sends 8192-token prompts plus their output.
CONTEXT = {"llama3-8b": dict(max_position_embeddings=131072)}


def shape_folder(name: str, tp: int = 1) -> str:
    return write_shape(name, tp, **CONTEXT.get(name, {}))


def ms_stats(seconds: list[float]) -> dict:
    a = np.asarray(seconds) * 1e3
    return {"median": round(float(np.median(a)), 3), "p99": round(float(np.percentile(a, 99)), 3), "n": len(a)}


def release_memory() -> None:
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()


# ---- vmm -----------------------------------------------------------------------------------------------
def time_pool(num_layers: int, reserve_bytes_per_layer: int, release_after_map: bool, reps: int = 30,
              max_layers_per_range: int = LAYERS_PER_RANGE) -> dict:
    gran = allocation_granularity(torch.cuda.current_device())
    block = (2, 16, 8, 128)                                   # 64 KiB of bf16 per block per layer
    g = layers_per_range(num_layers, max_layers_per_range)
    block_bytes = 2 * 16 * 8 * 128 * 2 * g
    layout = VmmLayout.fit(block_bytes, gran, -(-gran // block_bytes), reserve_bytes_per_layer * g // block_bytes)
    pool = VmmKVPool(torch.device("cuda", torch.cuda.current_device()), layout, num_layers, block, torch.bfloat16,
                     release_after_map, layers_per_range=g)
    commit, decommit, phases = [], [], {}
    try:
        for i in range(reps + 3):
            pool.map_reserve()
            pool.caches[0][layout.num_base_blocks:].fill_(1)      # touch the reserve: it must be usable
            torch.cuda.synchronize()
            mapped = dict(pool.timings)
            pool.unmap_reserve()
            if i >= 3:
                commit.append(mapped["total"])
                decommit.append(pool.timings["total"])
                for what, timings in (("commit", mapped), ("decommit", pool.timings)):
                    for k, v in timings.items():
                        phases.setdefault(f"{what}:{k}", []).append(v)
    finally:
        pool.close()
    return {"layers": num_layers, "reserve_bytes": layout.reserve_handle_bytes * (num_layers // g),
            "release_after_map": release_after_map, "layers_per_range": g, "ranges": num_layers // g,
            "commit_ms": ms_stats(commit), "decommit_ms": ms_stats(decommit),
            "phases_median_ms": {k: round(float(np.median(v)) * 1e3, 3) for k, v in phases.items()}}


def time_one_range(nbytes: int, reps: int = 30) -> dict:
    """The driver's floor for the same bytes in ONE handle and ONE mapping (what a block-major layout, all
    layers' reserve contiguous, would pay): create + map + set access, then unmap (handle released at map)."""
    from memory.vmm import _check, _device_prop, access_desc, cu
    index = torch.cuda.current_device()
    gran = allocation_granularity(index)
    nbytes = nbytes // gran * gran
    prop = _device_prop(index)
    desc = access_desc(index)
    torch.cuda.synchronize()
    va = int(_check(cu.cuMemAddressReserve(nbytes, gran, 0, 0), "cuMemAddressReserve"))
    commit, decommit = [], []
    try:
        for i in range(reps + 3):
            t0 = time.perf_counter()
            h = _check(cu.cuMemCreate(nbytes, prop, 0), "cuMemCreate")
            _check(cu.cuMemMap(va, nbytes, 0, h, 0), "cuMemMap")
            _check(cu.cuMemSetAccess(va, nbytes, [desc], 1), "cuMemSetAccess")
            _check(cu.cuMemRelease(h), "cuMemRelease")
            t1 = time.perf_counter()
            _check(cu.cuMemUnmap(va, nbytes), "cuMemUnmap")
            t2 = time.perf_counter()
            if i >= 3:
                commit.append(t1 - t0)
                decommit.append(t2 - t1)
    finally:
        cu.cuMemAddressFree(va, nbytes)
    return {"reserve_bytes": nbytes, "commit_ms": ms_stats(commit), "decommit_ms": ms_stats(decommit)}


def time_remap(nbytes: int, reps: int = 30) -> dict:
    """Map + set access / unmap of ONE handle created once and kept: the driver cost without creating or
    releasing physical memory. Set against time_one_range it splits commit into page-table work and what the
    driver does to fresh physical memory (creation, scrubbing)."""
    from memory.vmm import _check, _device_prop, access_desc, cu
    index = torch.cuda.current_device()
    gran = allocation_granularity(index)
    nbytes = nbytes // gran * gran
    desc = access_desc(index)
    torch.cuda.synchronize()
    va = int(_check(cu.cuMemAddressReserve(nbytes, gran, 0, 0), "cuMemAddressReserve"))
    h = _check(cu.cuMemCreate(nbytes, _device_prop(index), 0), "cuMemCreate")
    commit, decommit = [], []
    try:
        for i in range(reps + 3):
            t0 = time.perf_counter()
            _check(cu.cuMemMap(va, nbytes, 0, h, 0), "cuMemMap")
            _check(cu.cuMemSetAccess(va, nbytes, [desc], 1), "cuMemSetAccess")
            t1 = time.perf_counter()
            _check(cu.cuMemUnmap(va, nbytes), "cuMemUnmap")
            t2 = time.perf_counter()
            if i >= 3:
                commit.append(t1 - t0)
                decommit.append(t2 - t1)
    finally:
        cu.cuMemRelease(h)
        cu.cuMemAddressFree(va, nbytes)
    return {"reserve_bytes": nbytes, "map_ms": ms_stats(commit), "unmap_ms": ms_stats(decommit)}


def section_vmm(args, out: dict) -> None:
    card = 16 << 30
    rows = [time_pool(36, card // 36, r, max_layers_per_range=1) for r in (True, False)]
    rows.append(time_pool(36, card // 36, True, max_layers_per_range=LAYERS_PER_RANGE))   # the card's size, ranges
    out["vmm_card_one_range"] = time_one_range(card)
    out["vmm_card_remap_kept_handle"] = time_remap(card)
    reserve = out.get("reserve_bytes_tp1")
    layers = SHAPES[args.model]["num_hidden_layers"]
    if reserve:
        rows += [time_pool(layers, reserve // layers, True, max_layers_per_range=g)
                 for g in (LAYERS_PER_RANGE, 1, 2, 8)]
        out["vmm_one_range"] = time_one_range(reserve)
    best = rows[3] if reserve else rows[2]             # the engine's layout (kv_layout.LAYERS_PER_RANGE)
    out.update(vmm=rows, decommit_ms=best["decommit_ms"]["median"], recommit_ms=best["commit_ms"]["median"],
               vmm_note=("decommit_ms/recommit_ms: the model's measured reserve" if reserve else
                         "decommit_ms/recommit_ms: 16 GiB over 36 layers (run 'sizing' first for the model's)"),
               card_ms={"commit": 2.7, "decommit": 6.4, "what": "16 GiB over 36 layers, one handle per layer"})


# ---- sizing --------------------------------------------------------------------------------------------
def section_sizing(args, out: dict) -> None:
    free0, total = torch.cuda.mem_get_info()
    context = total - free0                                    # CUDA context and whatever else is resident
    per_tp = {}
    for tp in (1, 2, 4):
        cfg = EngineConfig.from_flat(model=shape_folder(args.model, tp), load_format="dummy",
                                     max_num_batched_tokens=args.budget, max_num_seqs=args.max_num_seqs)
        runner = ModelRunner(cfg)
        weights = sum(p.numel() * p.element_size() for p in runner.model.parameters())
        if tp == 1:
            full_weights = weights
        sizing = profile_reserve(runner)
        kv_bytes = total * cfg.cache.gpu_memory_utilization - context - full_weights / tp - sizing.headroom_bytes
        per_tp[tp] = {**sizing.to_dict(), "kv_bytes": int(kv_bytes),
                      "reserve_fraction": round(sizing.lendable_bytes / kv_bytes, 5)}
        del runner
        release_memory()
    out.update(sizing=per_tp, budget=args.budget, reserve_bytes_tp1=per_tp[1]["lendable_bytes"],
               reserve_fraction_tp1=per_tp[1]["reserve_fraction"], reserve_fraction_tp2=per_tp[2]["reserve_fraction"],
               reserve_fraction_tp4=per_tp[4]["reserve_fraction"],
               reserve_fraction_method="TP2/TP4 computed per rank from shard shapes profiled on one GPU (no multi-GPU "
                                       "run); KV = util x total - context - weights/TP - headroom")


# ---- engines under load --------------------------------------------------------------------------------
def build(folder: str, mode: str, budget: int, args, **elastic_policy):
    """An engine of the shape with elastic KV `mode` ("off": the plain engine, KV sized after the activation
    peak); elastic_policy: EngineConfig's elastic_* settings."""
    return LLMEngine(EngineConfig.from_flat(model=folder, load_format="dummy", seed=0, elastic=mode,
                                            max_num_seqs=args.max_num_seqs, max_num_batched_tokens=budget,
                                            max_model_len=max(budget, 16384), **elastic_policy))


def teardown(engine) -> None:
    engine.runner.graphs = None
    engine.runner.release_kv_caches()
    if engine.runner.kv is not None:
        engine.runner.kv.close()
    engine.shutdown()
    release_memory()


def replay(engine, arrivals: dict[int, list], max_steps: int) -> dict:
    """Step-indexed arrivals. Returns first-scheduled step per request, errors and OOMs."""
    first, pending, errors, ooms, i = {}, set(), 0, 0, 0
    while i <= max(arrivals) or engine.has_unfinished:
        for rid, prompt, params in arrivals.get(i, []):
            engine.add_request(rid, prompt, params)
            pending.add((rid, i))
        try:
            engine.step()
        except torch.OutOfMemoryError:
            ooms += 1
            break
        except Exception:                                      # a CUDA error poisons the context: stop
            errors += 1
            break
        for rid, t in list(pending):
            seq = engine.requests[rid].seqs[0] if rid in engine.requests else None
            if seq is None or seq.first_scheduled_time is not None:
                first[rid] = i - t
                pending.discard((rid, t))
        i += 1
        if i > max_steps:
            break
    return {"wait_steps": first, "errors": errors, "ooms": ooms, "steps": i}


def mixed_arrivals(vocab: int, steps: int, seed: int = 0) -> dict[int, list]:
    rng, arrivals = random.Random(seed), {}
    for n, i in enumerate(range(0, steps, 6)):
        long = rng.random() < 0.25
        prompt = [rng.randrange(3, vocab - 1) for _ in range(rng.randint(2048, 8192) if long else rng.randint(16, 200))]
        params = SamplingParams(temperature=0.0, max_tokens=rng.randint(32, 256), ignore_eos=True, detokenize=False)
        arrivals[i] = [(f"r{n}", prompt, params)]
    return arrivals


def section_cycles(args, out: dict) -> None:
    folder, shape = shape_folder(args.model), SHAPES[args.model]
    arrivals = mixed_arrivals(shape["vocab_size"], args.cycle_steps)
    runs = {}
    for mode in ("off", "elastic"):
        policy = dict(elastic_lend_step_tokens=256, elastic_lend_after_steps=1, elastic_min_lend_steps=0) \
            if mode == "elastic" else {}
        engine = build(folder, mode, args.budget, args, **policy)
        runs[mode] = replay(engine, arrivals, 20 * args.cycle_steps)
        stats = engine.get_stats()
        runs[mode].update(lends=stats.lend_total, reclaims=stats.reclaim_total, migrated=stats.blocks_migrated,
                          preempted=stats.elastic_preemptions, lend_ms=ms_stats(stats.lend_latencies or [0.0]),
                          reclaim_ms=ms_stats(stats.reclaim_latencies or [0.0]),
                          base_blocks=engine.block_manager.num_base, reserve_blocks=engine.block_manager.num_reserve)
        teardown(engine)
        del engine
        release_memory()            # the next engine must size itself from the same free memory
    stall = [runs["elastic"]["wait_steps"][r] - runs["off"]["wait_steps"][r]
             for r in runs["off"]["wait_steps"] if r in runs["elastic"]["wait_steps"]]
    for r in runs.values():
        r["wait_steps"] = {"p50": float(np.percentile(list(r["wait_steps"].values()) or [0], 50)),
                           "p99": float(np.percentile(list(r["wait_steps"].values()) or [0], 99))}
    out.update(cycles=runs["elastic"]["reclaims"], errors=runs["elastic"]["errors"], ooms=runs["elastic"]["ooms"],
               prefill_stall_p99_steps=float(np.percentile(stall, 99)) if stall else None,
               kv_blocks_gained_when_lent=runs["elastic"]["reserve_blocks"], cycle_runs=runs)


def section_static(args, out: dict) -> None:
    results = {}
    for mode in ("elastic", "static"):
        proc = subprocess.run([sys.executable, "-m", "tests.gpu.test_elastic_gpu", "burst", mode], cwd=REPO,
                              capture_output=True, text=True, timeout=900, env={**os.environ, "HF_HUB_OFFLINE": "1"})
        line = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
        results[mode] = json.loads(line[-1][7:]) if line else {"rc": proc.returncode, "stderr": proc.stderr[-2000:]}
    out.update(static_commit_oom=bool(results["static"].get("oom")), burst=results,
               burst_elastic_oom=bool(results["elastic"].get("oom")))


def timed_load(engine, prompts: list[list[int]], rate: float, max_tokens: int) -> list[float]:
    """Poisson arrivals at `rate` per second (seed 0); returns the TTFTs (s)."""
    rng, t, times = random.Random(0), 0.0, []
    for _ in prompts:
        t += rng.expovariate(rate)
        times.append(t)
    start, n = time.monotonic(), 0
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, detokenize=False)
    engine.finished_timings.clear()
    while n < len(prompts) or engine.has_unfinished:
        now = time.monotonic() - start
        while n < len(prompts) and times[n] <= now:
            engine.add_request(f"q{n}", prompts[n], params, arrival_time=start + times[n])
            n += 1
        if not engine.has_unfinished:
            time.sleep(max(0.0, times[n] - now))
            continue
        engine.step()
    return [x.first_token_time - x.arrival_time for x in engine.finished_timings]


def section_negative(args, out: dict) -> None:
    folder, shape = shape_folder(args.model), SHAPES[args.model]
    rng = random.Random(1)
    prompts = [[rng.randrange(3, shape["vocab_size"] - 1) for _ in range(rng.randint(512, 8192))]
               for _ in range(args.requests)]
    rows = []
    for mode, budget in (("off", 32768), ("off", 16384), ("off", 8192), ("elastic", 32768)):
        engine = build(folder, mode, budget, args)
        timed_load(engine, prompts[:4], args.rate, 8)          # warm-up
        ttft = timed_load(engine, prompts, args.rate, args.max_tokens)
        bm = engine.block_manager
        rows.append({"mode": mode, "max_num_batched_tokens": budget, "kv_blocks": bm.num_base,
                     "kv_blocks_when_lent": bm.num_base + bm.num_reserve, "ttft_median_s": statistics.median(ttft),
                     "ttft_p99_s": float(np.percentile(ttft, 99)), "lends": engine.get_stats().lend_total,
                     "reclaims": engine.get_stats().reclaim_total})
        teardown(engine)
        del engine
        release_memory()
    off32, off8, el = rows[0], rows[2], rows[3]
    out.update(negative=rows, negative_summary={
        "blocks_gained_lowering_32768_to_8192": off8["kv_blocks"] - off32["kv_blocks"],
        "blocks_gained_lending_at_32768": el["kv_blocks_when_lent"] - el["kv_blocks"],
        "ttft_median_8192_vs_32768": round(off8["ttft_median_s"] / off32["ttft_median_s"] - 1, 4),
        "load": f"{args.requests} requests, prompts U[512, 8192], {args.max_tokens} output tokens, "
                f"Poisson {args.rate}/s, seed 1"})


# ---- tp2 -------------------------------------------------------------------------------------------------
def section_tp2(args, out: dict) -> None:
    """The reserve measured on a real TP=2 engine (two GPUs, NCCL): rank 0's sizing after the profile run of
    its own shard, then a short mixed load that lends and reclaims on both ranks."""
    if torch.cuda.device_count() < 2:
        print("tp2: fewer than 2 GPUs, skipped", flush=True)
        return
    from replicas import LLM
    llm = LLM(model=shape_folder(args.model), load_format="dummy", tensor_parallel_size=2,
              elastic="elastic", max_num_batched_tokens=args.budget, max_num_seqs=args.max_num_seqs)
    try:
        kv = llm.engine.runner.kv
        rng = random.Random(0)
        vocab = SHAPES[args.model]["vocab_size"]
        prompts = [[rng.randrange(100, vocab - 100) for _ in range(rng.randint(64, 4096))] for _ in range(48)]
        params = SamplingParams(temperature=0.0, max_tokens=128, ignore_eos=True, detokenize=False)
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params)
        stats = llm.engine.get_stats()
        out["tp2"] = {"reserve_fraction": round(kv.reserve_fraction, 5), "reserve_bytes_per_rank": kv.reserve_bytes,
                      "base_blocks": kv.num_base, "reserve_blocks": kv.num_reserve,
                      "sizing_rank0": kv.sizing.to_dict() if kv.sizing else None,
                      "load": {"requests": len(prompts), "finished": len(outs), "seconds": time.perf_counter() - t0,
                               "lends": stats.lend_total, "reclaims": stats.reclaim_total,
                               "migrated": stats.blocks_migrated, "preempted": stats.elastic_preemptions,
                               "reclaim_ms": ms_stats(stats.reclaim_latencies) if stats.reclaim_latencies else None}}
        out["reserve_fraction_tp2_computed"] = out.get("reserve_fraction_tp2_computed", out.get("reserve_fraction_tp2"))
        out["reserve_fraction_tp2"] = out["tp2"]["reserve_fraction"]
        out["reserve_fraction_tp2_method"] = ("measured: rank 0 of a TP=2 engine on two GPUs (NCCL), "
                                              "reserve / base blocks")
    finally:
        llm.shutdown()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="llama3-8b", choices=sorted(SHAPES))
    ap.add_argument("--budget", type=int, default=32768)
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--sections", default="sizing,vmm,cycles,static,negative")
    ap.add_argument("--cycle-steps", type=int, default=3000)
    ap.add_argument("--requests", type=int, default=96)
    ap.add_argument("--rate", type=float, default=4.0)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--out", default=os.path.join(REPO, "bench", "results", "elastic.json"))
    args = ap.parse_args()
    out = json.load(open(args.out)) if os.path.exists(args.out) else {}
    out.update(model=args.model, device=torch.cuda.get_device_name(), torch=torch.__version__, seed=0)
    for name in args.sections.split(","):
        t0 = time.monotonic()
        globals()[f"section_{name}"](args, out)
        out.setdefault("section_seconds", {})[name] = round(time.monotonic() - t0, 1)
        os.makedirs(os.path.dirname(args.out), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(out, f, indent=2)
        print(name, "done", flush=True)
    print(json.dumps({k: v for k, v in out.items() if not isinstance(v, (dict, list))}, indent=2))


if __name__ == "__main__":
    main()
