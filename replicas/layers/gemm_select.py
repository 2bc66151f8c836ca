"""Per-shape choice between the library GEMM and the Triton skinny GEMM for the decode batch buckets.

At engine start on CUDA, for each distinct weight shape (N, K) of the model's linear layers and each decode batch
bucket M <= MAX_SKINNY_M that the CUDA graphs capture, cuBLAS and a handful of skinny configs are timed the way
they will run: inside a CUDA graph (no launch gaps), rotating over enough weight copies that every call streams
its weights from HBM (the copies together exceed the L2 several times), median of replays. The fastest wins;
Triton must beat cuBLAS by `min_gain`. A linear layer then holds its shape's table {M: SkinnyConfig} and
dispatches with one dict lookup; an M without an entry (prefill, non-bucket eager batches, cuBLAS winners)
goes to F.linear. TP shards are handled naturally: the shapes are the shard's. `TIDAL_SKINNY_GEMM=0` turns the
selection (and so the skinny path) off.

FP8 layers (`quantization=fp8`) are chosen the same way, per shape, between their own library path (per-token
activation quantization, then `torch._scaled_mm`) and the skinny GEMM reading the FP8 weight directly: the
table is keyed by (N, K, weight dtype), so a float and an FP8 layer of one shape never share a choice.
"""
from __future__ import annotations

import functools
import logging
import math
import statistics
import time
from dataclasses import dataclass
from typing import Callable, Iterable, Optional

import torch
import torch.nn.functional as F
from torch import nn

from replicas import envs
from replicas.kernels.skinny_gemm import SkinnyConfig, skinny_gemm
from replicas.layers.fp8_linear import FP8, Fp8Weight

log = logging.getLogger(__name__)

MAX_SKINNY_M = 256                 # above this a decode GEMM is compute-bound enough for cuBLAS
SMEM_BUDGET = 100 * 1024           # shared memory of one program's pipeline stages: two programs fit on an SM
MAX_ACC_ELEMS = 128 * 128          # fp32 accumulator elements per program (registers)
MAX_GEMV_M = 4                     # batches this small also try products on CUDA cores (SkinnyConfig.gemv)
GEMV_TILE_ELEMS = 8192             # rows x columns x K of one gemv tile product: 64 fp32 values a thread at 4 warps
MIN_WEIGHT_BYTES = 4 << 20         # smaller weights are launch-latency-bound: left to cuBLAS, no compile, no timing

# (M, N, K, config or None for the library GEMM) -> seconds per call
TimeFn = Callable[[int, int, int, Optional[SkinnyConfig]], float]
ShapeTable = dict[tuple[int, int], dict[int, SkinnyConfig]]     # (N, K) -> {M: config}, only where Triton won
GemmTable = dict[tuple[int, int, torch.dtype], dict[int, SkinnyConfig]]     # (N, K, weight dtype) -> {M: config}


@dataclass(frozen=True)
class GemmChoice:
    m: int
    n: int
    k: int
    cublas_s: float
    best: Optional[SkinnyConfig]           # fastest skinny config (None when none ran)
    best_s: float
    use_skinny: bool


def skinny_enabled(device: torch.device) -> bool:
    return device.type == "cuda" and envs.skinny_gemm()


def _block_ms(m: int) -> list[int]:
    if m <= 16:
        return [16]
    if m <= 64:
        return [64]
    if m <= 128:
        return [128]
    return [256, 128]


def fill_split(tiles: int, k: int, block_k: int, num_sms: int, max_split: int = 16) -> int:
    """Smallest power-of-two split of K giving >= 2 programs per SM, keeping >= 2 K tiles per split."""
    split = 1
    while tiles * split < 2 * num_sms and split < max_split and math.ceil(k / (2 * split)) >= 2 * block_k:
        split *= 2
    return split


def pipeline_stages(bm: int, bn: int, bk: int, smem_bytes: int, weight_bytes: int = 2, x_bytes: int = 2) -> int:
    """As many stages of x (`x_bytes` an element) and W (`weight_bytes`) tiles as fit in `smem_bytes` (2 to 6)."""
    return max(2, min(6, smem_bytes // ((x_bytes * bm + weight_bytes * bn) * bk)))


def candidate_configs(m: int, n: int, k: int, num_sms: int, weight_bytes: int = 2) -> list[SkinnyConfig]:
    """A handful of skinny configs worth timing for one (M, N, K): M tile holding the batch, N tiles of
    32-128 columns, each with split_k = 1 and with the split that fills the GPU. A one-byte (FP8) weight takes
    K tiles twice as long, so each weight tile moves as many bytes as a bf16 one, and each tile shape is tried
    weight-only, on FP8 tensor cores, and on FP8 tensor cores with the activations quantized per token in front
    (their x tiles one byte an element, so more stages fit). Batches of at most MAX_GEMV_M rows also try CUDA-core
    products, each tile shape reduced across lanes per K tile and once at the end (`reduce_late`); a one-byte
    weight also tries them with K tiles twice as long (a gemv program holds one K tile's loads in flight, so at
    bf16's tile length the grid has half the bytes in flight; the longer tile costs registers)."""
    out: list[SkinnyConfig] = []
    for bm in _block_ms(m):
        warps = 4 if bm <= 64 else 8
        bk = (128 if bm <= 64 else 64) * (2 if weight_bytes == 1 else 1)
        for bn in (32, 64, 128):
            if bm * bn > MAX_ACC_ELEMS:
                continue
            stages = pipeline_stages(bm, bn, bk, SMEM_BUDGET, weight_bytes)
            tiles = -(-m // bm) * -(-n // bn)
            for split in sorted({1, fill_split(tiles, k, bk, num_sms)}):
                out.append(SkinnyConfig(bm, bn, bk, split, warps, stages))
                if weight_bytes == 1 and bm <= 128:        # FP8 tensor cores too (kernels/skinny_gemm.py)
                    out.append(SkinnyConfig(bm, bn, bk, split, warps, stages, fp8_dot=True))
                    out.append(SkinnyConfig(bm, bn, bk, split, warps, pipeline_stages(bm, bn, bk, SMEM_BUDGET, 1, 1),
                                            fp8_dot=True, token_scales=True))
    if m <= MAX_GEMV_M:
        bm = 1 << (m - 1).bit_length()
        for bn in (8, 16, 32):
            base_k = min(1024, GEMV_TILE_ELEMS // (bm * bn))
            tiles = -(-n // bn)
            for bk in (base_k, 2 * base_k) if weight_bytes == 1 else (base_k,):
                for split in sorted({1, fill_split(tiles, k, bk, num_sms)}):
                    out.append(SkinnyConfig(bm, bn, bk, split, 4, 3, gemv=True))
                    out.append(SkinnyConfig(bm, bn, bk, split, 4, 3, gemv=True, reduce_late=True))
    return out


def select_gemms(shapes: Iterable[tuple[int, int]], batch_sizes: Iterable[int], time_fn: TimeFn, num_sms: int,
                 candidates: Callable[[int, int, int, int], list[SkinnyConfig]] = candidate_configs,
                 min_gain: float = 0.01) -> tuple[ShapeTable, list[GemmChoice]]:
    """Times cuBLAS and the candidates for every (N, K) x bucket M <= MAX_SKINNY_M; a candidate that fails
    (compile error, out of resources) is skipped. Returns the table and every decision made."""
    table: ShapeTable = {}
    choices: list[GemmChoice] = []
    ms = sorted({m for m in batch_sizes if 0 < m <= MAX_SKINNY_M})
    for n, k in sorted(set(shapes)):
        per_m: dict[int, SkinnyConfig] = {}
        for m in ms:
            cublas = time_fn(m, n, k, None)
            best, best_s = None, math.inf
            for cfg in candidates(m, n, k, num_sms):
                try:
                    t = time_fn(m, n, k, cfg)
                except Exception as e:       # one bad config must not stop the engine
                    log.debug("skinny gemm %s for M=%d N=%d K=%d failed: %s", cfg, m, n, k, e)
                    continue
                if t < best_s:
                    best, best_s = cfg, t
            use = best is not None and best_s < cublas * (1.0 - min_gain)
            if use:
                per_m[m] = best
            choices.append(GemmChoice(m, n, k, cublas, best, best_s, use))
        table[(n, k)] = per_m
    return table, choices


def time_in_graph(calls: list[Callable[[], object]], reps: int = 5) -> float:
    """Median seconds per call of `calls` run back to back as one CUDA graph (no launch gaps). The first call
    also runs eagerly before the capture: it compiles, and a bad config raises there, outside the capture."""
    calls[0]()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for call in calls:
            call()
    graph.replay()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e-3 / len(calls))
    return statistics.median(times)


class GraphTimer:
    """time_fn for select_gemms on CUDA: seconds per call, timed over CUDA-graph replays of calls rotating over
    weight copies that together exceed the L2 `l2_factor` times. With `fp8` the weights are FP8 with row
    scales and `dtype` is the activations': the library call is then the FP8 layer's own (activation
    quantization and `torch._scaled_mm`), the skinny call reads the FP8 weight."""

    def __init__(self, device: torch.device, dtype: torch.dtype, calls_per_graph: int = 8, reps: int = 5,
                 l2_factor: float = 3.0, max_copy_bytes: int = 1 << 30, fp8: bool = False):
        self.device, self.dtype, self.fp8 = device, dtype, fp8
        self.calls_per_graph, self.reps = calls_per_graph, reps
        self.l2_bytes = torch.cuda.get_device_properties(device).L2_cache_size
        self.l2_factor, self.max_copy_bytes = l2_factor, max_copy_bytes
        self._weights: dict[tuple[int, int], list] = {}
        self._inputs: dict[tuple[int, int], torch.Tensor] = {}

    def weights(self, n: int, k: int) -> list:
        if (n, k) not in self._weights:
            nbytes = n * k * (1 if self.fp8 else torch.finfo(self.dtype).bits // 8)
            copies = max(1, min(math.ceil(self.l2_factor * self.l2_bytes / nbytes), self.max_copy_bytes // nbytes))
            make = ((lambda w: Fp8Weight.from_float(w)) if self.fp8 else (lambda w: w))
            self._weights = {(n, k): [make(torch.randn(n, k, device=self.device, dtype=self.dtype) * 0.02)
                                      for _ in range(copies)]}          # one shape's copies alive at a time
        return self._weights[(n, k)]

    def __call__(self, m: int, n: int, k: int, cfg: Optional[SkinnyConfig]) -> float:
        if (m, k) not in self._inputs:
            self._inputs[(m, k)] = torch.randn(m, k, device=self.device, dtype=self.dtype)
        x, weights = self._inputs[(m, k)], self.weights(n, k)
        if self.fp8:
            call = ((lambda w: w.linear(x, None)) if cfg is None
                    else (lambda w: w.skinny(x, None, cfg)))
        else:
            call = (lambda w: F.linear(x, w)) if cfg is None else (lambda w: skinny_gemm(x, w, None, cfg))
        calls = [weights[i % len(weights)] for i in range(max(self.calls_per_graph, len(weights)))]
        return time_in_graph([lambda w=w: call(w) for w in calls], self.reps)

    def release(self) -> None:
        self._weights.clear()
        self._inputs.clear()


def skinny_layers(model: nn.Module) -> list[nn.Module]:
    """The model's linear layers that can dispatch to the skinny GEMM: they hold a `skinny` table and a float or
    FP8 weight (a GGUF-quantized weight computes its own matmul)."""
    return [mod for mod in model.modules()
            if hasattr(mod, "skinny") and isinstance(getattr(mod, "weight", None), (nn.Parameter, Fp8Weight))]


def weight_key(layer: nn.Module) -> tuple[int, int, torch.dtype]:
    """(N, K, weight dtype): the GEMM table's key for a layer."""
    w = layer.weight
    return (*w.shape, w.q.dtype if isinstance(w, Fp8Weight) else w.dtype)


def apply_table(model: nn.Module, table: GemmTable) -> None:
    for layer in skinny_layers(model):
        layer.skinny = table.get(weight_key(layer), {})


def format_choices(choices: list[GemmChoice]) -> str:
    lines = [f"{'N':>7}{'K':>7}{'M':>5}{'library us':>11}{'skinny us':>11}  pick"]
    for c in choices:
        pick = f"skinny {c.best}" if c.use_skinny else "library"
        lines.append(f"{c.n:>7}{c.k:>7}{c.m:>5}{c.cublas_s * 1e6:>11.2f}{c.best_s * 1e6:>11.2f}  {pick}")
    return "\n".join(lines)


@torch.inference_mode()
def tune_linear_layers(model: nn.Module, batch_sizes: Iterable[int], device: torch.device,
                       time_fn: Optional[TimeFn] = None) -> Optional[GemmTable]:
    """Selects and installs the per-bucket GEMM of every linear layer, float and FP8 weights each against their
    own library path (`time_fn`, when given, times every group); None (layers untouched) when off or failed."""
    if not skinny_enabled(device):
        return None
    groups: dict[torch.dtype, set[tuple[int, int]]] = {}
    for layer in skinny_layers(model):
        n, k, dtype = weight_key(layer)
        if MIN_WEIGHT_BYTES <= n * k * dtype.itemsize and n * k < 2 ** 31:
            groups.setdefault(dtype, set()).add((n, k))
    if not groups:
        return None
    act_dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.bfloat16)
    num_sms = torch.cuda.get_device_properties(device).multi_processor_count
    start, table, choices = time.perf_counter(), {}, []
    for dtype, shapes in groups.items():
        fp8 = dtype == FP8
        timer = GraphTimer(device, act_dtype if fp8 else dtype, fp8=fp8) if time_fn is None else None
        try:
            by_shape, made = select_gemms(shapes, batch_sizes, time_fn or timer, num_sms,
                                          functools.partial(candidate_configs, weight_bytes=1 if fp8 else 2))
        except Exception as e:               # an optimisation must not stop the engine
            log.warning("skinny GEMM selection failed (%s: %s); every linear layer stays on its library GEMM",
                        type(e).__name__, e)
            return None
        finally:
            if timer is not None:
                timer.release()
                torch.cuda.empty_cache()
        table.update({(n, k, dtype): per_m for (n, k), per_m in by_shape.items()})
        choices += made
    apply_table(model, table)
    log.info("GEMM selection (%d shapes, %.1f s):\n%s", len(table), time.perf_counter() - start,
             format_choices(choices))
    return table
