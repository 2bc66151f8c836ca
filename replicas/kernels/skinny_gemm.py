"""Skinny GEMM for decode: y[M, N] = x[M, K] @ W[N, K]^T (+ bias) with M small (a decode batch, <= 256).

The weights dominate the bytes, so the grid runs over N tiles (x K splits) and each program keeps every row of
its M tile in registers: each weight tile is read from HBM once. A tile product runs on tensor cores (`tl.dot`,
M tiles of 16 rows or more) or, for batches of a few rows, on CUDA cores (`gemv`: each weight element is
multiplied by the 1, 2 or 4 rows of its M tile and summed along K), which wastes no tensor-core rows on padding.
A CUDA-core product sums its K tile across lanes (shuffles, and shared memory between warps) every iteration, or,
with `reduce_late`, keeps a register per tile element that each iteration only adds its products to, and sums
across lanes once after the K loop: no cross-lane traffic in the loop, for a tile's worth of fp32 registers.
When M spans several M tiles, the M tile is the fastest-varying program index, so the programs sharing a weight
tile run side by side and share it through L2.
Split-K writes fp32 partials [split_k, M, N] to a workspace that one reduce kernel sums in split order
(deterministic); with split_k == 1 the GEMM kernel writes y directly. Accumulation is always fp32.

CUDA-graph safe: the grid depends only on shapes, and the workspace is a plain `torch.empty` inside the call
(a captured call takes it from the graph's pool).

FP8 weights (`quantization=fp8`, replicas/layers/fp8_linear.py) are read as they are stored (one byte an element)
and each output column is scaled by its row scale once, after the K loop. Two ways to multiply a tile, both timed
by the selection (`fp8_dot`):
- weight-only: the E4M3 tile is widened to the activation dtype in registers (y[m, n] = scale[n] * sum_k
  x[m, k] * q[n, k]);
- FP8 tensor cores: each x tile is quantized to E4M3 in registers with one scale per row of the tile, and the
  tile product of the two FP8 operands is scaled by it before it is added. The scales are finer than the library
  path's one per token, and no separate activation kernel runs in front of the GEMM;
- FP8 tensor cores on activations quantized once per token in front of the GEMM (`token_scales`: the library
  path's numerics, y[m, n] = xs[m] * scale[n] * sum_k xq[m, k] * q[n, k]): an x tile takes one byte an element in
  shared memory instead of two, so more pipeline stages of weight fit, and the K loop does no quantizing. The
  caller quantizes (replicas/layers/fp8_linear.py) and passes x in FP8 with its row scales.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import triton
import triton.language as tl
from torch import Tensor


@dataclass(frozen=True)
class SkinnyConfig:
    block_m: int = 64
    block_n: int = 64
    block_k: int = 128
    split_k: int = 1
    num_warps: int = 4
    num_stages: int = 4
    fp8_dot: bool = False          # FP8 weights only: FP8 x FP8 tile products (module docstring)
    gemv: bool = False             # products on CUDA cores, no tensor-core tile: block_m may be 1, 2 or 4
    reduce_late: bool = False      # gemv only: sum across lanes once after the K loop (module docstring)
    token_scales: bool = False     # fp8_dot only: x comes quantized per token, with its row scales

    def __post_init__(self):
        if self.gemv and self.fp8_dot:
            raise ValueError("a skinny config multiplies on CUDA cores (gemv) or on FP8 tensor cores, not both")
        if self.reduce_late and not self.gemv:
            raise ValueError("reduce_late applies to CUDA-core products (gemv) only")
        if self.token_scales and not self.fp8_dot:
            raise ValueError("token_scales applies to FP8 tensor-core products (fp8_dot) only")

    def __str__(self) -> str:
        return (f"m{self.block_m}n{self.block_n}k{self.block_k}s{self.split_k}w{self.num_warps}st{self.num_stages}"
                f"{'d8' if self.fp8_dot else ''}{'t' if self.token_scales else ''}{'v' if self.gemv else ''}"
                f"{'r' if self.reduce_late else ''}")


def split_k_range(k: int, cfg: SkinnyConfig) -> int:
    """Keys per split: a multiple of block_k, so only the last chunk of K can be partial."""
    return triton.cdiv(triton.cdiv(k, cfg.split_k), cfg.block_k) * cfg.block_k


@triton.jit
def _skinny_gemm_kernel(
    x_ptr, w_ptr, s_ptr, xs_ptr, b_ptr, y_ptr, ws_ptr,
    M, N, K, stride_xm, stride_wn, stride_ym, k_per_split,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    SPLIT: tl.constexpr, EVEN_K: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_SCALE: tl.constexpr,
    FP8_DOT: tl.constexpr, FP8_MAX: tl.constexpr, TOKEN_SCALES: tl.constexpr, GEMV: tl.constexpr,
    REDUCE_LATE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    pid = tl.program_id(0)
    num_m = tl.cdiv(M, BLOCK_M)
    pid_m = pid % num_m
    pid_n = pid // num_m
    pid_k = tl.program_id(1)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    # Out-of-range rows / columns wrap onto valid ones: the loads need no M / N mask, the stores drop them.
    rows_in = rows % M
    cols_in = cols % N
    offs_k = tl.arange(0, BLOCK_K)
    k_lo = pid_k * k_per_split
    k_hi = tl.minimum(k_lo + k_per_split, K)
    x_ptrs = x_ptr + rows_in[:, None] * stride_xm + (k_lo + offs_k)[None, :]
    w_ptrs = w_ptr + cols_in[:, None] * stride_wn + (k_lo + offs_k)[None, :]
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    if REDUCE_LATE:
        lanes = tl.zeros([BLOCK_M, BLOCK_N, BLOCK_K], dtype=tl.float32)
    for k in range(k_lo, k_hi, BLOCK_K):
        if EVEN_K:
            x = tl.load(x_ptrs)
            w = tl.load(w_ptrs)
        else:
            k_mask = (k + offs_k) < k_hi
            x = tl.load(x_ptrs, mask=k_mask[None, :], other=0.0)
            w = tl.load(w_ptrs, mask=k_mask[None, :], other=0.0)
        if REDUCE_LATE:
            lanes += x.to(tl.float32)[:, None, :] * w.to(tl.float32)[None, :, :]
        elif GEMV:
            acc += tl.sum(x.to(tl.float32)[:, None, :] * w.to(tl.float32)[None, :, :], axis=2)
        elif TOKEN_SCALES:
            acc = tl.dot(x, tl.trans(w), acc)
        elif FP8_DOT:
            xf = x.to(tl.float32)
            xs = tl.maximum(tl.max(tl.abs(xf), axis=1) / FP8_MAX, 1e-12)
            xq = tl.minimum(tl.maximum(xf / xs[:, None], -FP8_MAX), FP8_MAX).to(w.dtype)
            acc += tl.dot(xq, tl.trans(w)) * xs[:, None]
        else:
            if HAS_SCALE:
                w = w.to(x.dtype)
            acc = tl.dot(x, tl.trans(w), acc, input_precision=DOT_PRECISION)
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    if REDUCE_LATE:
        acc = tl.sum(lanes, axis=2)

    if HAS_SCALE:                                   # per output column: commutes with the split-K sum
        acc *= tl.load(s_ptr + cols_in)[None, :]
    if TOKEN_SCALES:                                # per row, likewise
        acc *= tl.load(xs_ptr + rows_in)[:, None]
    out_mask = (rows < M)[:, None] & (cols < N)[None, :]
    if SPLIT:
        ws = ws_ptr + pid_k.to(tl.int64) * M * N + rows[:, None] * N + cols[None, :]
        tl.store(ws, acc, mask=out_mask)
    else:
        if HAS_BIAS:
            acc += tl.load(b_ptr + cols_in).to(tl.float32)[None, :]
        tl.store(y_ptr + rows[:, None] * stride_ym + cols[None, :], acc.to(y_ptr.dtype.element_ty), mask=out_mask)


@triton.jit
def _split_k_reduce_kernel(ws_ptr, b_ptr, y_ptr, M, N, SPLIT_K: tl.constexpr, HAS_BIAS: tl.constexpr,
                           BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    size = M * N
    mask = offs < size
    acc = tl.load(ws_ptr + offs, mask=mask, other=0.0)
    for s in tl.static_range(1, SPLIT_K):           # fixed order: the sum is the same on every run
        acc += tl.load(ws_ptr + s * size + offs, mask=mask, other=0.0)
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs % N, mask=mask, other=0.0).to(tl.float32)
    tl.store(y_ptr + offs, acc.to(y_ptr.dtype.element_ty), mask=mask)


def skinny_gemm(x: Tensor, weight: Tensor, bias: Optional[Tensor] = None, cfg: SkinnyConfig = SkinnyConfig(),
                scale: Optional[Tensor] = None, x_scale: Optional[Tensor] = None,
                out_dtype: Optional[torch.dtype] = None) -> Tensor:
    """x [..., K] @ weight[N, K]^T (+ bias[N]) -> [..., N] in `out_dtype` (default x's), accumulated in fp32. With
    `scale` (float32 [N]) the weight is FP8 and row n stands for scale[n] * weight[n]; with `x_scale` (float32, one
    per row of x; `cfg.token_scales`) x is FP8 too and its row m stands for x_scale[m] * x[m]."""
    *lead, k = x.shape
    n = weight.shape[0]
    assert weight.shape[1] == k and weight.stride(1) == 1
    assert x.dtype == weight.dtype if scale is None else (scale.shape == (n,) and scale.dtype == torch.float32)
    assert scale is not None or not cfg.fp8_dot
    assert (x_scale is not None) == cfg.token_scales and (x_scale is None or x.dtype == weight.dtype)
    x2 = x.reshape(-1, k)
    if x2.stride(1) != 1:
        x2 = x2.contiguous()
    m = x2.shape[0]
    y = torch.empty(m, n, dtype=out_dtype or x.dtype, device=x.device)
    if m == 0 or n == 0:
        return y.view(*lead, n)
    if k == 0:
        y.zero_()
        return (y if bias is None else y + bias).view(*lead, n)
    k_per_split = split_k_range(k, cfg)
    split = cfg.split_k > 1
    ws = torch.empty(cfg.split_k, m, n, dtype=torch.float32, device=x.device) if split else y
    b = bias if bias is not None else y
    grid = (triton.cdiv(m, cfg.block_m) * triton.cdiv(n, cfg.block_n), cfg.split_k)
    _skinny_gemm_kernel[grid](
        x2, weight, y if scale is None else scale, y if x_scale is None else x_scale, b, y, ws, m, n, k,
        x2.stride(0), weight.stride(0), y.stride(0),
        k_per_split, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
        SPLIT=split, EVEN_K=k % cfg.block_k == 0, HAS_BIAS=bias is not None, HAS_SCALE=scale is not None,
        FP8_DOT=cfg.fp8_dot, FP8_MAX=torch.finfo(weight.dtype).max if cfg.fp8_dot else 0.0,
        TOKEN_SCALES=cfg.token_scales, GEMV=cfg.gemv, REDUCE_LATE=cfg.reduce_late,
        DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    if split:
        block = 1024
        _split_k_reduce_kernel[(triton.cdiv(m * n, block),)](
            ws, b, y, m, n, SPLIT_K=cfg.split_k, HAS_BIAS=bias is not None, BLOCK=block, num_warps=4)
    return y.view(*lead, n)
