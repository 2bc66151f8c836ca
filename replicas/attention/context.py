"""The attention metadata of one forward, set for the duration of the forward with `forward_context`."""
from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Optional

import torch


@dataclass
class ForwardContext:
    """Flattened mixed batch: B sequences, T new tokens in total (q is [T, H, D]).

    Sequence b's new tokens are q[query_start_loc[b]:query_start_loc[b+1]] and sit at the last
    q_len positions of its seq_lens[b]-token context."""
    query_start_loc: torch.Tensor          # [B+1] int32
    seq_lens: torch.Tensor                 # [B] int32, context including the new tokens
    block_tables: torch.Tensor             # [B, max_blocks] int32
    slot_mapping: torch.Tensor             # [T] int64, -1 = write nowhere
    max_query_len: int
    max_seq_len: int
    tree_mask: Optional[torch.Tensor] = None   # [B, max_q, max_q] bool over the new tokens; None = causal
    # host copies for backends that plan on the CPU (the torch backend); None inside CUDA graphs
    query_lens_host: Optional[list[int]] = None
    seq_lens_host: Optional[list[int]] = None
    backend_state: dict[str, Any] = field(default_factory=dict)

    @property
    def num_seqs(self) -> int:
        return self.seq_lens.shape[0]


_CTX: Optional[ForwardContext] = None


@contextmanager
def forward_context(ctx: ForwardContext):
    global _CTX
    prev, _CTX = _CTX, ctx
    try:
        yield ctx
    finally:
        _CTX = prev


def get_forward_context() -> ForwardContext:
    assert _CTX is not None, "attention called outside forward_context()"
    return _CTX
