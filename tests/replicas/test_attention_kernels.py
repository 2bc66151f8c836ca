"""Triton attention / fused kernels against the torch reference, on CPU under TRITON_INTERPRET=1.

The interpreter's tl.dot multiplies bfloat16 operands as raw uint16 bits (triton 3.9), so these CPU cases use
float32 and float16; bfloat16 is covered by tests/gpu/test_attention_kernels_gpu.py.
"""
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")   # must precede the first @triton.jit of the kernel modules

import pytest  # noqa: E402

from replicas.attention import reference as ref  # noqa: E402
from replicas.attention.spec import AttentionBatch, AttentionSpec  # noqa: E402
from replicas.kernels.decode_attention import DecodeTuning, decode_num_splits, paged_decode_attention  # noqa: E402
from replicas.kernels.extend_attention import paged_extend_attention  # noqa: E402
from replicas.kernels.elementwise import apply_rotary, rms_norm, silu_and_mul  # noqa: E402
from replicas.kernels.kv_store import store_kv  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOL = {torch.float32: dict(atol=2e-5, rtol=1e-4), torch.float16: dict(atol=4e-3, rtol=1e-2)}


def make_cache(spec: AttentionSpec, seq_lens, dtype, gen, spare_blocks=3):
    """Random K/V cache plus page tables drawn from a shuffled block pool (pages of a sequence are scattered)."""
    max_blocks = max(1, max(-(-s // spec.block_size) for s in seq_lens))
    num_blocks = len(seq_lens) * max_blocks + spare_blocks
    kv = torch.randn(spec.kv_cache_shape(num_blocks), generator=gen).to(dtype).to(DEVICE)
    tables = torch.randperm(num_blocks, generator=gen)[: len(seq_lens) * max_blocks]
    return kv, tables.view(len(seq_lens), max_blocks).int().to(DEVICE)


def make_batch(spec, q_lens, seq_lens, dtype, gen, tree=False):
    kv, tables = make_cache(spec, seq_lens, dtype, gen)
    starts = torch.tensor([0] + q_lens).cumsum(0).int().to(DEVICE)
    q = torch.randn(sum(q_lens), spec.num_heads, spec.head_dim, generator=gen).to(dtype).to(DEVICE)
    max_q = max(q_lens)
    mask = None
    if tree:   # random tree: each node sees itself and a random subset of earlier nodes (its ancestors)
        mask = (torch.rand(len(q_lens), max_q, max_q, generator=gen) < 0.5).tril()
        mask |= torch.eye(max_q, dtype=torch.bool)
        mask = mask.to(DEVICE)
    batch = AttentionBatch(starts, torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE), tables,
                           max_q, max(seq_lens), mask)
    return q, kv, batch


def spec_for(heads, kv_heads, head_dim, block_size, **kw):
    return AttentionSpec(heads, kv_heads, head_dim, block_size, head_dim ** -0.5, **kw)


# ---- the reference itself ----------------------------------------------------------------------------------------

def test_reference_matches_sdpa_on_contiguous_causal_prefill():
    gen = torch.Generator().manual_seed(0)
    spec = spec_for(8, 2, 32, 16)
    q, kv, batch = make_batch(spec, [37], [37], torch.float32, gen)
    k, v = ref.gather_kv(kv, batch.block_tables[0], 37)
    expect = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(0, 1), k.repeat_interleave(4, 1).transpose(0, 1), v.repeat_interleave(4, 1).transpose(0, 1),
        is_causal=True).transpose(0, 1)
    torch.testing.assert_close(ref.attention_reference(q, kv, batch, spec), expect, atol=1e-5, rtol=1e-5)


def test_reference_rotary_matches_hf_rotate_half():
    gen = torch.Generator().manual_seed(1)
    q, k = torch.randn(5, 4, 16, generator=gen), torch.randn(5, 2, 16, generator=gen)
    pos = torch.tensor([0, 3, 7, 7, 100])
    inv_freq = 1.0 / (10000 ** (torch.arange(0, 16, 2).float() / 16))
    freqs = torch.outer(pos.float(), inv_freq)
    cos, sin = torch.cat([freqs, freqs], -1).cos()[:, None], torch.cat([freqs, freqs], -1).sin()[:, None]
    rotate_half = lambda x: torch.cat([-x[..., 8:], x[..., :8]], -1)  # noqa: E731
    expect_q, expect_k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
    ref.apply_rotary_reference(q, k, pos, ref.rotary_cos_sin_cache(inv_freq, 128))
    torch.testing.assert_close(q, expect_q)
    torch.testing.assert_close(k, expect_k)


# ---- store_kv ----------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("block_size", [16, 32, 64])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_store_kv_matches_reference_and_skips_padded_slots(block_size, dtype):
    gen = torch.Generator().manual_seed(block_size)
    spec = spec_for(8, 2, 48, block_size)
    kv = torch.randn(spec.kv_cache_shape(6), generator=gen).to(dtype).to(DEVICE)
    qkv = torch.randn(9, (8 + 2 + 2) * 48, generator=gen).to(dtype).to(DEVICE)   # k, v are strided views
    k = qkv[:, 8 * 48: 10 * 48].view(9, 2, 48)
    v = qkv[:, 10 * 48:].view(9, 2, 48)
    slots = torch.randperm(6 * block_size, generator=gen)[:9]
    slots[[2, 7]] = -1
    slots = slots.to(DEVICE)
    expect = kv.clone()
    ref.kv_store_reference(k, v, expect, slots)
    store_kv(k, v, kv, slots)
    assert torch.equal(kv, expect)


# ---- decode ------------------------------------------------------------------------------------------------------

DECODE_CASES = [  # heads, kv_heads, head_dim, block_size, seq_lens
    (4, 4, 32, 16, [1, 16, 17, 90]),
    (8, 2, 64, 32, [33, 5, 64, 150]),
    (8, 1, 64, 64, [130, 1, 64]),
    (6, 2, 48, 16, [47, 200]),
]


@pytest.mark.parametrize("heads,kv_heads,head_dim,block_size,seq_lens", DECODE_CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("splits", ["auto", "many"])
def test_decode_matches_reference(heads, kv_heads, head_dim, block_size, seq_lens, dtype, splits):
    gen = torch.Generator().manual_seed(len(seq_lens) * head_dim + block_size)
    spec = spec_for(heads, kv_heads, head_dim, block_size)
    q, kv, batch = make_batch(spec, [1] * len(seq_lens), seq_lens, dtype, gen)
    tuning = DecodeTuning() if splits == "auto" else DecodeTuning(block_n=16, programs_per_sm=1000,
                                                                  min_split_tokens=16)
    out = paged_decode_attention(q, kv, batch.block_tables, batch.seq_lens, spec, max(seq_lens), tuning=tuning)
    torch.testing.assert_close(out, ref.attention_reference(q, kv, batch, spec), **TOL[dtype])


def test_decode_sliding_window_and_too_small_max_seq_len():
    gen = torch.Generator().manual_seed(7)
    spec = spec_for(8, 2, 32, 16, sliding_window=21)
    q, kv, batch = make_batch(spec, [1, 1, 1], [10, 21, 97], torch.float32, gen)
    tuning = DecodeTuning(block_n=16, programs_per_sm=1000, min_split_tokens=16)
    # max_seq_len below the true max only costs speed: the last split runs to seq_len.
    out = paged_decode_attention(q, kv, batch.block_tables, batch.seq_lens, spec, 40, tuning=tuning)
    torch.testing.assert_close(out, ref.attention_reference(q, kv, batch, spec), **TOL[torch.float32])


def test_decode_padded_lane_with_empty_context_writes_zeros_into_out():
    gen = torch.Generator().manual_seed(8)
    spec = spec_for(4, 2, 32, 16)
    q, kv, batch = make_batch(spec, [1, 1], [20, 20], torch.float32, gen)
    seq_lens = torch.tensor([20, 0], dtype=torch.int32, device=DEVICE)
    out = torch.full_like(q, float("nan"))
    for tuning in (DecodeTuning(), DecodeTuning(block_n=16, programs_per_sm=1000, min_split_tokens=16)):
        paged_decode_attention(q, kv, batch.block_tables, seq_lens, spec, 64, out=out, tuning=tuning)
        assert torch.equal(out[1], torch.zeros_like(out[1]))
        torch.testing.assert_close(out[:1], ref.attention_reference(q, kv, batch, spec)[:1])


def test_decode_num_splits_fills_the_gpu_and_respects_bounds():
    assert decode_num_splits(64, 8, 4096, 132) * 64 * 8 >= 132
    assert decode_num_splits(1, 8, 4096, 132) > 8                 # small batch: split the context
    assert decode_num_splits(1, 8, 100, 132) == 1                 # short context: nothing to split
    assert decode_num_splits(512, 8, 32768, 132) == 1             # big batch already fills the GPU


# ---- extend (mixed batches) --------------------------------------------------------------------------------------

EXTEND_CASES = [  # heads, kv_heads, head_dim, block_size, q_lens, seq_lens: prefill chunk, fresh prefill, decodes
    (4, 4, 32, 16, [5, 1, 17], [40, 9, 17]),
    (8, 2, 64, 32, [3, 70, 1], [100, 70, 33]),
    (8, 1, 64, 64, [1, 2, 20], [1, 130, 64]),
    (6, 2, 48, 16, [33, 4], [50, 200]),
]


@pytest.mark.parametrize("heads,kv_heads,head_dim,block_size,q_lens,seq_lens", EXTEND_CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("mode", ["causal", "tree", "full", "window"])
def test_extend_matches_reference(heads, kv_heads, head_dim, block_size, q_lens, seq_lens, dtype, mode):
    gen = torch.Generator().manual_seed(sum(seq_lens) + head_dim)
    spec = spec_for(heads, kv_heads, head_dim, block_size, causal=mode != "full",
                    sliding_window=13 if mode == "window" else None)
    q, kv, batch = make_batch(spec, q_lens, seq_lens, dtype, gen, tree=mode == "tree")
    out = paged_extend_attention(q, kv, batch, spec)
    torch.testing.assert_close(out, ref.attention_reference(q, kv, batch, spec), **TOL[dtype])


def test_extend_tree_mask_only_touches_new_tokens_and_rows_without_keys_are_zero():
    gen = torch.Generator().manual_seed(11)
    spec = spec_for(4, 2, 32, 16)
    q, kv, batch = make_batch(spec, [6, 6], [6, 40], torch.float32, gen, tree=True)
    batch.tree_mask[:, 3] = False           # node 3 sees no new token: with no prefix it sees nothing at all
    out = paged_extend_attention(q, kv, batch, spec)
    expect = ref.attention_reference(q, kv, batch, spec)
    torch.testing.assert_close(out, expect, **TOL[torch.float32])
    assert torch.equal(out[3], torch.zeros_like(out[3]))
    assert expect[6 + 3].abs().sum() > 0     # the second request still sees its 34-token prefix


def test_extend_strided_q_out_buffer_and_empty_request():
    gen = torch.Generator().manual_seed(12)
    spec = spec_for(8, 2, 32, 32)
    q, kv, batch = make_batch(spec, [4, 0, 9], [30, 12, 9], torch.float32, gen)
    qkv = torch.zeros(q.shape[0], 12 * 32, device=DEVICE)
    qkv[:, : 8 * 32] = q.reshape(q.shape[0], -1)
    q_view = qkv[:, : 8 * 32].view(-1, 8, 32)
    out = torch.zeros_like(q)
    assert paged_extend_attention(q_view, kv, batch, spec, out=out) is out
    torch.testing.assert_close(out, ref.attention_reference(q, kv, batch, spec), **TOL[torch.float32])


def test_extend_in_a_mixed_graph_layout_equals_the_plain_batch():
    """As a mixed CUDA graph runs it: the token rows padded to the bucket, lanes beyond the batch with no new
    tokens, max_query_len the bucket. The real rows equal the plain batch's; the packed grid skips the rest."""
    gen = torch.Generator().manual_seed(14)
    spec = spec_for(9, 3, 64, 16)                    # SmolLM2's head group of 3 (42 tokens per tile)
    q, kv, batch = make_batch(spec, [1, 1, 50, 1, 7], [40, 9, 50, 130, 20], torch.float32, gen)
    bucket, lanes = 128, 8
    q_pad = torch.cat([q, torch.randn(bucket - q.shape[0], 9, 64, generator=gen).to(DEVICE)])
    starts = torch.cat([batch.query_start_loc, batch.query_start_loc[-1:].repeat(lanes - 5)])
    seq_lens = torch.cat([batch.seq_lens, torch.zeros(lanes - 5, dtype=torch.int32, device=DEVICE)])
    tables = torch.cat([batch.block_tables, torch.zeros(lanes - 5, batch.block_tables.shape[1], dtype=torch.int32,
                                                        device=DEVICE)])
    padded = AttentionBatch(starts, seq_lens, tables, bucket, 4096)
    out = paged_extend_attention(q_pad, kv, padded, spec, out=torch.zeros_like(q_pad))
    torch.testing.assert_close(out[: q.shape[0]], ref.attention_reference(q, kv, batch, spec), **TOL[torch.float32])
    assert torch.equal(out[q.shape[0]:], torch.zeros_like(out[q.shape[0]:]))     # padded rows are never written


def test_extend_on_a_decode_batch_equals_decode_kernel():
    gen = torch.Generator().manual_seed(13)
    spec = spec_for(8, 2, 64, 16)
    q, kv, batch = make_batch(spec, [1, 1, 1], [3, 77, 33], torch.float32, gen)
    decode = paged_decode_attention(q, kv, batch.block_tables, batch.seq_lens, spec, 77)
    torch.testing.assert_close(paged_extend_attention(q, kv, batch, spec), decode, **TOL[torch.float32])


# ---- fused elementwise -------------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_rms_norm_with_and_without_residual(dtype):
    gen = torch.Generator().manual_seed(20)
    x, res = (torch.randn(7, 96, generator=gen).to(dtype).to(DEVICE) for _ in range(2))
    w = (1 + 0.1 * torch.randn(96, generator=gen)).to(dtype).to(DEVICE)
    out, new_res = rms_norm(x, w, 1e-6, res)
    expect_out, expect_res = ref.rms_norm_reference(x, w, 1e-6, res)
    torch.testing.assert_close(new_res, expect_res, atol=0, rtol=0)
    torch.testing.assert_close(out, expect_out, **TOL[dtype])
    out, same = rms_norm(x, w, 1e-6)
    assert same is x
    torch.testing.assert_close(out, ref.rms_norm_reference(x, w, 1e-6)[0], **TOL[dtype])


def test_rms_norm_per_head_on_strided_qkv_view():
    gen = torch.Generator().manual_seed(21)
    qkv = torch.randn(5, (4 + 2 + 2) * 16, generator=gen, device=DEVICE)
    q = qkv[:, : 4 * 16].view(5, 4, 16)
    w = torch.rand(16, generator=gen).to(DEVICE)
    out, _ = rms_norm(q, w, 1e-5)
    torch.testing.assert_close(out, ref.rms_norm_reference(q.contiguous(), w, 1e-5)[0], **TOL[torch.float32])


@pytest.mark.parametrize("rot_dim", [32, 16])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_apply_rotary_in_place_on_strided_views(rot_dim, dtype):
    gen = torch.Generator().manual_seed(rot_dim)
    qkv = torch.randn(6, (4 + 1 + 1) * 32, generator=gen).to(dtype).to(DEVICE)
    q, k = qkv[:, : 4 * 32].view(6, 4, 32), qkv[:, 4 * 32: 5 * 32].view(6, 1, 32)
    positions = torch.tensor([0, 1, 5, 5, 63, 17], device=DEVICE)
    inv_freq = 1.0 / (10000 ** (torch.arange(0, rot_dim, 2, device=DEVICE).float() / rot_dim))
    cache = ref.rotary_cos_sin_cache(inv_freq, 64)
    expect_q, expect_k, untouched_v = q.clone(), k.clone(), qkv[:, 5 * 32:].clone()
    ref.apply_rotary_reference(expect_q, expect_k, positions, cache)
    apply_rotary(q, k, positions, cache)
    torch.testing.assert_close(q, expect_q, **TOL[dtype])
    torch.testing.assert_close(k, expect_k, **TOL[dtype])
    assert torch.equal(qkv[:, 5 * 32:], untouched_v)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_silu_and_mul(dtype):
    gen = torch.Generator().manual_seed(30)
    x = (3 * torch.randn(4, 2 * 1500, generator=gen)).to(dtype).to(DEVICE)   # 1500 > one 1024-wide block
    torch.testing.assert_close(silu_and_mul(x), ref.silu_and_mul_reference(x), **TOL[dtype])
