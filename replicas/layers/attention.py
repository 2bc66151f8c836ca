"""The attention layer: stores this step's K/V in the paged cache and attends through the backend."""
from __future__ import annotations

import torch
from torch import nn

from replicas.attention.context import get_forward_context


class PagedAttention(nn.Module):
    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim, self.scale = num_heads, num_kv_heads, head_dim, scale
        self.kv_cache: torch.Tensor | None = None   # [num_blocks, 2, block_size, Hkv, D], bound by the model runner
        self.backend = None

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        ctx = get_forward_context()
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        o = self.backend.forward(q, k, v, self.kv_cache, ctx, self.scale)
        return o.reshape(o.shape[0], -1)
