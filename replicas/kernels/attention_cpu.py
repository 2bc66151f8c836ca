"""Paged attention of decode rows and the KV store on the CPU (float32 cache, AVX2 + FMA), in C through
replicas/kernels/cpu_library.py: the torch backend's gathers, einsums and masks cost hundreds of small ops per step
at batch 1, more than the attention's arithmetic.

The cache is [num_blocks, 2, block_size, Hkv, D]; a decode row attends its query heads h (query head h reads KV head
h // (H / Hkv)) over positions 0..len-1 through its block table. (row, KV head) pairs are split over OpenMP threads.
`available()` is False where the kernels cannot be built: the torch backend then runs its torch path.
"""
from __future__ import annotations

import ctypes
import functools

import torch

from replicas.kernels import cpu_library

MAX_GROUP = 64          # query heads per KV head the kernel's stack arrays hold

_SOURCE = f"#define MAX_GROUP {MAX_GROUP}\n" + r"""
/* The cache's blocks lie bs floats apart, a block's V half vh floats after its K half; within a half, BS rows of
   HD = Hkv * D floats. k, v: T rows of HD floats, rows ks / vs floats apart; slots [T] (-1: write nowhere) */
void kv_store(const float* k, int64_t ks, const float* v, int64_t vs, float* cache, int64_t bs, int64_t vh,
              const int64_t* slots, int64_t T, int64_t BS, int64_t HD) {
    for (int64_t t = 0; t < T; ++t) {
        const int64_t s = slots[t];
        if (s < 0) continue;
        float* kd = cache + (s / BS) * bs + (s % BS) * HD;
        memcpy(kd, k + t * ks, HD * sizeof(float));
        memcpy(kd + vh, v + t * vs, HD * sizeof(float));
    }
}

/* Decode rows b < B: query token toks[b] (q row stride qs, output row stride os), length lens[b], block table
   tables + b * MB. scratch: B * H * maxlen floats. D % 8 == 0. */
void decode_attention(const float* q, int64_t qs, const float* cache, int64_t bs, int64_t vh, const int32_t* tables,
                      int64_t MB,
                      const int64_t* toks, const int32_t* lens, int64_t B, int64_t H, int64_t Hkv, int64_t D,
                      int64_t BS, float scale, float* scratch, int64_t maxlen, float* out, int64_t os) {
    const int64_t G = H / Hkv, HD = Hkv * D;
    #pragma omp parallel for schedule(static)
    for (int64_t item = 0; item < B * Hkv; ++item) {
        const int64_t b = item / Hkv, hk = item % Hkv, L = lens[b];
        const int32_t* table = tables + b * MB;
        float* p = scratch + (b * H + hk * G) * maxlen;            /* G rows of maxlen scores */
        const float* qb = q + toks[b] * qs + hk * G * D;
        float mx[MAX_GROUP], sum[MAX_GROUP];
        for (int64_t g = 0; g < G; ++g) mx[g] = -INFINITY, sum[g] = 0.f;
        for (int64_t l = 0; l < L; ++l) {
            const float* kl = cache + (int64_t)table[l / BS] * bs + (l % BS) * HD + hk * D;
            for (int64_t g = 0; g < G; ++g) {
                __m256 acc = _mm256_setzero_ps();
                for (int64_t d = 0; d < D; d += 8)
                    acc = _mm256_fmadd_ps(_mm256_loadu_ps(qb + g * D + d), _mm256_loadu_ps(kl + d), acc);
                const float s = hsum(acc) * scale;
                p[g * maxlen + l] = s;
                if (s > mx[g]) mx[g] = s;
            }
        }
        for (int64_t g = 0; g < G; ++g)
            for (int64_t l = 0; l < L; ++l) {
                const float e = expf(p[g * maxlen + l] - mx[g]);
                p[g * maxlen + l] = e;
                sum[g] += e;
            }
        for (int64_t g = 0; g < G; ++g) {
            float* o = out + toks[b] * os + (hk * G + g) * D;
            memset(o, 0, D * sizeof(float));
        }
        for (int64_t l = 0; l < L; ++l) {
            const float* vl = cache + (int64_t)table[l / BS] * bs + vh + (l % BS) * HD + hk * D;
            for (int64_t g = 0; g < G; ++g) {
                float* o = out + toks[b] * os + (hk * G + g) * D;
                const __m256 w = _mm256_set1_ps(p[g * maxlen + l] / sum[g]);
                for (int64_t d = 0; d < D; d += 8)
                    _mm256_storeu_ps(o + d, _mm256_fmadd_ps(w, _mm256_loadu_ps(vl + d), _mm256_loadu_ps(o + d)));
            }
        }
    }
}
"""

@functools.lru_cache(maxsize=None)
def _library():
    ptr, i64 = ctypes.c_void_p, ctypes.c_int64
    return cpu_library.load("attention_cpu", _SOURCE, {
        "kv_store": [ptr, i64, ptr, i64, ptr, i64, i64, ptr, i64, i64, i64],
        "decode_attention": [ptr, i64, ptr, i64, i64, ptr, i64, ptr, ptr, i64, i64, i64, i64, i64, ctypes.c_float,
                             ptr, i64, ptr, i64]})


def available() -> bool:
    return _library() is not None


def supports(q: torch.Tensor, kv_cache: torch.Tensor) -> bool:
    """Whether these kernels take this layer: a float32 CPU cache and query, head size a multiple of 8, each half
    block of the cache contiguous (blocks and halves may lie apart: a layer's cache can be a view)."""
    H, D = q.shape[1], q.shape[2]
    Hkv = kv_cache.shape[3]
    return (q.device.type == "cpu" and kv_cache.dtype == torch.float32 and q.dtype == torch.float32
            and kv_cache.stride()[2:] == (Hkv * D, D, 1) and D % 8 == 0 and H % Hkv == 0 and H // Hkv <= MAX_GROUP
            and available())


def _rows(t: torch.Tensor) -> torch.Tensor:
    """t [T, heads, D] with each token's heads contiguous (a row of a fused projection qualifies)."""
    return t if t.stride(2) == 1 and t.stride(1) == t.shape[2] else t.contiguous()


def kv_store(k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Write k, v [T, Hkv, D] into the cache at slot_mapping [T] (int64; -1 writes nowhere)."""
    k, v = _rows(k), _rows(v)
    slots = slot_mapping.to(torch.int64).contiguous()
    _library().kv_store(k.data_ptr(), k.stride(0), v.data_ptr(), v.stride(0), kv_cache.data_ptr(), kv_cache.stride(0),
                        kv_cache.stride(1), slots.data_ptr(), k.shape[0], kv_cache.shape[2], k.shape[1] * k.shape[2])


def decode_attention(q: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor, tokens: torch.Tensor,
                     lens: torch.Tensor, max_len: int, scale: float, out: torch.Tensor) -> None:
    """out[tokens[b]] = attention of q[tokens[b]] [H, D] over the first lens[b] cached positions of block_tables[b];
    q and out [T, H, D]. block_tables int32 [B, MB], tokens int64 [B], lens int32 [B], each contiguous (the torch
    backend's plan makes them so, once per step)."""
    q = _rows(q)
    assert out.stride(2) == 1 and out.stride(1) == out.shape[2]
    assert block_tables.dtype == lens.dtype == torch.int32 and tokens.dtype == torch.int64
    B, H, D = tokens.shape[0], q.shape[1], q.shape[2]
    scratch = torch.empty(B * H * max_len)
    _library().decode_attention(q.data_ptr(), q.stride(0), kv_cache.data_ptr(), kv_cache.stride(0), kv_cache.stride(1),
                                block_tables.data_ptr(), block_tables.shape[1],
                                tokens.data_ptr(), lens.data_ptr(), B, H, kv_cache.shape[3], D, kv_cache.shape[2],
                                scale, scratch.data_ptr(), max_len, out.data_ptr(), out.stride(0))
