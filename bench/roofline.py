"""Ceilings measured in the same run, and a profile of one step classified against them.

Ceilings: a 1 GiB device-to-device copy (bytes read + written) and an 8192^3 bf16 matmul.
Profile (the KernelPro idea, without the LLM): torch.profiler gives each CUDA kernel's time in a
step; kernels are grouped into op classes by name, each class gets analytic bytes and FLOPs from the
model's shapes, and is called memory-bound, compute-bound or latency-bound by which ceiling its
achieved rate is closer to (latency-bound when it reaches under 30% of both)."""
from __future__ import annotations

import re
from collections import defaultdict
from dataclasses import dataclass

import torch


def cuda_time_ms(fn, warmup: int = 3, iters: int = 10) -> float:
    """Mean milliseconds per call of `fn` on the current stream, timed with CUDA events after a warm-up."""
    for _ in range(warmup):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


@dataclass(frozen=True)
class Ceilings:
    copy_bytes_per_s: float
    matmul_flops_per_s: float

    @staticmethod
    def measure() -> "Ceilings":
        src = torch.empty(1 << 30, dtype=torch.uint8, device="cuda").random_()
        dst = torch.empty_like(src)
        copy_ms = cuda_time_ms(lambda: dst.copy_(src))
        del src, dst
        a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
        b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
        mm_ms = cuda_time_ms(lambda: a @ b)
        del a, b
        torch.cuda.empty_cache()
        return Ceilings(2 * (1 << 30) / (copy_ms * 1e-3), 2 * 8192 ** 3 / (mm_ms * 1e-3))


# op class -> kernel-name patterns (first match wins)
CLASSES = [
    ("attention_decode", r"_decode_(partial|reduce)_kernel"),
    ("attention_extend", r"_extend_kernel"),
    ("kv_store", r"_store_kv_kernel"),
    ("gemm", r"gemm|sm90_xmma|cutlass|nvjet|cublas|matmul|Kernel2"),
    ("sampling", r"topk|sort|argmax|radix|gather_topk"),
    ("all_reduce", r"nccl|allreduce"),
    ("norm_rope_act", r"rms|norm|rotary|silu|mul|pow|mean|rsqrt|cat|add|neg|sin|cos"),
]


def classify_kernel(name: str) -> str:
    for cls, pat in CLASSES:
        if re.search(pat, name, re.IGNORECASE):
            return cls
    return "other"


def profile_kernels(fn, iters: int = 3, top: list | None = None) -> dict[str, float]:
    """Mean CUDA time (s) per call of `fn`, by op class; `top` (if given) receives the 15 slowest kernels."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            fn()
        torch.cuda.synchronize()
    totals: dict[str, float] = defaultdict(float)
    kernels = []
    for evt in prof.key_averages():
        t = getattr(evt, "device_time_total", None) or getattr(evt, "cuda_time_total", 0.0)
        if t and evt.device_type == torch.autograd.DeviceType.CUDA:
            totals[classify_kernel(evt.key)] += t * 1e-6 / iters
            kernels.append((t * 1e-3 / iters, evt.key[:90], classify_kernel(evt.key)))
    if top is not None:
        top.extend(sorted(kernels, reverse=True)[:15])
    return dict(totals)


def bound_of(bytes_: float, flops: float, seconds: float, ceil: Ceilings) -> tuple[str, float, float]:
    bw = bytes_ / seconds / ceil.copy_bytes_per_s if seconds else 0.0
    fl = flops / seconds / ceil.matmul_flops_per_s if seconds else 0.0
    if max(bw, fl) < 0.3:
        return "latency", bw, fl
    return ("memory" if bw >= fl else "compute"), bw, fl


def classify_step(times: dict[str, float], analytic: dict[str, tuple[float, float]], ceil: Ceilings) -> list[dict]:
    """Rows of (class, share of step, time, achieved bw/flop fractions, bound) for a profiled step."""
    total = sum(times.values()) or 1.0
    rows = []
    for cls, seconds in sorted(times.items(), key=lambda kv: -kv[1]):
        b, f = analytic.get(cls, (0.0, 0.0))
        bound, bw, fl = bound_of(b, f, seconds, ceil)
        rows.append({"class": cls, "share": seconds / total, "ms": seconds * 1e3, "bw_fraction": bw,
                     "flop_fraction": fl, "bound": bound if cls in analytic else "unknown"})
    return rows


def print_profile(title: str, rows: list[dict]) -> None:
    print(f"\n{title}")
    print(f"  {'op class':<18}{'share':>7}{'ms':>9}{'of BW':>8}{'of FLOP':>9}  bound")
    for r in rows:
        print(f"  {r['class']:<18}{r['share']:>7.1%}{r['ms']:>9.3f}{r['bw_fraction']:>8.2f}"
              f"{r['flop_fraction']:>9.2f}  {r['bound']}")
