"""Comparing greedy token streams under the near-tie rule.

Two greedy runs may part ways only where the reference's top-2 logits are within `tie` of each
other (float round-off can flip such a choice). Any other difference is a real bug."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import torch


@dataclass
class Flip:
    prompt_index: int
    position: int
    gap: float


def compare_greedy(prompts: Sequence[list[int]], got: Sequence[list[int]], want: Sequence[list[int]],
                   last_logits: Callable[[list[int]], torch.Tensor], tie: float = 1e-3) -> list[Flip]:
    """Returns the accepted flips; raises AssertionError on a difference that is not a near-tie."""
    flips = []
    for i, (prompt, a, b) in enumerate(zip(prompts, got, want)):
        n = min(len(a), len(b))
        k = next((j for j in range(n) if a[j] != b[j]), None)
        if k is None:
            assert len(a) == len(b), f"prompt {i}: lengths differ ({len(a)} vs {len(b)}) with equal tokens"
            continue
        logits = last_logits(list(prompt) + list(b[:k])).float()
        top2 = logits.topk(2).values
        gap = float(top2[0] - top2[1])
        assert gap < tie, (f"prompt {i}: token {k} differs ({a[k]} vs {b[k]}) and the top-2 logit gap is "
                           f"{gap:.2e}, not a near-tie")
        flips.append(Flip(i, k, gap))
    return flips
