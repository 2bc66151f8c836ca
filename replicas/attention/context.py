"""The attention metadata of one forward, set for the duration of the forward with `forward_context`."""
from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Optional

import torch

from replicas.attention.spec import AttentionBatch


@dataclass
class ForwardContext:
    batch: AttentionBatch                  # the spec's batch description (shared with the kernels)
    slot_mapping: torch.Tensor             # [T] int64, where each new token's K/V goes; -1 = write nowhere
    # host copies for backends that plan on the CPU (the torch backend); None inside CUDA graphs
    query_lens_host: Optional[list[int]] = None
    seq_lens_host: Optional[list[int]] = None
    backend_state: dict[str, Any] = field(default_factory=dict)


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
