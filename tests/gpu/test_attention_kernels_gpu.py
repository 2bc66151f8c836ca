"""Randomized GPU checks of the Triton attention and fused kernels against the torch reference (bf16 / fp16).

1,160 cases: 450 decode, 450 extend (causal / tree / bidirectional / sliding window), 100 store_kv, 160 fused.
Shapes come from a fixed list so the number of kernel compilations stays small; lengths, batch, page-table
shuffles, masks and values are drawn per case from the case's seed.
"""
import random

import pytest
import torch

from replicas.attention import reference as ref
from replicas.attention.spec import AttentionBatch, AttentionSpec
from replicas.kernels.decode_attention import paged_decode_attention
from replicas.kernels.extend_attention import paged_extend_attention
from replicas.kernels.elementwise import apply_rotary, rms_norm, silu_and_mul
from replicas.kernels.kv_store import store_kv

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

SHAPES = [  # heads, kv_heads, head_dim, block_size: GQA group 1, 3, 4, 8 and head_dim 64/80/128/256
    (32, 8, 128, 16), (32, 8, 128, 32), (32, 32, 128, 16), (16, 2, 128, 64),
    (9, 3, 64, 16), (28, 4, 128, 32), (8, 1, 256, 16), (16, 16, 80, 64),
]
TOL = {torch.bfloat16: dict(atol=2e-2, rtol=2e-2), torch.float16: dict(atol=4e-3, rtol=1e-2)}
N_DECODE, N_EXTEND, N_STORE, N_FUSED = 450, 450, 100, 40


def draw(seed: int):
    rng = random.Random(seed)
    heads, kv_heads, head_dim, block_size = rng.choice(SHAPES)
    dtype = torch.float16 if rng.random() < 0.15 else torch.bfloat16
    window = rng.choice([None] * 5 + [1, 7, 100, 1000])
    return rng, heads, kv_heads, head_dim, block_size, dtype, window


def build(rng, spec, q_lens, seq_lens, dtype, tree_mask=None):
    gen = torch.Generator(device="cuda").manual_seed(rng.randrange(1 << 30))
    max_blocks = max(1, max(-(-s // spec.block_size) for s in seq_lens)) + rng.randrange(3)
    num_blocks = len(seq_lens) * max_blocks + rng.randrange(1, 8)
    kv = torch.randn(spec.kv_cache_shape(num_blocks), generator=gen, device="cuda").to(dtype)
    tables = torch.randperm(num_blocks, generator=gen, device="cuda")[: len(seq_lens) * max_blocks]
    tables = tables.view(len(seq_lens), max_blocks).int()
    q = torch.randn(sum(q_lens), spec.num_heads, spec.head_dim, generator=gen, device="cuda").to(dtype)
    starts = torch.tensor([0] + q_lens, device="cuda").cumsum(0).int()
    batch = AttentionBatch(starts, torch.tensor(seq_lens, dtype=torch.int32, device="cuda"), tables,
                           max(q_lens), max(seq_lens), tree_mask)
    return q, kv, batch


def random_tree(rng, num_nodes: int) -> torch.Tensor:
    """Ancestor mask of a random tree over nodes 0..n-1 in topological order (node i's parent is < i)."""
    mask = torch.eye(num_nodes, dtype=torch.bool)
    for i in range(1, num_nodes):
        mask[i] |= mask[rng.randrange(i)]
    return mask


@pytest.mark.parametrize("seed", range(N_DECODE))
def test_decode_random(seed):
    rng, heads, kv_heads, head_dim, block_size, dtype, window = draw(seed)
    spec = AttentionSpec(heads, kv_heads, head_dim, block_size, head_dim ** -0.5, sliding_window=window)
    batch_size = rng.choice([1, 2, 3, 8, 17, 64])
    long = rng.random() < 0.3
    seq_lens = [rng.randint(1, 8192 if long else 600) for _ in range(batch_size)]
    q, kv, batch = build(rng, spec, [1] * batch_size, seq_lens, dtype)
    bound = max(seq_lens) + rng.choice([0, 0, 1, 511, 4096])        # CUDA graphs pass a bucket >= the true max
    out = paged_decode_attention(q, kv, batch.block_tables, batch.seq_lens, spec, bound)
    torch.testing.assert_close(out, ref.attention_reference(q, kv, batch, spec), **TOL[dtype])


@pytest.mark.parametrize("seed", range(N_EXTEND))
def test_extend_random(seed):
    rng, heads, kv_heads, head_dim, block_size, dtype, window = draw(10_000 + seed)
    mode = rng.choice(["causal", "causal", "tree", "tree", "full"])
    spec = AttentionSpec(heads, kv_heads, head_dim, block_size, head_dim ** -0.5, causal=mode != "full",
                         sliding_window=window)
    batch_size = rng.choice([1, 2, 4, 7, 16])
    q_lens, seq_lens = [], []
    for _ in range(batch_size):
        kind = rng.choice(["prefill", "chunk", "decode", "verify"])
        n = {"prefill": rng.randint(1, 700), "chunk": rng.randint(1, 300), "decode": 1,
             "verify": rng.randint(2, 64)}[kind]
        prefix = 0 if kind == "prefill" else rng.randint(0 if kind == "chunk" else 1, 3000)
        q_lens.append(n)
        seq_lens.append(prefix + n)
    tree = None
    if mode == "tree":
        width = max(q_lens)
        tree = torch.zeros(batch_size, width, width, dtype=torch.bool)
        for b, n in enumerate(q_lens):
            tree[b, :n, :n] = random_tree(rng, n)
        tree = tree.cuda()
    q, kv, batch = build(rng, spec, q_lens, seq_lens, dtype, tree)
    out = paged_extend_attention(q, kv, batch, spec)
    torch.testing.assert_close(out, ref.attention_reference(q, kv, batch, spec), **TOL[dtype])


@pytest.mark.parametrize("seed", range(N_STORE))
def test_store_kv_random(seed):
    rng, heads, kv_heads, head_dim, block_size, dtype, _ = draw(20_000 + seed)
    gen = torch.Generator(device="cuda").manual_seed(seed)
    num_blocks, num_tokens = rng.randint(1, 40), rng.randint(1, 300)
    kv = torch.randn(num_blocks, 2, block_size, kv_heads, head_dim, generator=gen, device="cuda").to(dtype)
    qkv = torch.randn(num_tokens, (heads + 2 * kv_heads) * head_dim, generator=gen, device="cuda").to(dtype)
    k = qkv[:, heads * head_dim: (heads + kv_heads) * head_dim].view(num_tokens, kv_heads, head_dim)
    v = qkv[:, (heads + kv_heads) * head_dim:].view(num_tokens, kv_heads, head_dim)
    slots = torch.randperm(max(num_blocks * block_size, num_tokens), generator=gen, device="cuda")[:num_tokens]
    slots = torch.where(slots < num_blocks * block_size, slots, -1)
    slots[torch.rand(num_tokens, generator=gen, device="cuda") < 0.2] = -1
    expect = kv.clone()
    ref.kv_store_reference(k, v, expect, slots)
    store_kv(k, v, kv, slots)
    assert torch.equal(kv, expect)


@pytest.mark.parametrize("seed", range(N_FUSED))
@pytest.mark.parametrize("residual", [False, True])
def test_rms_norm_random(seed, residual):
    rng = random.Random(30_000 + seed)
    dtype = rng.choice([torch.bfloat16, torch.float16])
    rows, width = rng.randint(1, 300), rng.choice([64, 128, 576, 896, 2048, 4096, 5120, 8192])
    x = torch.randn(rows, width, device="cuda").to(dtype)
    res = torch.randn(rows, width, device="cuda").to(dtype) if residual else None
    w = (1 + 0.1 * torch.randn(width, device="cuda")).to(dtype)
    out, new_res = rms_norm(x, w, 1e-5, res)
    expect_out, expect_res = ref.rms_norm_reference(x, w, 1e-5, res)
    assert torch.equal(new_res, expect_res)
    torch.testing.assert_close(out, expect_out, **TOL[dtype])


@pytest.mark.parametrize("seed", range(N_FUSED))
def test_apply_rotary_random(seed):
    rng, heads, kv_heads, head_dim, _, dtype, _ = draw(40_000 + seed)
    num_tokens = rng.randint(1, 300)
    rot = head_dim if rng.random() < 0.8 else head_dim // 2
    qkv = torch.randn(num_tokens, (heads + 2 * kv_heads) * head_dim, device="cuda").to(dtype)
    q = qkv[:, : heads * head_dim].view(num_tokens, heads, head_dim)
    k = qkv[:, heads * head_dim: (heads + kv_heads) * head_dim].view(num_tokens, kv_heads, head_dim)
    positions = torch.randint(0, 8192, (num_tokens,), device="cuda")
    inv_freq = 1.0 / (rng.choice([1e4, 5e5, 1e6]) ** (torch.arange(0, rot, 2, device="cuda").float() / rot))
    cache = ref.rotary_cos_sin_cache(inv_freq, 8192)
    expect_q, expect_k = q.clone(), k.clone()
    ref.apply_rotary_reference(expect_q, expect_k, positions, cache)
    apply_rotary(q, k, positions, cache)
    torch.testing.assert_close(q, expect_q, **TOL[dtype])
    torch.testing.assert_close(k, expect_k, **TOL[dtype])


@pytest.mark.parametrize("seed", range(N_FUSED))
def test_silu_and_mul_random(seed):
    rng = random.Random(50_000 + seed)
    dtype = rng.choice([torch.bfloat16, torch.float16])
    x = (2 * torch.randn(rng.randint(1, 300), 2 * rng.choice([1536, 2816, 11008, 14336]), device="cuda")).to(dtype)
    torch.testing.assert_close(silu_and_mul(x), ref.silu_and_mul_reference(x), **TOL[dtype])
