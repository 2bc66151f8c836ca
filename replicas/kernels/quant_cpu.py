"""Weight-only GEMM for small batches on x86 CPUs (AVX2 + FMA) over GGUF Q4_0 / Q4_1 / Q8_0 blocks: a C kernel
built and loaded by replicas/kernels/cpu_library.py.

Weights keep the GGUF block layout, one group per 32 inputs of an output row, with float32 scales:
- 4-bit (Q4_0, Q4_1): q uint8 [N, K/32, 16], low nibbles inputs 0..15 and high nibbles inputs 16..31, and a
  zero per group: w = scale * q + zero (Q4_0: zero = -8 * scale; Q4_1: zero = the block's min);
- 8-bit (Q8_0): q int8 [N, K/32, 32], w = scale * q.
Activations stay float32: y[m, n] = sum_g scale[n, g] * dot(q[n, g], x[m, g]) + zero[n, g] * sum(x[m, g]), the
product of the dequantized weight up to summation order, so the quantized path decodes what `quantization=none`
decodes (llama.cpp rounds activations to int8 per group instead, about 0.5% relative error per output, which on a
135M model changes greedy text). Decode is bound by weight bytes, which this keeps at GGUF's size; the quants are
widened to float once per group for all rows of a pass. Output rows are split over OpenMP threads (a single-threaded
kernel let torch's workers fall asleep between calls, and waking them for every small op cost more than the kernel
saved).

torch's `_weight_int4pack_mm_for_cpu` (group-wise int4) and `_weight_int8pack_mm` (per-channel int8) have no
vectorized AVX2 path: on an AVX2-only machine they run several times slower than the float32 GEMV they should
beat, and a torch C++ extension takes minutes to compile; hence this file. `available()` is False where the
kernel cannot be built (no compiler, no AVX2): callers then dequantize.
"""
from __future__ import annotations

import ctypes
import functools

import torch

from replicas.kernels import cpu_library

GROUP = 32
MAX_ROWS = 32         # larger batches (prefill) dequantize and run the float GEMM: compute dominates there

_SOURCE = r"""
#define ROWS 4

/* dot(w, x) of one group of 32 as 8 float partial sums */
INLINE __m256 group_dot(const __m256 w[4], const float* xg) {
    __m256 d = _mm256_mul_ps(w[0], _mm256_loadu_ps(xg));
    d = _mm256_fmadd_ps(w[1], _mm256_loadu_ps(xg + 8), d);
    d = _mm256_fmadd_ps(w[2], _mm256_loadu_ps(xg + 16), d);
    return _mm256_fmadd_ps(w[3], _mm256_loadu_ps(xg + 24), d);
}

/* One output n for MM rows of x [M, G*32]. MM is a constant once inlined (FOR_ROWS's switch), so the
   accumulators live in registers. xsum [M, G]: the groups' float sums, for the zero term. */
INLINE void q4_rows(const float* x, const float* xsum, const uint8_t* qn, const float* sn, const float* zn, float* y,
                    int64_t N, int64_t G, int64_t m0, int64_t n, const int MM) {
    const __m128i mask = _mm_set1_epi8(0x0F);
    __m256 acc[ROWS];
    float zacc[ROWS];
    for (int m = 0; m < MM; ++m) { acc[m] = _mm256_setzero_ps(); zacc[m] = 0.f; }
    for (int64_t g = 0; g < G; ++g) {
        const __m128i b = _mm_loadu_si128((const __m128i*)(qn + g * 16));
        const __m128i lo = _mm_and_si128(b, mask), hi = _mm_and_si128(_mm_srli_epi16(b, 4), mask);
        const __m256 w[4] = {_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(lo)),
                             _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(lo, 8))),
                             _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(hi)),
                             _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(hi, 8)))};
        const __m256 s = _mm256_set1_ps(sn[g]);
        for (int m = 0; m < MM; ++m) {
            acc[m] = _mm256_fmadd_ps(s, group_dot(w, x + (m0 + m) * G * 32 + g * 32), acc[m]);
            zacc[m] += zn[g] * xsum[(m0 + m) * G + g];
        }
    }
    for (int m = 0; m < MM; ++m) y[(m0 + m) * N + n] = hsum(acc[m]) + zacc[m];
}

INLINE void q8_rows(const float* x, const int8_t* qn, const float* sn, float* y, int64_t N, int64_t G, int64_t m0,
                    int64_t n, const int MM) {
    __m256 acc[ROWS];
    for (int m = 0; m < MM; ++m) acc[m] = _mm256_setzero_ps();
    for (int64_t g = 0; g < G; ++g) {
        __m256 w[4];
        for (int j = 0; j < 4; ++j)
            w[j] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)(qn + g * 32 + 8 * j))));
        const __m256 s = _mm256_set1_ps(sn[g]);
        for (int m = 0; m < MM; ++m)
            acc[m] = _mm256_fmadd_ps(s, group_dot(w, x + (m0 + m) * G * 32 + g * 32), acc[m]);
    }
    for (int m = 0; m < MM; ++m) y[(m0 + m) * N + n] = hsum(acc[m]);
}

/* Output rows are split over the threads; x's rows go through in passes of ROWS, the weight row staying in L1 */
#define FOR_ROWS(CALL)                                                          \
    _Pragma("omp parallel for schedule(static)")                               \
    for (int64_t n = 0; n < N; ++n)                                            \
        for (int64_t m0 = 0; m0 < M; m0 += ROWS)                               \
            switch (M - m0 < ROWS ? M - m0 : ROWS) {                           \
                case 1: CALL(1); break;                                        \
                case 2: CALL(2); break;                                        \
                case 3: CALL(3); break;                                        \
                default: CALL(4); break;                                       \
            }

/* x [M, G*32]; q [N, G, 16] (nibbles), scale/zero [N, G]; xsum [M, G] scratch; y [M, N] */
void q4_gemm(const float* x, float* xsum, const uint8_t* q, const float* scale, const float* zero, float* y,
             int64_t M, int64_t N, int64_t G) {
    for (int64_t i = 0; i < M * G; ++i) {
        const float* xi = x + i * 32;
        xsum[i] = hsum(_mm256_add_ps(_mm256_add_ps(_mm256_loadu_ps(xi), _mm256_loadu_ps(xi + 8)),
                                     _mm256_add_ps(_mm256_loadu_ps(xi + 16), _mm256_loadu_ps(xi + 24))));
    }
#define Q4(MM) q4_rows(x, xsum, q + n * G * 16, scale + n * G, zero + n * G, y, N, G, m0, n, MM)
    FOR_ROWS(Q4)
}

/* x [M, G*32]; q [N, G, 32] int8, scale [N, G]; y [M, N] */
void q8_gemm(const float* x, const int8_t* q, const float* scale, float* y, int64_t M, int64_t N, int64_t G) {
#define Q8(MM) q8_rows(x, q + n * G * 32, scale + n * G, y, N, G, m0, n, MM)
    FOR_ROWS(Q8)
}

/* w [N, G*32] = the float weight; zero NULL for 8-bit */
void dequantize(const void* q, const float* scale, const float* zero, float* w, int64_t N, int64_t G) {
    #pragma omp parallel for schedule(static)
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


@functools.lru_cache(maxsize=None)
def _library():
    ptr, i64 = ctypes.c_void_p, ctypes.c_int64
    return cpu_library.load("quant_cpu", _SOURCE, {"q4_gemm": [ptr] * 6 + [i64] * 3, "q8_gemm": [ptr] * 4 + [i64] * 3,
                                                    "dequantize": [ptr] * 4 + [i64] * 2})


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
    y = torch.empty(m, n)
    lib = _library()
    if zero is None:
        lib.q8_gemm(x.data_ptr(), q.data_ptr(), scale.data_ptr(), y.data_ptr(), m, n, g)
    else:
        xsum = torch.empty(m, g)
        lib.q4_gemm(x.data_ptr(), xsum.data_ptr(), q.data_ptr(), scale.data_ptr(), zero.data_ptr(), y.data_ptr(),
                    m, n, g)
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
