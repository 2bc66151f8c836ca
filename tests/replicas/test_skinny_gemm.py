"""Skinny GEMM against torch under TRITON_INTERPRET=1, the GEMM selector's decisions with a fake timer, the
linear layers' dispatch, and the decode attention split policy.

The interpreter's tl.dot multiplies bfloat16 operands as raw bits (triton 3.9), so these CPU cases use float32
and float16; bfloat16 is covered by tests/gpu/test_skinny_gemm_gpu.py.
"""
import dataclasses
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")   # must precede the first @triton.jit of the kernel modules

import pytest  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from replicas.kernels.decode_attention import DecodeTuning, decode_num_splits  # noqa: E402
from replicas.distributed.communicator import SingleCommunicator  # noqa: E402
from replicas.distributed.parallel_state import set_tp_group  # noqa: E402
from replicas.layers import gemm_select  # noqa: E402
from replicas.layers.gemm_select import (MAX_SKINNY_M, apply_table, candidate_configs, fill_split,  # noqa: E402
                                         select_gemms, tune_linear_layers)
from replicas.kernels.skinny_gemm import SkinnyConfig, skinny_gemm  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOL = {torch.float32: dict(atol=1e-4, rtol=1e-4), torch.float16: dict(atol=2e-2, rtol=1e-2)}

GEMM_CASES = [  # m, n, k, config: ragged M, N and K off the blocks, split_k 1 and > 1, empty splits
    (1, 16, 32, SkinnyConfig(16, 16, 32, 1, 4, 2)),
    (5, 70, 300, SkinnyConfig(16, 32, 64, 1, 4, 2)),
    (33, 50, 257, SkinnyConfig(16, 16, 32, 3, 4, 2)),       # two M tiles, 3 ragged splits
    (17, 48, 96, SkinnyConfig(32, 16, 32, 2, 4, 3)),
    (7, 9, 40, SkinnyConfig(16, 16, 16, 8, 4, 2)),          # more splits than K chunks: empty splits write zeros
    (64, 64, 128, SkinnyConfig(64, 32, 32, 4, 4, 4)),
    (1, 40, 300, SkinnyConfig(1, 16, 64, 1, 4, 3, gemv=True)),           # CUDA-core products, ragged K
    (3, 50, 257, SkinnyConfig(4, 8, 64, 3, 4, 3, gemv=True)),            # a 4-row tile holding 3 rows, split K
    (5, 24, 96, SkinnyConfig(2, 8, 32, 1, 4, 3, gemv=True)),             # 3 M tiles of 2 rows, the last ragged
    (1, 40, 300, SkinnyConfig(1, 16, 64, 1, 4, 3, gemv=True, reduce_late=True)),     # summed after the K loop
    (3, 50, 257, SkinnyConfig(4, 8, 64, 3, 4, 3, gemv=True, reduce_late=True)),
]


@pytest.mark.parametrize("m,n,k,cfg", GEMM_CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("bias", [False, True])
def test_skinny_gemm_matches_torch(m, n, k, cfg, dtype, bias):
    gen = torch.Generator().manual_seed(m * 1000 + n + k)
    x = torch.randn(m, k, generator=gen).to(dtype).to(DEVICE)
    w = (torch.randn(n, k, generator=gen) / k ** 0.5).to(dtype).to(DEVICE)
    b = torch.randn(n, generator=gen).to(dtype).to(DEVICE) if bias else None
    y = skinny_gemm(x, w, b, cfg)
    assert y.shape == (m, n) and y.dtype == dtype
    expect = F.linear(x.double(), w.double(), None if b is None else b.double())
    torch.testing.assert_close(y.double(), expect, **TOL[dtype])


def test_skinny_gemm_split_k_is_deterministic_and_keeps_leading_dims():
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(2, 3, 200, generator=gen).to(DEVICE)
    w = torch.randn(40, 200, generator=gen).to(DEVICE)
    cfg = SkinnyConfig(16, 16, 32, 4, 4, 2)
    y1, y2 = skinny_gemm(x, w, None, cfg), skinny_gemm(x, w, None, cfg)
    assert y1.shape == (2, 3, 40) and torch.equal(y1, y2)
    torch.testing.assert_close(y1, x @ w.T, **TOL[torch.float32])


def test_skinny_gemm_strided_input_rows():
    gen = torch.Generator().manual_seed(4)
    wide = torch.randn(9, 130, generator=gen).to(DEVICE)
    x = wide[:, 2:66]                                       # row stride 130, contiguous along K
    w = torch.randn(24, 64, generator=gen).to(DEVICE)
    torch.testing.assert_close(skinny_gemm(x, w, None, SkinnyConfig(16, 16, 32, 2, 4, 2)), x @ w.T,
                               **TOL[torch.float32])


@pytest.mark.parametrize("split", [1, 3])
@pytest.mark.parametrize("fp8_dot,gemv,reduce_late", [(False, False, False), (True, False, False),
                                                      (False, True, False), (False, True, True)])
def test_skinny_gemm_reads_an_fp8_weight_with_its_row_scales(split, fp8_dot, gemv, reduce_late):
    from replicas.layers.fp8_linear import quantize_rows
    gen = torch.Generator().manual_seed(split)
    x = torch.randn(5, 200, generator=gen).to(DEVICE)
    q, scale = quantize_rows(torch.randn(40, 200, generator=gen))
    bias = torch.randn(40, generator=gen).to(DEVICE)
    cfg = SkinnyConfig(4 if gemv else 16, 16, 32, split, 4, 2, fp8_dot, gemv, reduce_late)
    y = skinny_gemm(x, q.to(DEVICE), bias, cfg, scale.to(DEVICE))
    want = x @ (q.float() * scale[:, None]).T.to(DEVICE) + bias
    if fp8_dot:        # x tiles in E4M3 too: a 3-bit mantissa's error, spread over the sum
        assert (y - want).norm() / want.norm() < 0.08
    else:
        torch.testing.assert_close(y, want, **TOL[torch.float32])


@pytest.mark.parametrize("split", [1, 3])
def test_fp8_token_scales_equal_the_library_products_numerics(split):
    """`token_scales`: x quantized per token in front (Fp8Weight.skinny), FP8 tile products, both sides' scales
    after the K loop: y = xs[m] * scale[n] * sum_k xq[m, k] * q[n, k], what `torch._scaled_mm` computes, in x's
    dtype; a leading batch shape and the bias kept."""
    from replicas.layers.fp8_linear import Fp8Weight, quantize_rows
    gen = torch.Generator().manual_seed(10 + split)
    x = torch.randn(2, 3, 200, generator=gen).to(DEVICE)
    weight = Fp8Weight(*quantize_rows(torch.randn(40, 200, generator=gen))).to(DEVICE)
    bias = torch.randn(40, generator=gen).to(DEVICE)
    y = weight.skinny(x, bias, SkinnyConfig(16, 16, 32, split, 4, 2, fp8_dot=True, token_scales=True))
    xq, xs = quantize_rows(x.reshape(6, 200))
    want = (xs[:, None] * (xq.float() @ weight.q.float().T) * weight.scale[None, :] + bias).reshape(2, 3, 40)
    assert y.shape == (2, 3, 40) and y.dtype == x.dtype
    torch.testing.assert_close(y, want, **TOL[torch.float32])
    with pytest.raises(ValueError):
        SkinnyConfig(token_scales=True)


# ---- selection -------------------------------------------------------------------------------------------------

def test_candidates_fit_the_tile_limits_and_fill_split_fills_the_gpu():
    for m in (1, 16, 48, 64, 128, 256):
        cands = candidate_configs(m, 4096, 4096, 132)
        assert cands and len(set(cands)) == len(cands)
        for c in cands:
            assert c.block_m >= min(m, 16) and c.block_m * c.block_n <= gemm_select.MAX_ACC_ELEMS
            assert (c.block_m + c.block_n) * c.block_k * 2 * c.num_stages <= gemm_select.SMEM_BUDGET
        assert any(c.split_k == 1 for c in cands) and any(c.split_k > 1 for c in cands)
    fp8 = candidate_configs(16, 4096, 4096, 132, weight_bytes=1)       # FP8: K tiles of as many bytes, three ways
    for c in fp8:
        x_bytes = 1 if c.token_scales else 2
        assert c.block_k == 256
        assert (x_bytes * c.block_m + c.block_n) * c.block_k * c.num_stages <= gemm_select.SMEM_BUDGET
    weight_only = {(c.block_m, c.block_n, c.split_k) for c in fp8 if not c.fp8_dot}
    assert {(c.block_m, c.block_n, c.split_k) for c in fp8 if c.fp8_dot and not c.token_scales} == weight_only
    assert {(c.block_m, c.block_n, c.split_k) for c in fp8 if c.token_scales} == weight_only
    assert any(c.token_scales and c.num_stages > d.num_stages for c in fp8 for d in fp8
               if d.fp8_dot and not d.token_scales and d.block_n == c.block_n)     # one-byte x: more stages
    assert not any(c.fp8_dot for c in candidate_configs(16, 4096, 4096, 132))
    for m in (1, 3, 4):                                     # a few rows: CUDA-core products too, one M tile
        gemv = [c for c in candidate_configs(m, 4096, 4096, 132) if c.gemv]
        assert gemv and all(c.block_m == (1 if m == 1 else 4) for c in gemv)
        assert all(c.block_m * c.block_n * c.block_k <= gemm_select.GEMV_TILE_ELEMS for c in gemv)
        assert {c for c in gemv if c.reduce_late} == {dataclasses.replace(c, reduce_late=True) for c in gemv
                                                      if not c.reduce_late}      # each tile shape both ways
        gemv_fp8 = [c for c in candidate_configs(m, 4096, 4096, 132, weight_bytes=1) if c.gemv]
        assert {c.block_k for c in gemv_fp8} == {c.block_k for c in gemv} | {2 * c.block_k for c in gemv}
    assert not any(c.gemv for c in candidate_configs(5, 4096, 4096, 132))
    with pytest.raises(ValueError):
        SkinnyConfig(gemv=True, fp8_dot=True)
    with pytest.raises(ValueError):
        SkinnyConfig(reduce_late=True)
    assert fill_split(64, 4096, 128, 132) == 8         # 64 tiles -> 512 programs >= 2 per SM
    assert fill_split(448, 4096, 128, 132) == 1        # gate_up already fills the GPU
    assert fill_split(8, 512, 128, 132) == 2           # short K: at least 2 K tiles per split


class FakeTimer:
    """Times from a formula; records every call. Config `bad` raises like a failing compile."""

    def __init__(self, bad: SkinnyConfig | None = None):
        self.calls = []
        self.bad = bad

    def __call__(self, m, n, k, cfg):
        self.calls.append((m, n, k, cfg))
        if cfg is not None and cfg == self.bad:
            raise RuntimeError("out of resources")
        if cfg is None:
            return 10.0 + (0.0 if n == 999 else m / 64)     # shape (999, _) keeps cuBLAS fastest
        return 10.0 - cfg.split_k * 0.1 - cfg.block_n * 0.001 if n != 999 else 50.0


def test_select_gemms_keeps_the_fastest_and_skips_failures_and_large_m():
    cands = lambda m, n, k, sms: [SkinnyConfig(64, 32, 64, 1), SkinnyConfig(64, 32, 64, 4),  # noqa: E731
                                  SkinnyConfig(64, 128, 64, 8)]
    timer = FakeTimer(bad=SkinnyConfig(64, 128, 64, 8))
    table, choices = select_gemms([(96, 64), (999, 64), (96, 64)], [1, 64, 300, 128], timer, 132, cands)
    assert set(table) == {(96, 64), (999, 64)}
    assert table[(96, 64)] == {1: SkinnyConfig(64, 32, 64, 4), 64: SkinnyConfig(64, 32, 64, 4),
                               128: SkinnyConfig(64, 32, 64, 4)}
    assert table[(999, 64)] == {}                              # cuBLAS won everywhere
    assert all(m <= MAX_SKINNY_M for m, _, _, _ in timer.calls)   # M=300 is never timed
    assert len(choices) == 2 * 3 and sum(c.use_skinny for c in choices) == 3


def test_select_requires_the_minimum_gain():
    timer = lambda m, n, k, cfg: 10.0 if cfg is None else 9.95   # noqa: E731  0.5% faster only
    table, _ = select_gemms([(32, 32)], [16], timer, 132, lambda *a: [SkinnyConfig(16, 16, 32)])
    assert table[(32, 32)] == {}


def tiny_llama_layer():
    from replicas.config import ModelConfig
    from replicas.models.llama import LlamaAttention, LlamaMLP

    set_tp_group(SingleCommunicator())
    cfg = ModelConfig(architecture="llama", vocab_size=64, hidden_size=64, intermediate_size=96,
                      num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                      max_position_embeddings=128)
    return torch.nn.ModuleDict(dict(mlp=LlamaMLP(cfg), self_attn=LlamaAttention(cfg)))


def test_linear_layers_dispatch_on_the_bucket(monkeypatch):
    from replicas.layers import linear

    torch.manual_seed(0)
    layer = tiny_llama_layer()["mlp"]
    for p in layer.parameters():
        p.data.normal_(0, 0.1)
    table = {gemm_select.weight_key(m): {4: SkinnyConfig(16, 16, 32, 2, 4, 2)}
             for m in (layer.gate_up_proj, layer.down_proj)}
    apply_table(layer, table)
    used = []
    real = linear.skinny_gemm
    monkeypatch.setattr(linear, "skinny_gemm", lambda *a: used.append(a[3]) or real(*a))
    x4, x5 = torch.randn(4, 64), torch.randn(5, 64)
    y4 = layer(x4)
    assert len(used) == 2                                      # gate_up and down of the bucket
    layer(x5)
    assert len(used) == 2                                      # M=5 is no bucket: F.linear
    apply_table(layer, {})
    torch.testing.assert_close(y4, layer(x4), **TOL[torch.float32])
    assert len(used) == 2


def test_fp8_layers_take_the_skinny_gemm_on_their_buckets_and_their_own_matmul_otherwise(monkeypatch):
    from replicas.layers import fp8_linear
    from replicas.layers.fp8_linear import FP8

    torch.manual_seed(0)
    layer = tiny_llama_layer()["mlp"]
    for p in layer.parameters():
        p.data.normal_(0, 0.1)
    assert layer.gate_up_proj.to_fp8() and layer.down_proj.to_fp8()
    assert {gemm_select.weight_key(m)[2] for m in gemm_select.skinny_layers(layer)} == {FP8}
    table = {gemm_select.weight_key(m): {4: SkinnyConfig(16, 16, 32, 1, 4, 2)}
             for m in gemm_select.skinny_layers(layer)}
    apply_table(layer, table)
    scales = []
    real = fp8_linear.skinny_gemm
    monkeypatch.setattr(fp8_linear, "skinny_gemm", lambda *a: scales.append(a[4]) or real(*a))
    x4 = torch.randn(4, 64)
    y4 = layer(x4)
    assert len(scales) == 2 and all(s is not None and s.dtype == torch.float32 for s in scales)
    layer(torch.randn(5, 64))
    assert len(scales) == 2                                    # M=5: the layer's own quantized matmul
    up, down = (m.weight.dequantize() for m in (layer.gate_up_proj, layer.down_proj))
    gate, lin = (x4 @ up.T).chunk(2, dim=-1)
    torch.testing.assert_close(y4, (F.silu(gate) * lin) @ down.T, **TOL[torch.float32])   # weight-only: exact


def test_tune_linear_layers_is_off_on_cpu_and_by_env(monkeypatch):
    layer = tiny_llama_layer()
    calls = []
    fake = lambda *a: calls.append(a) or 1.0               # noqa: E731
    assert tune_linear_layers(layer, [16], torch.device("cpu"), fake) is None
    monkeypatch.setenv("TIDAL_SKINNY_GEMM", "0")
    assert tune_linear_layers(layer, [16], torch.device("cuda", 0), fake) is None
    assert not calls and all(not m.skinny for m in gemm_select.skinny_layers(layer))


# ---- decode attention split policy -------------------------------------------------------------------------------

def test_decode_split_policy():
    sms = 132
    assert decode_num_splits(64, 8, 1024, sms) == 1                       # 512 programs fill the GPU: no split
    assert decode_num_splits(64, 8, 1024, sms, DecodeTuning(split_policy="fill")) == 2
    assert decode_num_splits(16, 8, 4096, sms) > 1                        # 128 programs: split
    assert decode_num_splits(1, 8, 4096, sms, DecodeTuning(split_policy="never")) == 1
    assert decode_num_splits(33, 8, 4096, sms, DecodeTuning(full_programs_per_sm=2.0)) == 1   # 264 = 2 x 132
    assert decode_num_splits(32, 8, 4096, sms, DecodeTuning(full_programs_per_sm=2.0)) == 3
    with pytest.raises(ValueError):
        DecodeTuning(split_policy="sometimes")


def test_tune_linear_layers_survives_a_failing_timer(monkeypatch):
    layer = tiny_llama_layer()
    monkeypatch.setattr(gemm_select, "MIN_WEIGHT_BYTES", 0)
    monkeypatch.setattr(gemm_select.torch.cuda, "get_device_properties",
                        lambda d: type("P", (), {"multi_processor_count": 132})())

    def broken(m, n, k, cfg):
        raise RuntimeError("CUDA error")
    assert tune_linear_layers(layer, [16], torch.device("cuda", 0), broken) is None
    table = tune_linear_layers(layer, [16, 32], torch.device("cuda", 0),
                               lambda m, n, k, cfg: 2.0 if cfg is None else 0.5 + cfg.split_k)
    assert set(table) == {gemm_select.weight_key(m) for m in gemm_select.skinny_layers(layer)}
    for mod in gemm_select.skinny_layers(layer):
        assert set(mod.skinny) == {16, 32} and all(c.split_k == 1 for c in mod.skinny.values())
