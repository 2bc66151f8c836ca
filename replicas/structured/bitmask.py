"""The packed token bitmask and its masked fill, in the batched sampler (replicas/sampler.py).

Layout (xgrammar's and llguidance's): int32 [rows, ceil(V / 32)], bit t % 32 of word t // 32 set = token t allowed.
`apply_token_bitmask_` sets the disallowed logits of the constrained rows to -inf in place, with a few batched
torch ops on the logits' device (CPU or CUDA, the same code), or on CUDA with fused sampling in one Triton launch;
rows without a grammar are not touched. In place:
a step's logits are [B, V] floats, and every full-size copy of them (a gather of the constrained rows, a masked
result, a scatter back) costs as much as the masking itself.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Optional

import torch


@lru_cache(maxsize=None)
def _byte_bits(device: torch.device, allowed: bool) -> torch.Tensor:
    """bool [256, 8]: row v holds bits 0..7 of the byte v (set, or clear when not `allowed`), once per device."""
    bits = (torch.arange(256)[:, None] >> torch.arange(8)) & 1
    return (bits == 1 if allowed else bits == 0).to(device)


def bitmask_words(vocab_size: int) -> int:
    return -(-vocab_size // 32)


@dataclass
class TokenMask:
    rows: Optional[torch.Tensor]  # int64 [C]: the sampler batch's rows that follow a grammar (None if leading)
    bitmask: torch.Tensor         # int32 [C, words]: row i's allowed tokens, on the logits' device
    leading: bool = False         # rows are 0..C-1 (every row of a fully constrained batch): no gather, no scatter


def _unpacked(bitmask: torch.Tensor, vocab_size: int, allowed: bool) -> torch.Tensor:
    """Each byte of the words looked up in a 256-row table: byte k of word w holds tokens 32w + 8k .. 32w + 8k + 7
    on a little-endian host (the only kind torch runs on), lowest bit first."""
    table = _byte_bits(bitmask.device, allowed)
    rows = bitmask.shape[0]
    return table.index_select(0, bitmask.view(torch.uint8).reshape(-1).long()).view(rows, -1)[:, :vocab_size]


def allowed_tokens(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """bool [C, vocab_size]: the unpacked mask."""
    return _unpacked(bitmask, vocab_size, True)


def apply_token_bitmask_(logits: torch.Tensor, mask: TokenMask, fused: bool = False) -> torch.Tensor:
    """Sets the disallowed tokens of rows `mask.rows` of logits [B, V] to -inf, in place; returns `logits`.
    `fused` (CUDA): in one Triton launch (replicas/kernels/token_bitmask.py), the same result."""
    if fused and logits.is_cuda and logits.dtype == torch.float32 and logits.stride(1) == 1:
        from replicas.kernels.token_bitmask import apply_token_bitmask_kernel_
        return apply_token_bitmask_kernel_(logits, mask.bitmask, None if mask.leading else mask.rows)
    blocked = _unpacked(mask.bitmask, logits.shape[-1], False)
    if mask.leading:
        logits[:blocked.shape[0]].masked_fill_(blocked, float("-inf"))
    else:
        logits.index_copy_(0, mask.rows, logits.index_select(0, mask.rows).masked_fill_(blocked, float("-inf")))
    return logits


def pack_allowed(allowed: torch.Tensor) -> torch.Tensor:
    """The int32 bitmask of a bool mask [C, V] (tests and tools; the backends fill bitmasks themselves)."""
    rows, vocab = allowed.shape
    padded = torch.zeros(rows, bitmask_words(vocab) * 32, dtype=torch.int64)
    padded[:, :vocab] = allowed.to(torch.int64)
    words = (padded.view(rows, -1, 32) << torch.arange(32)).sum(-1)
    return torch.where(words >= 1 << 31, words - (1 << 32), words).to(torch.int32)
