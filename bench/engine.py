"""Engine benchmark (GPU): offline throughput and roofline fractions.

    python -m bench.engine [--shapes qwen3-0.6b,llama3-8b,smollm2] [--num-seqs 256] [--quantization bf16,fp8]
                           [--out bench/results/engine.json] [--update]

Workload (nano-vllm / mini-sglang): 256 sequences, input and output lengths uniform in [100, 1024], random
token ids, ignore_eos, seed 0; first a warm-up workload drawn the same way with seed 1 (Triton compiles a kernel
for each new shape it meets: a short warm-up left that compilation inside the measured run; other tokens, so no
prefix-cache hit carries over). Throughput counts generated tokens only, over the wall time of the measured
`LLM.generate` call (scheduling, sampling and Python included).
Random bf16 weights for the Qwen3-0.6B and Llama-3-8B shapes; SmolLM2-135M's real GGUF weights. With
`--quantization bf16,fp8` each shape also runs with FP8 linear weights (replicas/layers/fp8_linear.py), its
bytes counted as stored (one byte a weight plus the row scales), and, when smollm2 is among the shapes, SmolLM2's
perplexity on a fixed text is reported both ways (`fp8_perplexity`). The JSON is written again after every
shape, so a run cut short keeps the rows it finished.
Roofline: decode step = one graph-replayed forward of B sequences (B = 64, 128, 256; the profiled one is
64, the workload's own steady state is 256 running) at a fixed context, counted bytes =
every weight once + the K/V of every context token once; prefill = one 8192-token chunk, counted FLOPs =
2 x params x tokens + causal attention (2 x 2 x T^2/2 x heads x head_dim per layer). Both against a copy
and a matmul measured in the same run (bench/roofline.py). HF transformers `generate` runs a 32-sequence
subset of the same workload (left-padded batch; only each sequence's requested tokens are counted).
`--update` merges into the existing --out: the rows this run measured replace theirs, the others stay, and
`rows_from` names the run every row came from.
"""
from __future__ import annotations

import argparse
import gc
import json
import logging
import os
import random
import sys
import time

import torch

from bench.provenance import provenance
from bench.shapes import SHAPES, write_shape
from bench.roofline import Ceilings, classify_step, cuda_time_ms, print_profile, profile_kernels
from memory.block_manager import BlockManager
from replicas import LLM, SamplingParams
from replicas.layers.fp8_linear import Fp8Weight
from replicas.scheduler import ScheduledBatch
from replicas.sequence import Sequence
from replicas.step_input import StepInput

def workload(n: int, vocab: int, seed: int = 0):
    rng = random.Random(seed)
    prompts, lens = [], []
    for _ in range(n):
        prompts.append([rng.randrange(100, vocab - 100) for _ in range(rng.randint(100, 1024))])
        lens.append(rng.randint(100, 1024))
    return prompts, lens


def params_of(lens):
    return [SamplingParams(temperature=0.0, max_tokens=k, ignore_eos=True, detokenize=False) for k in lens]


def make_llm(shape: str, **kw) -> LLM:
    if shape == "smollm2":
        return LLM(**kw)
    return LLM(model=write_shape(shape), load_format="dummy", **kw)


def _forward_weights(model):
    """(tensor, counts as parameters) of every weight a forward reads: the parameters (an embedding only as the
    tied LM head), and FP8 weights' values and their scales (read, not parameters)."""
    for name, p in model.named_parameters():
        if "embed_tokens" not in name:
            yield p, True
    if model.config.tie_word_embeddings:
        yield model.lm_head.weight, True
    for mod in model.modules():
        if isinstance(mod, Fp8Weight):
            yield mod.q, True
            yield mod.scale, False


def weight_bytes(model) -> int:
    return sum(t.numel() * t.element_size() for t, _ in _forward_weights(model))


def weight_params(model) -> int:
    return sum(t.numel() for t, counted in _forward_weights(model) if counted)


def fake_batch(engine, batch: int, ctx: int, new_tokens: int) -> tuple[ScheduledBatch, list[Sequence]]:
    """`batch` sequences with `ctx - new_tokens` tokens already cached, asking for `new_tokens` each."""
    bm: BlockManager = engine.block_manager
    seqs = []
    for i in range(batch):
        s = Sequence(f"bench{i}", 0, [7] * ctx, SamplingParams(max_tokens=1), 0, 0.0)
        s.num_computed_tokens = ctx - new_tokens
        bm.allocate(s, new_tokens)
        seqs.append(s)
    return ScheduledBatch(seqs, [new_tokens] * batch), seqs


def release(engine, seqs):
    for s in seqs:
        engine.block_manager.free(s)


def time_step(runner, step, iters=20) -> float:
    return cuda_time_ms(lambda: runner.execute(step), iters=iters) * 1e-3


def decode_point(llm: LLM, ceil: Ceilings, batch_size: int, ctx: int) -> dict:
    """One graph-replayed decode step of `batch_size` sequences at context `ctx`, as a fraction of copy BW."""
    engine, runner = llm.engine, llm.engine.runner
    mc = engine.model_config
    elem = torch.tensor([], dtype=runner.dtype).element_size()
    kv_bytes = batch_size * ctx * mc.num_hidden_layers * 2 * mc.num_key_value_heads * mc.head_dim * elem
    wbytes = weight_bytes(runner.model)
    batch, seqs = fake_batch(engine, batch_size, ctx, 1)
    step = StepInput.from_batch(batch, engine.config.cache.block_size)
    t = time_step(runner, step)
    release(engine, seqs)
    return {"batch": batch_size, "ctx": ctx, "step_ms": t * 1e3, "bytes": wbytes + kv_bytes,
            "bw_fraction": (wbytes + kv_bytes) / t / ceil.copy_bytes_per_s,
            "graphs": runner.graphs is not None and runner.graphs.can_run(step)}


def roofline(llm: LLM, ceil: Ceilings, decode_batch: int, decode_ctx: int, prefill_tokens: int,
             decode_batches: tuple[int, ...] = ()) -> dict:
    engine, runner = llm.engine, llm.engine.runner
    mc, model = engine.model_config, runner.model
    wbytes, params = weight_bytes(model), weight_params(model)
    elem = torch.tensor([], dtype=runner.dtype).element_size()
    kv_per_token = mc.num_hidden_layers * 2 * mc.num_key_value_heads * mc.head_dim * elem
    out = {"weight_bytes": wbytes,
           "decode_by_batch": [decode_point(llm, ceil, b, decode_ctx) for b in decode_batches]}
    head = decode_point(llm, ceil, decode_batch, decode_ctx)
    out.update(decode_batch=decode_batch, decode_ctx=decode_ctx, decode_step_ms=head["step_ms"],
               decode_bytes=head["bytes"], decode_bw_fraction=head["bw_fraction"], decode_graphs=head["graphs"])
    batch, seqs = fake_batch(engine, decode_batch, decode_ctx, 1)
    step = StepInput.from_batch(batch, engine.config.cache.block_size)
    kv_bytes = decode_batch * decode_ctx * kv_per_token
    lin_flops = 2 * params * decode_batch
    attn_flops = 4 * decode_batch * decode_ctx * mc.num_attention_heads * mc.head_dim * mc.num_hidden_layers
    out["decode_top_kernels_ms"], out["prefill_top_kernels_ms"] = [], []
    out["decode_profile"] = classify_step(profile_kernels(lambda: runner.execute(step),
                                                          top=out["decode_top_kernels_ms"]), {
        "gemm": (wbytes, lin_flops), "attention_decode": (kv_bytes, attn_flops)}, ceil)
    release(engine, seqs)
    batch, seqs = fake_batch(engine, 1, prefill_tokens, prefill_tokens)
    step = StepInput.from_batch(batch, engine.config.cache.block_size)
    t = time_step(runner, step, iters=5)
    T = prefill_tokens
    attn = 2 * 2 * (T * T / 2) * mc.num_attention_heads * mc.head_dim * mc.num_hidden_layers
    flops = 2 * (params - mc.vocab_size * mc.hidden_size) * T + attn + 2 * mc.vocab_size * mc.hidden_size
    out.update(prefill_tokens=T, prefill_step_ms=t * 1e3, prefill_tflops=flops / t / 1e12,
               prefill_matmul_fraction=flops / t / ceil.matmul_flops_per_s)
    out["prefill_profile"] = classify_step(profile_kernels(lambda: runner.execute(step), iters=2,
                                                           top=out["prefill_top_kernels_ms"]), {
        "gemm": (wbytes, flops - attn), "attention_extend": (T * kv_per_token, attn)}, ceil)
    release(engine, seqs)
    return out


def offline_throughput(llm: LLM, prompts, lens, warmup) -> dict:
    llm.generate(*warmup)           # a workload like the measured one, other tokens: no prefix-cache hit carries over
    torch.cuda.synchronize()
    t = time.perf_counter()
    outs = llm.generate(prompts, params_of(lens))
    dt = time.perf_counter() - t
    gen = sum(len(o.outputs[0].token_ids) for o in outs)
    assert gen == sum(lens), "ignore_eos workload must generate exactly the requested tokens"
    return {"num_seqs": len(prompts), "output_tokens": gen, "input_tokens": sum(map(len, prompts)),
            "seconds": dt, "output_tok_s": gen / dt, "total_tok_s": (gen + sum(map(len, prompts))) / dt}


def hf_throughput(shape: str, prompts, lens, n: int = 32) -> dict:
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model(**SHAPES[shape])
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).cuda().eval()
    sub, sub_lens = prompts[:n], lens[:n]
    width = max(map(len, sub))
    ids = torch.tensor([[0] * (width - len(p)) + p for p in sub], device="cuda")
    mask = (torch.arange(width, device="cuda")[None] >= torch.tensor([width - len(p) for p in sub],
                                                                       device="cuda")[:, None]).long()
    steps = max(sub_lens)
    with torch.no_grad():
        model.generate(ids[:2, :16], attention_mask=mask[:2, :16], max_new_tokens=4, do_sample=False)
        torch.cuda.synchronize()
        t = time.perf_counter()
        model.generate(ids, attention_mask=mask, max_new_tokens=steps, min_new_tokens=steps, do_sample=False,
                       pad_token_id=0)
        torch.cuda.synchronize()
        dt = time.perf_counter() - t
    del model
    return {"hf_num_seqs": n, "hf_output_tokens": sum(sub_lens), "hf_seconds": dt,
            "hf_output_tok_s": sum(sub_lens) / dt}


def bench_shape(shape: str, args, ceil: Ceilings, quantization: str = "bf16") -> dict:
    """One engine's figures (`quantization`: bf16, or fp8 weights); the engine is gone (its memory free) when this
    returns."""
    vocab = SHAPES[shape]["vocab_size"] if shape in SHAPES else 49152
    prompts, lens = workload(args.num_seqs, vocab)
    warm_prompts, warm_lens = workload(args.num_seqs, vocab, seed=1)
    reference = args.attention_backend == "torch"
    extra = dict(attention_backend="torch", enforce_eager=True) if reference else {}
    if quantization == "fp8":
        extra["quantization"] = "fp8"
    llm = make_llm(shape, max_num_seqs=256, max_num_batched_tokens=8192, gpu_memory_utilization=0.85, **extra)
    r = {"quantization": quantization, "kv_blocks": llm.engine.block_manager.num_base,
         "attention_backend": llm.engine.runner.backend.name, "cuda_graphs": llm.engine.runner.graphs is not None}
    r.update(offline_throughput(llm, prompts, lens, (warm_prompts, params_of(warm_lens))))
    if shape in SHAPES and not reference:
        r.update(roofline(llm, ceil, decode_batch=args.decode_batch, decode_ctx=1024, prefill_tokens=8192,
                          decode_batches=tuple(int(b) for b in args.decode_batches.split(",") if b)))
    print(f"[{shape}] {r['output_tok_s']:.0f} output tok/s on {r['kv_blocks']} KV blocks", flush=True)
    llm.shutdown()
    del llm
    gc.collect()
    torch.cuda.empty_cache()
    if shape == args.hf_shape and not args.no_hf and quantization == "bf16":
        r.update(hf_throughput(shape, prompts, lens))
        r["throughput_vs_hf"] = r["output_tok_s"] / r["hf_output_tok_s"]
    return r


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default="qwen3-0.6b,llama3-8b,smollm2")
    ap.add_argument("--num-seqs", type=int, default=256)
    ap.add_argument("--hf-shape", default="qwen3-0.6b")
    ap.add_argument("--attention", action="store_true", help="also run bench.attention_kernels (no sweep)")
    ap.add_argument("--attention-backend", default="auto", choices=["auto", "torch"],
                    help="torch: the reference backend, eager (the starting point), throughput only")
    ap.add_argument("--decode-batch", type=int, default=64, help="the decode step profiled and reported")
    ap.add_argument("--decode-batches", default="1,64,128,256", help="decode steps also timed (same context)")
    ap.add_argument("--no-hf", action="store_true", help="skip the HF transformers baseline")
    ap.add_argument("--quantization", default="bf16",
                    help="comma-separated, of bf16 and fp8: each shape runs once per entry; an fp8 run is reported "
                         "as shape:fp8 with its speed-ups over bf16 under fp8_vs_bf16")
    ap.add_argument("--out", default="bench/results/engine.json")
    ap.add_argument("--update", action="store_true", help="merge into the existing --out instead of replacing it")
    args = ap.parse_args()
    quantizations = args.quantization.split(",")
    if not set(quantizations) <= {"bf16", "fp8"}:
        ap.error(f"--quantization takes bf16 and fp8, not {args.quantization!r}")
    logging.basicConfig(level=logging.WARNING, format="%(name)s: %(message)s")
    logging.getLogger("replicas.layers.gemm_select").setLevel(logging.INFO)      # the per-shape GEMM choices
    torch.manual_seed(0)
    ceil = Ceilings.measure()
    res = {"provenance": provenance("bench.engine", sys.argv[1:], "cuda", 0,
                                    warm_up="one workload per engine (seed 1) before the measured one",
                                    counted="generated tokens over the measured generate call's wall time; "
                                            "roofline steps as CUDA-event time of graph replays"),
           "device": torch.cuda.get_device_name(), "torch": torch.__version__, "seed": 0,
           "copy_TBps": ceil.copy_bytes_per_s / 1e12, "matmul_TFLOPs": ceil.matmul_flops_per_s / 1e12,
           "method": __doc__.strip(), "shapes": {}}
    base = None
    if args.update and os.path.exists(args.out):
        with open(args.out) as f:
            base = json.load(f)
    for shape in args.shapes.split(","):
        for q in quantizations:
            res["shapes"][shape if q == "bf16" else f"{shape}:{q}"] = bench_shape(shape, args, ceil, q)
            gc.collect()
            torch.cuda.empty_cache()       # the next engine sizes its KV pool from the memory free now
            write_results(args, res, base)
    if "fp8" in quantizations and "smollm2" in args.shapes.split(","):
        res["fp8_perplexity"] = fp8_perplexity(gpu_memory_utilization=0.3)
    if args.attention:
        from bench.attention_kernels import bench_decode, bench_tree_extend
        res["attention"] = {**bench_decode(False, ceil.copy_bytes_per_s), **bench_tree_extend(False)}
        res["attention_decode_bw_fraction"] = res["attention"]["attention_decode_bw_fraction"]
        res["tree_mask_overhead"] = res["attention"]["tree_mask_overhead"]
    report(write_results(args, res, base))
    print(f"wrote {args.out}")


def write_results(args: argparse.Namespace, res: dict, base: dict | None) -> dict:
    """The run so far with its summary keys, merged into `base` (the file as it was before an --update run),
    written to --out."""
    res["fp8_vs_bf16"] = {shape: fp8_speedups(res["shapes"][shape], res["shapes"][f"{shape}:fp8"])
                          for shape in args.shapes.split(",")
                          if shape in res["shapes"] and f"{shape}:fp8" in res["shapes"]}
    out = res if base is None else merge_results(base, res)
    big = out["shapes"].get("llama3-8b", {})
    out["decode_bw_fraction"] = big.get("decode_bw_fraction")
    out["prefill_matmul_fraction"] = big.get("prefill_matmul_fraction")
    out["throughput_vs_hf"] = out["shapes"].get(args.hf_shape, {}).get("throughput_vs_hf")
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(out, f, indent=2, default=float)
    return out


def merge_results(old: dict, new: dict) -> dict:
    """`--update`: `new`'s rows and keys replace `old`'s, the other rows stay; `rows_from` maps every row to the
    provenance of the run that measured it (a file without one is named by its own provenance)."""
    old_from = old.get("rows_from") or {shape: old.get("provenance") for shape in old.get("shapes", {})}
    merged = {**old, **new}
    merged["shapes"] = {**old.get("shapes", {}), **new["shapes"]}
    merged["fp8_vs_bf16"] = {**old.get("fp8_vs_bf16", {}), **new.get("fp8_vs_bf16", {})}
    merged["rows_from"] = {**{shape: old_from.get(shape) for shape in old.get("shapes", {})},
                           **{shape: new["provenance"] for shape in new["shapes"]}}
    return merged


def fp8_perplexity(tokens: int = 512, **llm_kwargs) -> dict:
    """The default model's teacher-forced perplexity on bench.cpu_decode's fixed text (Python's LICENSE.txt, its
    first `tokens` tokens) with float (`auto`) and FP8 linear weights."""
    from bench.cpu_decode import license_text, perplexity
    path, text = license_text()
    out = {"text": path}
    for quantization in ("auto", "fp8"):
        llm = LLM(quantization=quantization, **llm_kwargs)
        try:
            ids = llm.tokenizer.encode(text)[:tokens]
            out["tokens"] = len(ids)
            out["bf16" if quantization == "auto" else "fp8"] = perplexity(llm, ids, kernel_rows=False)
        finally:
            llm.shutdown()
    out["ratio"] = out["fp8"] / out["bf16"]
    return out


def fp8_speedups(bf16: dict, fp8: dict) -> dict:
    """fp8's speed over bf16's: output throughput, each timed decode batch (step time), the prefill step; and under
    `byte_ceiling` each decode batch's bytes read, bf16 over fp8: the speed-up that fewer bytes allow where both run
    at the same fraction of copy bandwidth (the KV cache, bf16 in both, bounds it at large batches)."""
    out = {"output_tok_s": fp8["output_tok_s"] / bf16["output_tok_s"]}
    steps = {p["batch"]: p for p in bf16.get("decode_by_batch", [])}
    ceiling = {}
    for p in fp8.get("decode_by_batch", []):
        if p["batch"] in steps:
            out[f"decode_b{p['batch']}"] = steps[p["batch"]]["step_ms"] / p["step_ms"]
            if p.get("bytes") and steps[p["batch"]].get("bytes"):
                ceiling[f"decode_b{p['batch']}"] = steps[p["batch"]]["bytes"] / p["bytes"]
    if "prefill_step_ms" in bf16 and "prefill_step_ms" in fp8:
        out["prefill"] = bf16["prefill_step_ms"] / fp8["prefill_step_ms"]
    if ceiling:
        out["byte_ceiling"] = ceiling
    return out


def report(res: dict) -> None:
    for shape, r in res["shapes"].items():
        for key in ("decode_profile", "prefill_profile"):
            if key in r:
                print_profile(f"{shape} {key.replace('_', ' ')}", r[key])
                for ms, name, cls in r[key.replace("profile", "top_kernels_ms")][:8]:
                    print(f"    {ms:8.3f} ms  {cls:<16} {name}")
    print(f"\nceilings: copy {res['copy_TBps']:.2f} TB/s, bf16 matmul {res['matmul_TFLOPs']:.0f} TFLOP/s")
    print(f"{'shape':<12}{'out tok/s':>11}{'decode ms':>11}{'of BW':>8}{'prefill ms':>12}{'of FLOP':>9}{'vs HF':>8}")
    for shape, r in res["shapes"].items():
        f = lambda k, fmt: format(r[k], fmt) if r.get(k) is not None else "-"  # noqa: E731
        print(f"{shape:<12}{f('output_tok_s', '.0f'):>11}{f('decode_step_ms', '.2f'):>11}"
              f"{f('decode_bw_fraction', '.2f'):>8}{f('prefill_step_ms', '.1f'):>12}"
              f"{f('prefill_matmul_fraction', '.2f'):>9}{f('throughput_vs_hf', '.1f'):>8}")
    for shape, r in res["shapes"].items():
        for p in r.get("decode_by_batch", []):
            print(f"{shape} decode B={p['batch']:<4} ctx={p['ctx']}: {p['step_ms']:.2f} ms, "
                  f"{p['bw_fraction']:.3f} of copy BW, graphs={p['graphs']}")
    for shape, speedups in res.get("fp8_vs_bf16", {}).items():
        ceiling = speedups.get("byte_ceiling", {})
        print(f"{shape} fp8 / bf16: " + ", ".join(
            f"{k} {v:.2f}x" + (f" (byte ceiling {ceiling[k]:.2f}x)" if k in ceiling else "")
            for k, v in speedups.items() if k != "byte_ceiling"))
    if "fp8_perplexity" in res:
        p = res["fp8_perplexity"]
        print(f"SmolLM2 perplexity ({p['tokens']} tokens): bf16 {p['bf16']:.4f}, fp8 {p['fp8']:.4f} "
              f"({p['ratio']:.4f}x)")
    for k in ("decode_bw_fraction", "prefill_matmul_fraction", "attention_decode_bw_fraction",
              "tree_mask_overhead", "throughput_vs_hf"):
        print(f"{k}: {res.get(k)}")


if __name__ == "__main__":
    main()
