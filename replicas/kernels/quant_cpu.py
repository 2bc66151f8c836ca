"""Weight-only GEMM for small batches on x86 CPUs (AVX2 + FMA) over GGUF Q4_0 / Q4_1 / Q8_0 blocks: a C kernel
built once with the system compiler (about a second, cached under ~/.cache/tidal) and called through ctypes.

Weights keep the GGUF block layout, one group per 32 inputs of an output row, with float32 scales:
- 4-bit (Q4_0, Q4_1): q uint8 [N, K/32, 16], low nibbles inputs 0..15 and high nibbles inputs 16..31, and a
  zero per group: w = scale * q + zero (Q4_0: zero = -8 * scale; Q4_1: zero = the block's min);
- 8-bit (Q8_0): q int8 [N, K/32, 32], w = scale * q.
Activations are quantized to int8 per group of 32 (llama.cpp's Q8 activations), so a group's dot product is one
integer multiply-add chain: y[m, n] = sum_g scale[n, g] * xd[m, g] * dot(q[n, g], xq[m, g]) + zero[n, g] *
sum(x[m, g]). That costs a relative error of about 1% per output against the float product of the dequantized
weight. Output rows are split over OpenMP threads (torch's own libgomp, so torch.set_num_threads applies and
its pool stays warm between torch ops: a single-threaded kernel let torch's workers fall asleep between
calls, and waking them for every small op in attention cost more than the kernel saved).

torch's `_weight_int4pack_mm_for_cpu` (group-wise int4) and `_weight_int8pack_mm` (per-channel int8) have no
vectorized AVX2 path: on an AVX2-only machine they run several times slower than the float32 GEMV they should
beat, and a torch C++ extension takes minutes to compile; hence this file. `available()` is False where the
kernel cannot be built (no compiler, no AVX2): callers then dequantize.
"""
from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import subprocess
import tempfile

import torch

log = logging.getLogger(__name__)

GROUP = 32
MAX_ROWS = 32         # larger batches (prefill) dequantize and run the float GEMM: compute dominates there

_SOURCE = r"""
#include <stdint.h>
#include <math.h>
#include <immintrin.h>

static inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* Each group of 32 activations quantized to int8 with its own scale (as llama.cpp does for its Q4/Q8 dot
   products), so a group's dot product is one integer multiply-add chain. x [M, G*32]; xq [M, G*32]; xd, xsum [M, G] */
static void quantize_rows(const float* x, int8_t* xq, float* xd, float* xsum, int64_t M, int64_t G) {
    const __m256 sign = _mm256_set1_ps(-0.0f);
    for (int64_t i = 0; i < M * G; ++i) {
        const float* xi = x + i * 32;
        __m256 v[4], amax = _mm256_setzero_ps(), sum = _mm256_setzero_ps();
        for (int j = 0; j < 4; ++j) {
            v[j] = _mm256_loadu_ps(xi + 8 * j);
            amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, v[j]));
            sum = _mm256_add_ps(sum, v[j]);
        }
        __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
        m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
        m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
        float d = _mm_cvtss_f32(m4) / 127.f;
        xd[i] = d;
        xsum[i] = hsum(sum);
        __m256 inv = _mm256_set1_ps(d > 0.f ? 1.f / d : 0.f);
        __m256i r[4];
        for (int j = 0; j < 4; ++j)
            r[j] = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(v[j], inv),
                                                      _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
        /* packs work per 128-bit lane: the permute restores element order */
        __m256i b = _mm256_packs_epi16(_mm256_packs_epi32(r[0], r[1]), _mm256_packs_epi32(r[2], r[3]));
        b = _mm256_permutevar8x32_epi32(b, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
        _mm256_storeu_si256((__m256i*)(xq + i * 32), b);
    }
}

/* q [N, G, 16] (nibbles), scale/zero [N, G], y [M, N]; x's rows go through in passes of 8 */
void q4_gemm(const float* x, int8_t* xq, float* xd, float* xsum, const uint8_t* q, const float* scale,
             const float* zero, float* y, int64_t M, int64_t N, int64_t G) {
    quantize_rows(x, xq, xd, xsum, M, G);
    const __m128i mask = _mm_set1_epi8(0x0F);
    const __m256i ones = _mm256_set1_epi16(1);
    #pragma omp parallel for schedule(static)
    for (int64_t n = 0; n < N; ++n) for (int64_t m0 = 0; m0 < M; m0 += 8) {
        const int64_t mm = M - m0 < 8 ? M - m0 : 8;   /* rows of x per pass; the weight row stays in L1 */
        __m256 acc[8];
        float zacc[8];
        for (int m = 0; m < mm; ++m) { acc[m] = _mm256_setzero_ps(); zacc[m] = 0.f; }
        const uint8_t* qn = q + n * G * 16;
        for (int64_t g = 0; g < G; ++g) {
            __m128i b = _mm_loadu_si128((const __m128i*)(qn + g * 16));
            __m256i w = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(b, 4), mask), _mm_and_si128(b, mask));
            float s = scale[n * G + g], z = zero[n * G + g];
            for (int m = 0; m < mm; ++m) {
                const int64_t r = (m0 + m) * G + g;
                __m256i a = _mm256_loadu_si256((const __m256i*)(xq + r * 32));
                __m256i p = _mm256_madd_epi16(_mm256_maddubs_epi16(w, a), ones);
                acc[m] = _mm256_fmadd_ps(_mm256_set1_ps(s * xd[r]), _mm256_cvtepi32_ps(p), acc[m]);
                zacc[m] += z * xsum[r];
            }
        }
        for (int m = 0; m < mm; ++m) y[(m0 + m) * N + n] = hsum(acc[m]) + zacc[m];
    }
}

/* q [N, G, 32] int8, scale [N, G], y [M, N]: w = scale * q (GGUF Q8_0) */
void q8_gemm(const float* x, int8_t* xq, float* xd, float* xsum, const int8_t* q, const float* scale,
             float* y, int64_t M, int64_t N, int64_t G) {
    quantize_rows(x, xq, xd, xsum, M, G);
    const __m256i ones = _mm256_set1_epi16(1);
    #pragma omp parallel for schedule(static)
    for (int64_t n = 0; n < N; ++n) for (int64_t m0 = 0; m0 < M; m0 += 8) {
        const int64_t mm = M - m0 < 8 ? M - m0 : 8;
        __m256 acc[8];
        for (int m = 0; m < mm; ++m) acc[m] = _mm256_setzero_ps();
        const int8_t* qn = q + n * G * 32;
        for (int64_t g = 0; g < G; ++g) {
            __m256i w = _mm256_loadu_si256((const __m256i*)(qn + g * 32));
            __m256i wabs = _mm256_sign_epi8(w, w);     /* maddubs needs an unsigned operand: |w| * sign(w) * a */
            float s = scale[n * G + g];
            for (int m = 0; m < mm; ++m) {
                const int64_t r = (m0 + m) * G + g;
                __m256i a = _mm256_sign_epi8(_mm256_loadu_si256((const __m256i*)(xq + r * 32)), w);
                __m256i p = _mm256_madd_epi16(_mm256_maddubs_epi16(wabs, a), ones);
                acc[m] = _mm256_fmadd_ps(_mm256_set1_ps(s * xd[r]), _mm256_cvtepi32_ps(p), acc[m]);
            }
        }
        for (int m = 0; m < mm; ++m) y[(m0 + m) * N + n] = hsum(acc[m]);
    }
}

/* w [N, G*32] = the float weight; zero NULL for 8-bit */
void dequantize(const void* q, const float* scale, const float* zero, float* w, int64_t N, int64_t G) {
    for (int64_t i = 0; i < N * G; ++i) {
        float s = scale[i], z = zero ? zero[i] : 0.f;
        float* wi = w + i * 32;
        if (zero) {
            const uint8_t* qi = (const uint8_t*)q + i * 16;
            for (int j = 0; j < 16; ++j) { wi[j] = s * (qi[j] & 15) + z; wi[j + 16] = s * (qi[j] >> 4) + z; }
        } else {
            const int8_t* qi = (const int8_t*)q + i * 32;
            for (int j = 0; j < 32; ++j) wi[j] = s * qi[j];
        }
    }
}
"""


def _build(path: str) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        src, out = os.path.join(tmp, "quant.c"), os.path.join(tmp, "quant.so")
        with open(src, "w") as f:
            f.write(_SOURCE)
        subprocess.run(["cc", "-O3", "-mavx2", "-mfma", "-fopenmp", "-shared", "-fPIC", src, "-o", out],
                       check=True, capture_output=True, timeout=120)
        os.replace(out, path)      # atomic: concurrent builders each install a complete file


@functools.lru_cache(maxsize=None)
def _library():
    if torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512"):
        return None
    digest = hashlib.sha256(_SOURCE.encode()).hexdigest()[:16]
    path = os.path.join(os.path.expanduser("~"), ".cache", "tidal", f"quant_cpu_{digest}.so")
    try:
        if not os.path.exists(path):
            _build(path)
        lib = ctypes.CDLL(path)
    except (OSError, subprocess.SubprocessError) as e:
        log.warning("the quantized CPU GEMM could not be built (%s); quantized layers dequantize per matmul", e)
        return None
    lib.q4_gemm.argtypes = [ctypes.c_void_p] * 8 + [ctypes.c_int64] * 3
    lib.q8_gemm.argtypes = [ctypes.c_void_p] * 7 + [ctypes.c_int64] * 3
    lib.dequantize.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int64] * 2
    lib.q4_gemm.restype = lib.q8_gemm.restype = lib.dequantize.restype = None
    return lib


def available() -> bool:
    return _library() is not None


def gemm(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None) -> torch.Tensor:
    """x float32 [M, K] (1 <= M <= MAX_ROWS) times the weight (q, scale, zero) of the layout above -> [M, N]:
    4-bit when q is uint8 [N, K/32, 16] (zero given), 8-bit when q is int8 [N, K/32, 32] (zero None).
    q, scale and zero must be contiguous CPU tensors (the layer stores them so)."""
    m, n, g = x.shape[0], q.shape[0], q.shape[1]
    if not (1 <= m <= MAX_ROWS and x.shape[1] == g * GROUP and x.dtype == torch.float32):
        raise ValueError(f"quantized gemm: x {tuple(x.shape)} {x.dtype} does not fit the weight [{n}, {g * GROUP}]")
    x = x.contiguous()
    xq = torch.empty(m, g * GROUP, dtype=torch.int8)
    xd, xsum, y = torch.empty(m, g), torch.empty(m, g), torch.empty(m, n)
    lib = _library()
    if zero is None:
        lib.q8_gemm(x.data_ptr(), xq.data_ptr(), xd.data_ptr(), xsum.data_ptr(), q.data_ptr(), scale.data_ptr(),
                    y.data_ptr(), m, n, g)
    else:
        lib.q4_gemm(x.data_ptr(), xq.data_ptr(), xd.data_ptr(), xsum.data_ptr(), q.data_ptr(), scale.data_ptr(),
                    zero.data_ptr(), y.data_ptr(), m, n, g)
    return y


def dequantize(q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None) -> torch.Tensor:
    """The float32 [N, K] weight of (q, scale, zero)."""
    lib = _library()
    if lib is not None and q.is_contiguous() and scale.is_contiguous() and (zero is None or zero.is_contiguous()):
        n, g = q.shape[0], q.shape[1]
        w = torch.empty(n, g * GROUP)
        lib.dequantize(q.data_ptr(), scale.data_ptr(), None if zero is None else zero.data_ptr(), w.data_ptr(), n, g)
        return w
    w = q.to(torch.float32) if zero is None else torch.cat([q & 0x0F, q >> 4], dim=-1).to(torch.float32)
    w = w * scale[..., None]
    return (w if zero is None else w + zero[..., None]).flatten(1)
