"""What an attention layer is (AttentionSpec) and what one forward asks of it (AttentionBatch).

KV cache contract, one tensor per layer: `kv_cache[num_blocks, 2, block_size, num_kv_heads, head_dim]`,
index 0 of dim 1 is K, 1 is V. Token slot `s = block_id * block_size + offset`; slot -1 means "write nowhere".
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch
from torch import Tensor


@dataclass(frozen=True)
class AttentionSpec:
    num_heads: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    scale: float
    causal: bool = True
    sliding_window: Optional[int] = None   # key p visible to query t iff t - p < sliding_window

    def __post_init__(self):
        if self.num_heads % self.num_kv_heads != 0:
            raise ValueError(f"num_heads {self.num_heads} is not a multiple of num_kv_heads {self.num_kv_heads}")
        if self.sliding_window is not None and self.sliding_window < 1:
            raise ValueError(f"sliding_window must be >= 1, got {self.sliding_window}")

    @property
    def group_size(self) -> int:
        """Query heads per KV head: query head h reads KV head h // group_size."""
        return self.num_heads // self.num_kv_heads

    def kv_cache_shape(self, num_blocks: int) -> tuple[int, int, int, int, int]:
        return (num_blocks, 2, self.block_size, self.num_kv_heads, self.head_dim)


@dataclass
class AttentionBatch:
    """One forward's metadata: a mixed batch of prefill chunks, decodes and tree verifies.

    q is flattened to [T, H, D]; request b owns rows query_start_loc[b]:query_start_loc[b+1], which are the
    last q_len positions of its seq_lens[b]-token context (their K/V are already in the cache).
    """
    query_start_loc: Tensor          # [B+1] int32
    seq_lens: Tensor                 # [B] int32, context length including the new tokens
    block_tables: Tensor             # [B, max_blocks] int32; entries past a sequence's blocks are arbitrary
    max_query_len: int
    max_seq_len: int
    # tree_mask[b, i, j]: new token i of request b may see new token j of request b. The prefix (context before
    # the new tokens) is always visible. None = causal (or full, if spec.causal is False) among new tokens.
    tree_mask: Optional[Tensor] = None   # [B, max_query_len, max_query_len] bool
    _tile_ends: dict = field(default_factory=dict, repr=False, compare=False)

    def tile_ends(self, tokens_per_tile: int) -> Tensor:
        """[B] int32: tiles of `tokens_per_tile` new tokens through each request (running count), computed on
        the device once per forward (every layer of a forward shares this batch; a graph records it once)."""
        ends = self._tile_ends.get(tokens_per_tile)
        if ends is None:
            q_lens = self.query_start_loc[1:] - self.query_start_loc[:-1]
            ends = torch.cumsum(torch.div(q_lens + (tokens_per_tile - 1), tokens_per_tile, rounding_mode="floor"),
                                0, dtype=torch.int32)
            self._tile_ends[tokens_per_tile] = ends
        return ends

    @property
    def num_seqs(self) -> int:
        return self.seq_lens.shape[0]

    @staticmethod
    def for_decode(block_tables: Tensor, seq_lens: Tensor, max_seq_len: int) -> "AttentionBatch":
        """One new token per request (plain decoding)."""
        b = seq_lens.shape[0]
        qsl = torch.arange(b + 1, dtype=torch.int32, device=seq_lens.device)
        return AttentionBatch(qsl, seq_lens, block_tables, 1, max_seq_len, None)
