"""RMSNorm (with the fused residual add), rotary embedding and SiLU-and-mul on the CPU in C (float32, AVX2 + FMA),
through replicas/kernels/cpu_library.py: the CPU twins of replicas/kernels/elementwise.py, with the same contracts.
In torch each is several small ops (casts, pow, mean, rsqrt, chunk, cat, ...) whose dispatch costs more than their
arithmetic at decode sizes; here each is one call. `supports(x)` says whether a tensor can take them (float32 on
the CPU, last dim contiguous, no autograd, the library built); the layers take their torch path otherwise.
"""
from __future__ import annotations

import ctypes
import functools
from typing import Optional

import torch

from replicas.kernels import cpu_library

_SOURCE = r"""
/* Row r < R of x lies at x + (r / inner) * s0 + (r % inner) * s1 (a [T, inner, N] view, or [T, N] with inner 1).
   With res ([R, N] contiguous), h = x + res goes to new_res; else h = x. out [R, N] = w * h / sqrt(mean(h^2) + eps). */
void rms_norm(const float* x, int64_t s0, int64_t s1, int64_t inner, const float* res, float* new_res, const float* w,
              float* out, int64_t R, int64_t N, float eps) {
    #pragma omp parallel for schedule(static) if (R * N >= 65536)
    for (int64_t r = 0; r < R; ++r) {
        const float* xr = x + (r / inner) * s0 + (r % inner) * s1;
        const float* h = xr;
        if (res) {
            float* hr = new_res + r * N;
            const float* rr = res + r * N;
            int64_t i = 0;
            for (; i + 8 <= N; i += 8)
                _mm256_storeu_ps(hr + i, _mm256_add_ps(_mm256_loadu_ps(xr + i), _mm256_loadu_ps(rr + i)));
            for (; i < N; ++i) hr[i] = xr[i] + rr[i];
            h = hr;
        }
        __m256 acc = _mm256_setzero_ps();
        int64_t i = 0;
        for (; i + 8 <= N; i += 8) {
            const __m256 v = _mm256_loadu_ps(h + i);
            acc = _mm256_fmadd_ps(v, v, acc);
        }
        float ss = hsum(acc);
        for (; i < N; ++i) ss += h[i] * h[i];
        const float inv = 1.0f / sqrtf(ss / (float)N + eps);
        const __m256 vinv = _mm256_set1_ps(inv);
        float* o = out + r * N;
        for (i = 0; i + 8 <= N; i += 8)
            _mm256_storeu_ps(o + i, _mm256_mul_ps(_mm256_loadu_ps(w + i), _mm256_mul_ps(_mm256_loadu_ps(h + i), vinv)));
        for (; i < N; ++i) o[i] = w[i] * (h[i] * inv);
    }
}

/* In place on the first 2 * half dims of each head: x1, x2 = x[:half], x[half:2 half] (rotate_half layout);
   x1' = x1 cos - x2 sin, x2' = x2 cos + x1 sin. Token t's head h lies at x + t * st + h * sh; cos | sin of position p
   at cs + p * cstride. */
static void rotate(float* x, int64_t st, int64_t sh, int64_t heads, const int64_t* pos, const float* cs,
                   int64_t cstride, int64_t T, int64_t half) {
    #pragma omp parallel for schedule(static) if (T * heads * half >= 65536)
    for (int64_t t = 0; t < T; ++t) {
        const float* c = cs + pos[t] * cstride;
        const float* s = c + half;
        for (int64_t h = 0; h < heads; ++h) {
            float* a = x + t * st + h * sh;
            float* b = a + half;
            int64_t i = 0;
            for (; i + 8 <= half; i += 8) {
                const __m256 x1 = _mm256_loadu_ps(a + i), x2 = _mm256_loadu_ps(b + i);
                const __m256 vc = _mm256_loadu_ps(c + i), vs = _mm256_loadu_ps(s + i);
                _mm256_storeu_ps(a + i, _mm256_fmsub_ps(x1, vc, _mm256_mul_ps(x2, vs)));
                _mm256_storeu_ps(b + i, _mm256_fmadd_ps(x2, vc, _mm256_mul_ps(x1, vs)));
            }
            for (; i < half; ++i) {
                const float x1 = a[i], x2 = b[i];
                a[i] = x1 * c[i] - x2 * s[i];
                b[i] = x2 * c[i] + x1 * s[i];
            }
        }
    }
}

void rotary(float* q, int64_t qt, int64_t qh, int64_t H, float* k, int64_t kt, int64_t kh, int64_t Hkv,
            const int64_t* pos, const float* cs, int64_t cstride, int64_t T, int64_t half) {
    rotate(q, qt, qh, H, pos, cs, cstride, T, half);
    rotate(k, kt, kh, Hkv, pos, cs, cstride, T, half);
}

/* x [T, 2I] (row stride xs) = [gate | up] -> out [T, I] = gate / (1 + exp(-gate)) * up */
void silu_and_mul(const float* x, int64_t xs, float* out, int64_t T, int64_t I) {
    #pragma omp parallel for schedule(static) if (T * I >= 65536)
    for (int64_t t = 0; t < T; ++t) {
        const float* g = x + t * xs;
        const float* u = g + I;
        float* o = out + t * I;
        for (int64_t i = 0; i < I; ++i) o[i] = g[i] / (1.0f + expf(-g[i])) * u[i];
    }
}
"""


@functools.lru_cache(maxsize=None)
def _library():
    ptr, i64 = ctypes.c_void_p, ctypes.c_int64
    return cpu_library.load("elementwise_cpu", _SOURCE, {
        "rms_norm": [ptr, i64, i64, i64, ptr, ptr, ptr, ptr, i64, i64, ctypes.c_float],
        "rotary": [ptr, i64, i64, i64, ptr, i64, i64, i64, ptr, ptr, i64, i64, i64],
        "silu_and_mul": [ptr, i64, ptr, i64, i64]})


def supports(x: torch.Tensor) -> bool:
    """float32 on the CPU, last dim contiguous, no autograd (the kernels record no graph), the library built."""
    return (x.dtype == torch.float32 and x.device.type == "cpu" and x.stride(-1) == 1 and not x.requires_grad
            and _library() is not None)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, new_residual) for x [T, N] or [T, inner, N] (last dim contiguous): with a residual, h = x + residual is
    normed and returned as the new residual; without one, x is the new residual. weight float32 [N]."""
    n = x.shape[-1]
    assert x.dim() in (2, 3) and weight.shape == (n,) and weight.dtype == torch.float32 and weight.is_contiguous()
    inner = x.shape[1] if x.dim() == 3 else 1
    s1 = x.stride(1) if x.dim() == 3 else 0
    out = torch.empty(x.shape)
    new_residual = x
    if residual is not None:
        assert residual.shape == x.shape and residual.is_contiguous() and residual.dtype == torch.float32
        new_residual = torch.empty(x.shape)
    rows = out.numel() // n if n else 0
    if rows:
        _library().rms_norm(x.data_ptr(), x.stride(0), s1, inner,
                            None if residual is None else residual.data_ptr(),
                            None if residual is None else new_residual.data_ptr(),
                            weight.data_ptr(), out.data_ptr(), rows, n, eps)
    return out, new_residual


def apply_rotary(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor) -> None:
    """RoPE in place on q [T, H, D] and k [T, Hkv, D] (strided views allowed, last dim contiguous), rotate_half
    layout on the first rot_dim dims. cos_sin float32 [max_pos, rot_dim]: cos | sin halves. positions [T]."""
    T, H, D = q.shape
    rot = cos_sin.shape[1]
    assert k.shape[0] == T and k.shape[2] == D and rot <= D and rot % 2 == 0 and cos_sin.stride(-1) == 1
    if T == 0:
        return
    pos = positions.to(torch.int64).contiguous()
    _library().rotary(q.data_ptr(), q.stride(0), q.stride(1), H, k.data_ptr(), k.stride(0), k.stride(1), k.shape[1],
                      pos.data_ptr(), cos_sin.data_ptr(), cos_sin.stride(0), T, rot // 2)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x [T, 2I] = [gate | up] (last dim contiguous) -> silu(gate) * up, [T, I]."""
    T, width = x.shape
    assert width % 2 == 0
    out = torch.empty(T, width // 2)
    if T:
        _library().silu_and_mul(x.data_ptr(), x.stride(0), out.data_ptr(), T, width // 2)
    return out
