"""The CPU attention kernels (replicas/kernels/attention_cpu.py) against the torch reference, and the torch backend
with them against the backend's own torch path."""
import pytest
import torch

from replicas.attention import reference as ref
from replicas.attention.context import ForwardContext
from replicas.attention.spec import AttentionBatch, AttentionSpec
from replicas.attention.torch_backend import TorchAttentionBackend
from replicas.kernels import attention_cpu

pytestmark = pytest.mark.skipif(not attention_cpu.available(), reason="the CPU kernels cannot be built here")


def _cache(spec: AttentionSpec, seq_lens, gen):
    max_blocks = max(-(-s // spec.block_size) for s in seq_lens)
    num_blocks = len(seq_lens) * max_blocks + 2
    shape = spec.kv_cache_shape(num_blocks)                  # a view with room between blocks, as a layer's is
    kv = torch.randn(shape[0], shape[1] + 1, *shape[2:], generator=gen)[:, 1:]
    tables = torch.randperm(num_blocks, generator=gen)[: len(seq_lens) * max_blocks]
    return kv, tables.view(len(seq_lens), max_blocks).int()


@pytest.mark.parametrize("heads,kv_heads,head_dim,block_size", [(9, 3, 64, 16), (4, 4, 32, 8), (8, 1, 16, 4)])
def test_decode_attention_matches_the_reference(heads, kv_heads, head_dim, block_size):
    gen = torch.Generator().manual_seed(0)
    spec = AttentionSpec(heads, kv_heads, head_dim, block_size, head_dim ** -0.5)
    seq_lens = [1, 17, 40, 5]
    kv, tables = _cache(spec, seq_lens, gen)
    q = torch.randn(len(seq_lens) + 2, heads, head_dim, generator=gen)      # rows 0 and 3 are not decoded here
    rows = [1, 2, 4, 5]
    out = torch.full_like(q, float("nan"))
    attention_cpu.decode_attention(q, kv, tables, torch.tensor(rows), torch.tensor(seq_lens, dtype=torch.int32),
                                   max(seq_lens), spec.scale, out)
    for b, (r, n) in enumerate(zip(rows, seq_lens)):
        k, v = ref.gather_kv(kv, tables[b], n)
        want = torch.nn.functional.scaled_dot_product_attention(
            q[r].unsqueeze(1), k.transpose(0, 1), v.transpose(0, 1), scale=spec.scale,
            enable_gqa=heads != kv_heads).squeeze(1)
        torch.testing.assert_close(out[r], want, atol=2e-5, rtol=1e-4)
    assert out[0].isnan().all() and out[3].isnan().all()                     # other rows untouched


def test_kv_store_writes_each_slot_and_skips_minus_one():
    gen = torch.Generator().manual_seed(1)
    kv = torch.zeros(5, 3, 4, 3, 8)[:, :2]
    fused = torch.randn(6, 2 * 3 * 8 + 5, generator=gen)                      # k and v as strided views of one row
    k, v = fused[:, :24].view(6, 3, 8), fused[:, 24:48].view(6, 3, 8)
    slots = torch.tensor([7, -1, 0, 19, 12, -1])
    attention_cpu.kv_store(k, v, kv, slots)
    want = torch.zeros_like(kv)
    for t, s in enumerate(slots.tolist()):
        if s >= 0:
            want[s // 4, 0, s % 4], want[s // 4, 1, s % 4] = k[t], v[t]
    torch.testing.assert_close(kv, want, atol=0, rtol=0)


def test_the_torch_backend_gives_the_same_output_with_and_without_the_kernels(monkeypatch):
    """A mixed step (two decodes and a prefill chunk over a cached prefix), through the backend twice."""
    gen = torch.Generator().manual_seed(2)
    spec = AttentionSpec(9, 3, 64, 16, 0.125)
    q_lens, seq_lens = [1, 6, 1], [33, 20, 9]
    kv, tables = _cache(spec, seq_lens, gen)
    T = sum(q_lens)
    q = torch.randn(T, 9, 64, generator=gen)
    k, v = torch.randn(T, 3, 64, generator=gen), torch.randn(T, 3, 64, generator=gen)
    slots = []
    for i, (n, L) in enumerate(zip(q_lens, seq_lens)):
        slots += [int(tables[i, p // 16]) * 16 + p % 16 for p in range(L - n, L)]
    starts = torch.tensor([0] + q_lens).cumsum(0).int()
    batch = AttentionBatch(starts, torch.tensor(seq_lens, dtype=torch.int32), tables, max(q_lens), max(seq_lens), None)

    def run():
        cache = kv.clone()
        ctx = ForwardContext(batch, torch.tensor(slots), q_lens, seq_lens)
        backend = TorchAttentionBackend(16)
        backend.plan(ctx)
        return backend.forward(q, k, v, cache, ctx, spec.scale), cache

    got, got_cache = run()
    monkeypatch.setattr(attention_cpu, "available", lambda: False)
    want, want_cache = run()
    torch.testing.assert_close(got_cache, want_cache, atol=0, rtol=0)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4)
