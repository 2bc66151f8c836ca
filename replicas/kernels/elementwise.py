"""Fused elementwise kernels of a decoder layer: add+RMSNorm, RoPE (in place), SiLU-and-mul.

Torch definitions: reference.rms_norm_reference, reference.apply_rotary_reference, reference.silu_and_mul_reference.
All math in float32, rounded to the activation dtype where HF Llama rounds.
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl
from torch import Tensor


@triton.jit
def _rms_norm_kernel(
    x_ptr, res_ptr, w_ptr, out_ptr, new_res_ptr,
    stride_x0, stride_x1, inner_rows, n_cols, eps,
    HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    # x may be a [T, H, N] view with arbitrary token/head strides (e.g. per-head q/k norm on a qkv slice).
    x = tl.load(x_ptr + (row // inner_rows) * stride_x0 + (row % inner_rows) * stride_x1 + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + row * n_cols + cols, mask=mask, other=0.0)
        h = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)
        tl.store(new_res_ptr + row * n_cols + cols, h, mask=mask)
    else:
        h = x
    hf = h.to(tl.float32)
    inv_rms = tl.rsqrt(tl.sum(hf * hf, 0) / n_cols + eps)
    normed = (hf * inv_rms).to(x.dtype).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * n_cols + cols, (w * normed).to(out_ptr.dtype.element_ty), mask=mask)


def rms_norm(x: Tensor, weight: Tensor, eps: float, residual: Optional[Tensor] = None) -> tuple[Tensor, Tensor]:
    """(out, new_residual) for x [..., N] (at most 3 dims, last contiguous). With a residual, h = x + residual is
    normed and returned as the new residual (fused add+norm); without one, x is the new residual."""
    n = x.shape[-1]
    assert x.stride(-1) == 1 and x.dim() in (2, 3) and weight.shape == (n,)
    inner = x.shape[1] if x.dim() == 3 else 1
    stride0, stride1 = x.stride(0), (x.stride(1) if x.dim() == 3 else 0)
    rows = x.numel() // n
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    new_residual = x
    if residual is not None:
        assert residual.shape == x.shape and residual.is_contiguous()
        new_residual = torch.empty_like(out)
    if rows == 0:
        return out, new_residual
    block = triton.next_power_of_2(n)
    _rms_norm_kernel[(rows,)](
        x, residual if residual is not None else x, weight, out, new_residual,
        stride0, stride1, inner, n, eps,
        HAS_RESIDUAL=residual is not None, BLOCK=block, num_warps=min(16, max(1, block // 256)),
    )
    return out, new_residual


@triton.jit
def _rotate_heads(base_ptr, stride_h, cos, sin, i, i_mask,
                  NUM_HEADS: tl.constexpr, BLOCK_H: tl.constexpr, HALF: tl.constexpr):
    h = tl.arange(0, BLOCK_H)[:, None]
    mask = (h < NUM_HEADS) & i_mask[None, :]
    first = base_ptr + h * stride_h + i[None, :]
    x1 = tl.load(first, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(first + HALF, mask=mask, other=0.0).to(tl.float32)
    tl.store(first, (x1 * cos - x2 * sin).to(base_ptr.dtype.element_ty), mask=mask)
    tl.store(first + HALF, (x2 * cos + x1 * sin).to(base_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rotary_kernel(
    q_ptr, k_ptr, positions_ptr, cache_ptr,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_cache,
    NUM_Q_HEADS: tl.constexpr, NUM_K_HEADS: tl.constexpr, HALF: tl.constexpr,
    BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr, BLOCK_HALF: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    pos = tl.load(positions_ptr + t).to(tl.int64)
    i = tl.arange(0, BLOCK_HALF)
    i_mask = i < HALF
    cos = tl.load(cache_ptr + pos * stride_cache + i, mask=i_mask, other=0.0).to(tl.float32)[None, :]
    sin = tl.load(cache_ptr + pos * stride_cache + HALF + i, mask=i_mask, other=0.0).to(tl.float32)[None, :]
    _rotate_heads(q_ptr + t * stride_qt, stride_qh, cos, sin, i, i_mask, NUM_Q_HEADS, BLOCK_HQ, HALF)
    _rotate_heads(k_ptr + t * stride_kt, stride_kh, cos, sin, i, i_mask, NUM_K_HEADS, BLOCK_HK, HALF)


def apply_rotary(q: Tensor, k: Tensor, positions: Tensor, cos_sin_cache: Tensor) -> None:
    """RoPE in place on q [T, H, D] and k [T, Hkv, D] (strided views allowed, last dim contiguous), neox /
    HF-llama rotate_half layout on the first rot_dim dims. cos_sin_cache [max_pos, rot_dim]: cos | sin halves
    (see reference.rotary_cos_sin_cache). positions [T] int32/int64."""
    num_tokens, num_q_heads, head_dim = q.shape
    num_k_heads = k.shape[1]
    rot = cos_sin_cache.shape[1]
    assert k.shape[0] == num_tokens and k.shape[2] == head_dim and rot <= head_dim and rot % 2 == 0
    assert q.stride(-1) == 1 and k.stride(-1) == 1 and cos_sin_cache.stride(-1) == 1
    if num_tokens == 0:
        return
    _rotary_kernel[(num_tokens,)](
        q, k, positions, cos_sin_cache,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), cos_sin_cache.stride(0),
        NUM_Q_HEADS=num_q_heads, NUM_K_HEADS=num_k_heads, HALF=rot // 2,
        BLOCK_HQ=triton.next_power_of_2(num_q_heads), BLOCK_HK=triton.next_power_of_2(num_k_heads),
        BLOCK_HALF=triton.next_power_of_2(rot // 2), num_warps=4,
    )


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, stride_x, n_inter, BLOCK: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_inter
    gate = tl.load(x_ptr + t * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + t * stride_x + n_inter + cols, mask=mask, other=0.0).to(tl.float32)
    act = gate / (1.0 + tl.exp(-gate)) * up
    tl.store(out_ptr + t * n_inter + cols, act.to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul(x: Tensor) -> Tensor:
    """x [T, 2I] = [gate | up] -> silu(gate) * up, [T, I]."""
    num_tokens, width = x.shape
    assert width % 2 == 0 and x.stride(-1) == 1
    n_inter = width // 2
    out = torch.empty(num_tokens, n_inter, dtype=x.dtype, device=x.device)
    if num_tokens == 0:
        return out
    block = min(1024, triton.next_power_of_2(n_inter))
    _silu_and_mul_kernel[(num_tokens, triton.cdiv(n_inter, block))](x, out, x.stride(0), n_inter, BLOCK=block,
                                                                     num_warps=4)
    return out
