"""Paged attention through the Triton kernels (GPU): KV store, split-KV decode, mixed extend with tree masks.

Graph-safe: nothing here reads a device tensor on the host. A decode-only batch (one new token per
sequence, no tree) takes the decode kernel; anything else takes the extend kernel."""
from __future__ import annotations

import functools

import numpy as np

from replicas.attention.context import ForwardContext
from replicas.attention.spec import AttentionSpec
from replicas.kernels.decode_attention import paged_decode_attention
from replicas.kernels.extend_attention import paged_extend_attention
from replicas.kernels.kv_store import store_kv


class TritonAttentionBackend:
    name = "triton"

    def __init__(self, block_size: int):
        self.block_size = block_size

    @functools.lru_cache(maxsize=None)
    def spec(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float) -> AttentionSpec:
        return AttentionSpec(num_heads, num_kv_heads, head_dim, self.block_size, scale)

    def plan(self, ctx: ForwardContext) -> None:
        if "decode" not in ctx.backend_state:
            qlens = ctx.query_lens_host
            ctx.backend_state["decode"] = ctx.batch.tree_mask is None and qlens is not None and \
                bool(np.all(np.asarray(qlens) == 1))

    def forward(self, q, k, v, kv_cache, ctx: ForwardContext, scale: float):
        store_kv(k, v, kv_cache, ctx.slot_mapping)
        spec = self.spec(q.shape[1], k.shape[1], q.shape[2], scale)
        b = ctx.batch
        if ctx.backend_state["decode"]:
            return paged_decode_attention(q, kv_cache, b.block_tables, b.seq_lens, spec, b.max_seq_len)
        return paged_extend_attention(q, kv_cache, b, spec)
