"""The packed token bitmask and its masked fill, in the batched sampler (replicas/sampler.py).

Layout (xgrammar's and llguidance's): int32 [rows, ceil(V / 32)], bit t % 32 of word t // 32 set = token t allowed.
`apply_token_bitmask` sets the disallowed logits of the constrained rows to -inf with a few batched torch ops on
the logits' device (CPU or CUDA, the same code); rows without a grammar are not touched.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import torch


@lru_cache(maxsize=None)
def _bits(device: torch.device) -> torch.Tensor:
    """int32 [32]: 1 << b (bit 31 is the sign bit), once per device (no host-to-device copy per step)."""
    return torch.tensor([1 << b for b in range(31)] + [-(1 << 31)], dtype=torch.int32, device=device)


def bitmask_words(vocab_size: int) -> int:
    return -(-vocab_size // 32)


@dataclass
class TokenMask:
    rows: torch.Tensor          # int64 [C]: the sampler batch's rows that follow a grammar
    bitmask: torch.Tensor       # int32 [C, words]: row i's allowed tokens, on the logits' device


def allowed_tokens(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """bool [C, vocab_size]: the unpacked mask."""
    bits = _bits(bitmask.device)
    return (torch.bitwise_and(bitmask.unsqueeze(-1), bits) != 0).view(bitmask.shape[0], -1)[:, :vocab_size]


def apply_token_bitmask(logits: torch.Tensor, mask: TokenMask) -> torch.Tensor:
    """logits [B, V] with the masked tokens of rows `mask.rows` at -inf (a new tensor; `logits` is unchanged)."""
    allowed = allowed_tokens(mask.bitmask, logits.shape[-1])
    masked = torch.where(allowed, logits.index_select(0, mask.rows), float("-inf"))
    return logits.index_copy(0, mask.rows, masked)


def pack_allowed(allowed: torch.Tensor) -> torch.Tensor:
    """The int32 bitmask of a bool mask [C, V] (tests and tools; the backends fill bitmasks themselves)."""
    rows, vocab = allowed.shape
    padded = torch.zeros(rows, bitmask_words(vocab) * 32, dtype=torch.int64)
    padded[:, :vocab] = allowed.to(torch.int64)
    words = (padded.view(rows, -1, 32) << torch.arange(32)).sum(-1)
    return torch.where(words >= 1 << 31, words - (1 << 32), words).to(torch.int32)
