"""Programmatic dependent launch on the GPU: a chain of decode-path kernels (add+RMSNorm, split-K and plain
skinny GEMMs, SiLU-and-mul, RoPE, the KV store) replayed from a CUDA graph with PDL gives exactly what the
same chain gives launched plainly, over many replays with fresh inputs (a kernel that ran ahead of its
producer would read stale rows)."""
import pytest
import torch

from replicas.attention.reference import rotary_cos_sin_cache
from replicas.attention.triton_fused import apply_rotary, rms_norm, silu_and_mul
from replicas.attention.triton_kv_store import store_kv
from replicas.layers.pdl import pdl_enabled
from replicas.layers.skinny_gemm import SkinnyConfig, skinny_gemm

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

DEV = torch.device("cuda")
M, H, I, LAYERS = 64, 1024, 2816, 4
HEADS, KV_HEADS, D, BLOCK = 8, 2, 128, 16


def make_weights(gen):
    def w(*shape):
        return (torch.randn(*shape, generator=gen, device=DEV) * 0.02).to(torch.bfloat16)
    return [dict(norm=1 + w(H), qkv=w((HEADS + 2 * KV_HEADS) * D, H), up=w(2 * I, H), down=w(H, I))
            for _ in range(LAYERS)]


def chain(x, layers, positions, cache, kv, slots):
    residual = torch.zeros_like(x)
    for i, lw in enumerate(layers):
        h, residual = rms_norm(x, lw["norm"], 1e-6, residual)
        qkv = skinny_gemm(h, lw["qkv"], cfg=SkinnyConfig(64, 64, 128, 2, 4, 3))
        q = qkv[:, :HEADS * D].view(M, HEADS, D)
        k = qkv[:, HEADS * D:(HEADS + KV_HEADS) * D].view(M, KV_HEADS, D)
        v = qkv[:, (HEADS + KV_HEADS) * D:].view(M, KV_HEADS, D)
        apply_rotary(q, k, positions, cache)
        store_kv(k, v, kv[i], slots)
        up = skinny_gemm(h, lw["up"], cfg=SkinnyConfig(64, 128, 64, 1, 8, 3))
        x = skinny_gemm(silu_and_mul(up), lw["down"], cfg=SkinnyConfig(64, 64, 128, 4, 4, 3)) + q.reshape(M, H)
    return x, residual


@torch.inference_mode()
def test_pdl_graph_replays_equal_plain_launches(monkeypatch):
    assert pdl_enabled(DEV) == (torch.cuda.get_device_capability() >= (9, 0))
    gen = torch.Generator(DEV).manual_seed(0)
    layers = make_weights(gen)
    inv_freq = 1.0 / 10000.0 ** (torch.arange(0, D, 2, device=DEV, dtype=torch.float32) / D)
    cache = rotary_cos_sin_cache(inv_freq, 4096)
    kv_shape = (LAYERS, 2 * M // BLOCK + 1, 2, BLOCK, KV_HEADS, D)
    static_x = torch.empty(M, H, device=DEV, dtype=torch.bfloat16)
    static_pos = torch.empty(M, device=DEV, dtype=torch.int64)
    slots = torch.randperm(2 * M, generator=gen, device=DEV)[:M]
    slots[::7] = -1                                          # padded lanes write nowhere
    kv_graph = torch.zeros(kv_shape, device=DEV, dtype=torch.bfloat16)

    monkeypatch.delenv("TIDAL_PDL", raising=False)
    static_x.normal_(generator=gen)
    static_pos.random_(0, 4096, generator=gen)
    chain(static_x, layers, static_pos, cache, kv_graph, slots)           # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out_graph = chain(static_x, layers, static_pos, cache, kv_graph, slots)

    monkeypatch.setenv("TIDAL_PDL", "0")
    kv_plain = torch.zeros(kv_shape, device=DEV, dtype=torch.bfloat16)
    for _ in range(50):
        static_x.normal_(generator=gen)
        static_pos.random_(0, 4096, generator=gen)
        graph.replay()
        want = chain(static_x.clone(), layers, static_pos.clone(), cache, kv_plain, slots)
        torch.cuda.synchronize()
        assert torch.equal(out_graph[0], want[0]) and torch.equal(out_graph[1], want[1])
        assert torch.equal(kv_graph, kv_plain)
