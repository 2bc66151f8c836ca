"""Per-row dynamic FP8 quantization of activations on the GPU, one kernel: q[m] = round(x[m] / s[m]) in E4M3 with
s[m] = max(max_k |x[m, k]| / FP8_MAX, MIN_SCALE), the rule `fp8_linear.quantize_rows` writes in torch ops (which
take five passes over x where this takes two reads and one write)."""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor


@triton.jit
def _quantize_rows_kernel(x_ptr, q_ptr, s_ptr, K, stride_x, stride_q,
                          FP8_MAX: tl.constexpr, MIN_SCALE: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    amax = tl.zeros([BLOCK], dtype=tl.float32)
    for k in range(0, K, BLOCK):
        v = tl.load(x_ptr + row * stride_x + k + offs, mask=k + offs < K, other=0.0).to(tl.float32)
        amax = tl.maximum(amax, tl.abs(v))
    scale = tl.maximum(tl.max(amax, axis=0) / FP8_MAX, MIN_SCALE)
    for k in range(0, K, BLOCK):
        mask = k + offs < K
        v = tl.load(x_ptr + row * stride_x + k + offs, mask=mask, other=0.0).to(tl.float32)
        q = tl.minimum(tl.maximum(tl.math.div_rn(v, scale), -FP8_MAX), FP8_MAX)   # IEEE division, as torch's
        q = q.to(q_ptr.dtype.element_ty, fp_downcast_rounding="rtne")
        tl.store(q_ptr + row * stride_q + k + offs, q, mask=mask)
    tl.store(s_ptr + row, scale)


def quantize_rows_fp8(x: Tensor, fp8_max: float, min_scale: float, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """(q [M, K] in `dtype`, scale float32 [M]) for a 2-D x whose last dimension is contiguous."""
    m, k = x.shape
    assert x.stride(1) == 1
    q = torch.empty(m, k, dtype=dtype, device=x.device)
    scale = torch.empty(m, dtype=torch.float32, device=x.device)
    if m:
        block = min(2048, triton.next_power_of_2(max(k, 16)))
        _quantize_rows_kernel[(m,)](x, q, scale, k, x.stride(0), q.stride(0), FP8_MAX=fp8_max, MIN_SCALE=min_scale,
                                    BLOCK=block, num_warps=4 if block <= 1024 else 8)
    return q, scale
