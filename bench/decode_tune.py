"""Decode tuning benchmark (GPU, one run of a few minutes): skinny GEMM vs cuBLAS, decode attention.

    python -m bench.decode_tune [--out bench/results/decode_tune.json] [--budget-s 170]
    python -m bench.decode_tune --quantization fp8        (writes bench/results/decode_tune_fp8.json)

(a) GEMM, Llama-3-8B shapes (qkv 6144x4096, o 4096x4096, gate_up 28672x4096, down 4096x14336, lm_head
128256x4096) at M = 64, 128, 256, bf16: cuBLAS (F.linear), the engine selector's candidates
(replicas/layers/gemm_select.candidate_configs) and, time permitting, a wider grid of skinny configs. Timed as
the engine's start-up selection times them (gemm_select.GraphTimer): a compile / warm-up call, then a CUDA graph
of >= 8 calls rotating over weight copies that together exceed 3x the L2, median of 5 replays. Counted bytes =
weight + x + y, each once. "selector" = what the engine would pick among cuBLAS and its candidates (skinny
must win by 1%). A per-step line sums 32 x (qkv + o + gate_up + down) + lm_head for cuBLAS and for the picks.
(b) Paged decode attention at B = 64, 128, 256, context 1024 and 4096, 32 query / 8 KV heads, head 128, block
16, bf16, page tables shuffled over the pool (bench/attention_kernels.paged_batch): the default DecodeTuning and
every split policy x block_n x num_warps x num_stages variant, each in a CUDA graph of 4 calls (one call
streams >= 268 MB of K/V, past the L2), median of 5 replays. Counted bytes = K and V of every context token +
q + out. Variants whose split count equals an already timed one with the same tiles share its time.
Both against a 1 GiB device-to-device copy (read + write) measured in the same run (bench/roofline.Ceilings).
--quantization fp8: (a) only, on FP8 weights with row scales (replicas/layers/fp8_linear.py) at M = 1, 2, 4, 16, 64,
128, 256 and without the LM head (it stays bf16 under FP8): "cuBLAS" is then the FP8 layer's library call
(activation quantization and `torch._scaled_mm`), the candidates are the selector's FP8 ones (weight-only, FP8
tensor cores with per-tile or per-token activation scales, CUDA-core products with both K tile lengths), counted
bytes = weight at one byte + x + y, and a per-step line sums 32 x (qkv + o + gate_up + down).
Seed 0. A config that fails (compile, resources) is reported and skipped; past --budget-s the rest is skipped.
"""
from __future__ import annotations

import argparse
import itertools
import json
import os
import time
import traceback

import torch

from bench.attention_kernels import HEAD_DIM, KV_HEADS, paged_batch
from bench.roofline import Ceilings
from replicas.kernels.decode_attention import DecodeTuning, decode_num_splits, num_sms_of, paged_decode_attention
from replicas.layers import gemm_select
from replicas.layers.gemm_select import GraphTimer, candidate_configs, time_in_graph
from replicas.kernels.skinny_gemm import SkinnyConfig

GEMM_SHAPES = {"qkv": (6144, 4096), "o_proj": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336),
               "lm_head": (128256, 4096)}
LAYERS = 32
BATCHES = (64, 128, 256)
FP8_BATCHES = (1, 2, 4, 16, 64, 128, 256)
CONTEXTS = (1024, 4096)
SPLIT_VARIANTS = {"never": DecodeTuning(split_policy="never"),
                  "fill4": DecodeTuning(split_policy="fill", programs_per_sm=4),
                  "fill8": DecodeTuning(split_policy="fill", programs_per_sm=8),
                  "fill16": DecodeTuning(split_policy="fill", programs_per_sm=16)}


class Deadline:
    def __init__(self, seconds: float):
        self.end = time.monotonic() + seconds

    def passed(self) -> bool:
        return time.monotonic() > self.end


def wide_grid(m: int) -> list[SkinnyConfig]:
    """Skinny configs beyond the selector's candidates: more N tiles and splits, and pipelines sized for two
    programs per SM (the selector's rule) or for one."""
    out = []
    for bm in gemm_select._block_ms(m):
        warps, bk = (4, 128) if bm <= 64 else (8, 64)
        for bn, split, smem in itertools.product((16, 32, 64, 128, 256), (1, 2, 4, 8), (100 << 10, 200 << 10)):
            cfg = SkinnyConfig(bm, bn, bk, split, warps, gemm_select.pipeline_stages(bm, bn, bk, smem))
            if bm * bn <= gemm_select.MAX_ACC_ELEMS and cfg not in out:
                out.append(cfg)
    return out


def time_or_error(fn):
    try:
        return fn(), None
    except Exception as e:                          # one bad config must not kill the run
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        return None, f"{type(e).__name__}: {str(e).splitlines()[0][:120] if str(e) else ''}"


def gemm_rows(rows: list[dict], timer, num_sms: int, deadline: Deadline, shapes: dict = GEMM_SHAPES,
              batches: tuple = BATCHES, weight_bytes: int = 2) -> None:
    """cuBLAS and the selector's candidates for every shape x M, appended to `rows`. `timer(m, n, k, cfg)`:
    seconds per call (a GraphTimer), cfg None for the library call."""
    for (name, (n, k)), m in itertools.product(shapes.items(), batches):
        row = {"shape": name, "n": n, "k": k, "m": m, "bytes": weight_bytes * n * k + 2 * (m * k + m * n),
               "trials": []}
        row["cublas_s"], row["cublas_error"] = time_or_error(lambda: timer(m, n, k, None))
        rows.append(row)
        add_trials(row, timer, candidate_configs(m, n, k, num_sms, weight_bytes), True, deadline)


def add_trials(row: dict, timer: GraphTimer, configs: list[SkinnyConfig], candidate: bool, deadline) -> None:
    tried = {t["config"] for t in row["trials"]}
    for cfg in configs:
        if str(cfg) in tried:
            continue
        if deadline is not None and deadline.passed():
            row["skipped"] = "time budget"
            return
        t, err = time_or_error(lambda: timer(row["m"], row["n"], row["k"], cfg))
        row["trials"].append({"config": str(cfg), **cfg.__dict__, "s": t, "error": err, "candidate": candidate})


def summarize(rows: list[dict], copy_bw: float, batches: tuple = BATCHES) -> dict:
    """Best config, the selector's pick (candidates only, must beat cuBLAS by 1%), fractions, per-step sums."""
    for row in rows:
        ok = [t for t in row["trials"] if t["s"] is not None]
        best = min(ok, key=lambda t: t["s"], default=None)
        pick = min((t for t in ok if t["candidate"]), key=lambda t: t["s"], default=None)
        use = pick is not None and row["cublas_s"] is not None and pick["s"] < row["cublas_s"] * 0.99
        row["best"] = best
        row["selector"] = {"pick": pick["config"] if use else "cublas", "s": pick["s"] if use else row["cublas_s"]}
        for key, t in (("cublas", row["cublas_s"]), ("best", best and best["s"]), ("selector", row["selector"]["s"])):
            row[f"{key}_bw_fraction"] = row["bytes"] / t / copy_bw if t else None
    steps = {}
    for m in batches:
        by = {r["shape"]: r for r in rows if r["m"] == m}
        if all(r["cublas_s"] and r["selector"]["s"] for r in by.values()):
            count = {s: (1 if s == "lm_head" else LAYERS) for s in by}
            steps[m] = {"cublas_ms": sum(count[s] * by[s]["cublas_s"] for s in by) * 1e3,
                        "selector_ms": sum(count[s] * by[s]["selector"]["s"] for s in by) * 1e3,
                        "best_ms": sum(count[s] * min(by[s]["cublas_s"], by[s]["best"]["s"] if by[s]["best"]
                                                      else 1.0) for s in by) * 1e3}
    return {"rows": rows, "per_step": steps}


def bench_attention(copy_bw: float, deadline: Deadline) -> dict:
    gen = torch.Generator(device="cuda").manual_seed(0)
    num_sms = num_sms_of(torch.device("cuda"))
    cases = []
    for ctx, b in itertools.product(CONTEXTS, BATCHES):
        if deadline.passed():
            cases.append({"batch": b, "ctx": ctx, "skipped": "time budget"})
            continue
        try:
            spec, q, kv, batch = paged_batch(b, [1] * b, ctx, gen, tree=False)
        except Exception as e:                      # e.g. out of memory: the other cases still run
            cases.append({"batch": b, "ctx": ctx, "error": f"{type(e).__name__}: {e}"})
            continue
        elem = q.element_size()
        nbytes = b * ctx * KV_HEADS * HEAD_DIM * 2 * elem + 2 * q.numel() * elem
        out = torch.empty_like(q)

        def run(tuning):
            call = lambda: paged_decode_attention(q, kv, batch.block_tables, batch.seq_lens, spec, ctx,  # noqa: E731
                                                  out=out, tuning=tuning)
            return time_in_graph([call] * 4)

        case = {"batch": b, "ctx": ctx, "bytes": nbytes, "trials": []}
        default = DecodeTuning()
        case["default_splits"] = decode_num_splits(b, KV_HEADS, ctx, num_sms, default)
        case["default_s"], case["default_error"] = time_or_error(lambda: run(default))
        seen: dict[tuple, float] = {}
        for (policy, base), block_n, warps, stages in itertools.product(
                SPLIT_VARIANTS.items(), (32, 64, 128), (4, 8), (2, 3)):
            if deadline.passed():
                case["skipped"] = "time budget"
                break
            tuning = DecodeTuning(block_n=block_n, num_warps=warps, num_stages=stages,
                                  split_policy=base.split_policy, programs_per_sm=base.programs_per_sm)
            splits = decode_num_splits(b, KV_HEADS, ctx, num_sms, tuning)
            key = (splits, block_n, warps, stages)
            if key in seen:
                t, err = seen[key], None
            else:
                t, err = time_or_error(lambda: run(tuning))
                seen[key] = t
            case["trials"].append({"policy": policy, "splits": splits, "block_n": block_n, "num_warps": warps,
                                   "num_stages": stages, "s": t, "error": err,
                                   "bw_fraction": nbytes / t / copy_bw if t else None})
        ok = [t for t in case["trials"] if t["s"] is not None]
        case["best"] = min(ok, key=lambda t: t["s"], default=None)
        case["default_bw_fraction"] = nbytes / case["default_s"] / copy_bw if case["default_s"] else None
        cases.append(case)
        best = case["best"]
        print(f"  attention B={b:<4} ctx={ctx:<5} default ({case['default_splits']} split) "
              f"{fmt_us(case['default_s'])} ({frac(case['default_bw_fraction'])})  best "
              f"{fmt_us(best and best['s'])} ({frac(best and best['bw_fraction'])}) "
              f"{({k: best[k] for k in ('policy', 'splits', 'block_n', 'num_warps', 'num_stages')} if best else '-')}",
              flush=True)
    return {"cases": cases, "default_tuning": DecodeTuning().__dict__}


def fmt_us(s) -> str:
    return f"{s * 1e6:8.1f} us" if s else "   failed"


def frac(f) -> str:
    return f"{f:.3f}" if f else "-"


def print_tables(result: dict) -> None:
    print("\n(a) GEMM, fraction of copy bandwidth (weight + x + y bytes)")
    print(f"  {'shape':<9}{'M':>5}{'cuBLAS us':>11}{'frac':>7}{'best us':>10}{'frac':>7}{'select us':>11}{'frac':>7}"
          f"  best config / selector pick")
    for r in result["gemm"]["rows"]:
        best = r["best"]
        print(f"  {r['shape']:<9}{r['m']:>5}{(r['cublas_s'] or 0) * 1e6:>11.1f}{frac(r['cublas_bw_fraction']):>7}"
              f"{(best['s'] * 1e6 if best else 0):>10.1f}{frac(r['best_bw_fraction']):>7}"
              f"{(r['selector']['s'] or 0) * 1e6:>11.1f}{frac(r['selector_bw_fraction']):>7}"
              f"  {best['config'] if best else '-'} / {r['selector']['pick']}")
    for m, s in result["gemm"]["per_step"].items():
        print(f"  per step M={m}: GEMMs cuBLAS {s['cublas_ms']:.3f} ms, selector {s['selector_ms']:.3f} ms")
    print("\n(b) paged decode attention (32q/8kv heads, head 128, block 16), fraction of copy bandwidth")
    for c in result.get("attention", {}).get("cases", []):
        if "trials" not in c:
            print(f"  B={c['batch']} ctx={c['ctx']}: {c.get('skipped') or c.get('error')}")
            continue
        print(f"  B={c['batch']} ctx={c['ctx']}: default {c['default_splits']} split(s) "
              f"{fmt_us(c['default_s'])} ({frac(c['default_bw_fraction'])}); top 5 distinct:")
        unique = {(t["splits"], t["block_n"], t["num_warps"], t["num_stages"]): t for t in c["trials"] if t["s"]}
        for t in sorted(unique.values(), key=lambda t: t["s"])[:5]:
            print(f"    {t['policy']:<7} splits={t['splits']:<3} block_n={t['block_n']:<4} warps={t['num_warps']} "
                  f"stages={t['num_stages']}  {fmt_us(t['s'])} ({frac(t['bw_fraction'])})")
        failed = [t for t in c["trials"] if t["error"]]
        if failed:
            print(f"    {len(failed)} variant(s) failed, e.g. {failed[0]['error']}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None, help="default bench/results/decode_tune.json, or decode_tune_fp8.json "
                                                "with --quantization fp8")
    ap.add_argument("--budget-s", type=float, default=170.0, help="skip what is left after this many seconds")
    ap.add_argument("--quantization", choices=("bf16", "fp8"), default="bf16",
                    help="fp8: the GEMM section on FP8 weights only (module docstring)")
    args = ap.parse_args()
    fp8 = args.quantization == "fp8"
    if args.out is None:
        args.out = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results",
                                "decode_tune_fp8.json" if fp8 else "decode_tune.json")
    assert torch.cuda.is_available(), "this benchmark needs a CUDA GPU"
    import triton
    torch.manual_seed(0)
    started = time.monotonic()
    deadline = Deadline(args.budget_s)
    ceil = Ceilings.measure()
    props = torch.cuda.get_device_properties(0)
    result = {"device": torch.cuda.get_device_name(), "sms": props.multi_processor_count,
              "l2_bytes": props.L2_cache_size, "torch": torch.__version__, "triton": triton.__version__,
              "quantization": args.quantization, "seed": 0, "copy_TBps": ceil.copy_bytes_per_s / 1e12, "matmul_TFLOPs": ceil.matmul_flops_per_s / 1e12,
              "warmup": "one eager call before each graph capture, one graph replay before timing",
              "reps": "5 graph replays, median; GEMM graphs >= 8 calls, attention graphs 4 calls",
              "method": __doc__.strip()}
    print(f"{result['device']} ({result['sms']} SMs, L2 {result['l2_bytes'] >> 20} MiB), torch {torch.__version__}, "
          f"triton {triton.__version__}, seed 0; copy {result['copy_TBps']:.2f} TB/s", flush=True)
    timer = GraphTimer(torch.device("cuda"), torch.bfloat16, fp8=fp8)
    num_sms = num_sms_of(torch.device("cuda"))
    rows: list[dict] = []
    batches = FP8_BATCHES if fp8 else BATCHES
    if fp8:
        layer_shapes = {name: shape for name, shape in GEMM_SHAPES.items() if name != "lm_head"}
        sections = [("gemm", lambda: gemm_rows(rows, timer, num_sms, deadline, layer_shapes, batches, 1))]
    else:
        sections = [("gemm", lambda: gemm_rows(rows, timer, num_sms, Deadline(0.45 * args.budget_s))),
                    ("attention", lambda: result.__setitem__("attention", bench_attention(
                        ceil.copy_bytes_per_s, Deadline(args.budget_s * 0.8 - (time.monotonic() - started))))),
                    ("gemm_wide", lambda: [add_trials(r, timer, wide_grid(r["m"]), False, deadline) for r in rows])]
    for name, fn in sections:
        if deadline.passed():
            result.setdefault("skipped", []).append(name)
            continue
        try:
            fn()
        except Exception:
            result.setdefault("errors", {})[name] = traceback.format_exc()
            print(result["errors"][name], flush=True)
        if name == "gemm":
            for r in summarize(rows, ceil.copy_bytes_per_s, batches)["rows"]:
                print(f"  gemm {r['shape']:<8} M={r['m']:<4} cuBLAS {fmt_us(r['cublas_s'])} "
                      f"({frac(r['cublas_bw_fraction'])})  selector {r['selector']['pick']} "
                      f"{fmt_us(r['selector']['s'])} ({frac(r['selector_bw_fraction'])})", flush=True)
    timer.release()
    result["gemm"] = summarize(rows, ceil.copy_bytes_per_s, batches)
    result["seconds"] = time.monotonic() - started
    print_tables(result)
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2, default=str)
    print(f"\n{result['seconds']:.0f} s; wrote {args.out}")


if __name__ == "__main__":
    main()
