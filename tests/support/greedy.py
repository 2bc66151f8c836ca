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


def plain_greedy_case(folder: str, lengths: Sequence[int], seed: int, first_tokens: int, more_tokens: int,
                      **engine_kw):
    """Random prompts of `lengths` tokens (request i asks for first_tokens + i x more_tokens), the plain
    engine's greedy outputs for them, and HF transformers' last-position logits for `compare_greedy`:
    (prompts, params, want, last_logits)."""
    import transformers

    from replicas import LLM, SamplingParams

    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(3, hf.config.vocab_size, (k,), generator=g).tolist() for k in lengths]
    params = [SamplingParams(temperature=0.0, max_tokens=first_tokens + more_tokens * i, ignore_eos=True)
              for i in range(len(prompts))]
    plain = LLM(model=folder, **engine_kw)
    try:
        want = [o.outputs[0].token_ids for o in plain.generate(prompts, params)]
    finally:
        plain.shutdown()

    @torch.no_grad()
    def last(ids):
        return hf(torch.tensor([ids])).logits[0, -1]

    return prompts, params, want, last
