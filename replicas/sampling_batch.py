"""Per-step sampling state: a list of SamplingParams turned into device tensors once per step.

`SamplingBatch.build` is the only O(B) Python in sampling; `Sampler.forward` (replicas/sampler.py)
reads nothing but the tensors and flags made here. Random-row parameters are stored only for the
rows that sample (`random_rows`), so greedy rows cost nothing beyond an argmax.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Optional, Sequence

import numpy as np
import torch

from replicas.sampling_params import SamplingParams
from replicas.structured.bitmask import TokenMask
from replicas.transfer import to_device

_MASK64 = (1 << 64) - 1
_MASK32 = (1 << 32) - 1


@dataclass
class PenaltyState:
    """Penalty factors [B, 1] and token histories [B, V]; rows without penalties hold neutral values."""
    repetition: torch.Tensor        # divide positive / multiply negative logits of seen tokens
    presence: torch.Tensor          # subtracted once from tokens in the output
    frequency: torch.Tensor         # subtracted per occurrence in the output
    output_counts: torch.Tensor     # float32 [B, V]: occurrences of each token in the output so far
    seen: torch.Tensor              # bool [B, V]: token is in the prompt or the output


@dataclass
class LogitBias:
    """The rows' logit_bias entries, flattened: logits[index[0][e], index[1][e]] += values[e]."""
    index: tuple[torch.Tensor, torch.Tensor]    # int64 [E] rows, int64 [E] token ids
    values: torch.Tensor                        # float32 [E]


@dataclass
class SamplingBatch:
    vocab_size: int
    num_rows: int
    random_rows: torch.Tensor       # int64 [R]: rows that sample, in batch order
    # The tensors below have one entry per random row (length R), aligned with `random_rows`.
    temperature: torch.Tensor       # float32 [R]
    top_k: torch.Tensor             # int64 [R]; vocab_size when disabled
    top_p: torch.Tensor             # float32 [R]; 1.0 when disabled
    min_p: torch.Tensor             # float32 [R]; 0.0 when disabled
    seed_lo: torch.Tensor           # int64 [R]: low 32 bits of the row's seed (mod 2**64)
    seed_hi: torch.Tensor           # int64 [R]: high 32 bits
    positions: torch.Tensor         # int64 [R]: index in the sequence of the token being sampled
    all_greedy: bool
    all_random: bool
    use_top_k: bool
    use_top_p: bool
    use_min_p: bool
    needs_full_sort: bool           # a row uses top-p without top-k
    max_top_k: int                  # largest enabled top_k among random rows (0 if none)
    penalties: Optional[PenaltyState]
    stop_mask: Optional[torch.Tensor]   # bool [B, V]: EOS / stop ids of rows still short of min_tokens
    num_logprobs: Optional[int]     # K = max requested logprobs; None when no row asked
    logit_bias: Optional[LogitBias] = None
    token_mask: Optional[TokenMask] = None      # the grammar bitmask of the rows that follow a grammar

    @staticmethod
    def greedy(num_rows: int, vocab_size: int, device, token_mask: Optional[TokenMask] = None) -> "SamplingBatch":
        """Every row takes the argmax of its logits (SamplingParams.argmax_only), after its grammar's mask if any:
        nothing is copied to the device."""
        f, i = torch.empty(0, device=device), torch.empty(0, dtype=torch.long, device=device)
        return SamplingBatch(vocab_size, num_rows, random_rows=i, temperature=f, top_k=i, top_p=f, min_p=f,
                             seed_lo=i, seed_hi=i, positions=i, all_greedy=True, all_random=num_rows == 0,
                             use_top_k=False, use_top_p=False, use_min_p=False, needs_full_sort=False, max_top_k=0,
                             penalties=None, stop_mask=None, num_logprobs=None, token_mask=token_mask)

    @staticmethod
    def build(params: list[SamplingParams], seeds: list[int], positions: list[int],
              output_token_ids: Sequence[Sequence[int]], prompt_token_ids: Sequence[Sequence[int]],
              eos_token_ids: tuple[int, ...], vocab_size: int, device,
              token_mask: Optional[TokenMask] = None) -> "SamplingBatch":
        n = len(params)
        if not (len(seeds) == len(positions) == n):
            raise ValueError(f"params, seeds and positions must have one entry per row, got "
                             f"{n}, {len(seeds)}, {len(positions)}")
        if all(p.argmax_only for p in params):
            return SamplingBatch.greedy(n, vocab_size, device, token_mask)
        rnd = [i for i, p in enumerate(params) if not p.greedy]
        top_k = [_effective_top_k(params[i].top_k, vocab_size) for i in rnd]
        top_p = [float(params[i].top_p) for i in rnd]
        min_p = [float(params[i].min_p) for i in rnd]
        seed64 = [int(seeds[i]) & _MASK64 for i in rnd]
        enabled_k = [k for k in top_k if k < vocab_size]
        requested = [p.logprobs for p in params if p.logprobs is not None]

        # Two host-to-device copies for every random row's parameters (none when every row is greedy).
        floats = torch.tensor([[float(params[i].temperature) for i in rnd], top_p, min_p], dtype=torch.float32)
        ints = torch.tensor([rnd, top_k, [s & _MASK32 for s in seed64], [s >> 32 for s in seed64],
                             [int(positions[i]) & _MASK32 for i in rnd]], dtype=torch.long)
        if rnd:
            floats, ints = to_device(floats, device), to_device(ints, device)
        else:
            floats, ints = floats.to(device), ints.to(device)     # empty: an allocation, nothing to copy
        return SamplingBatch(
            vocab_size=vocab_size,
            num_rows=n,
            random_rows=ints[0],
            temperature=floats[0],
            top_k=ints[1],
            top_p=floats[1],
            min_p=floats[2],
            seed_lo=ints[2],
            seed_hi=ints[3],
            positions=ints[4],
            all_greedy=not rnd,
            all_random=len(rnd) == n,
            use_top_k=bool(enabled_k),
            use_top_p=any(p < 1.0 for p in top_p),
            use_min_p=any(p > 0.0 for p in min_p),
            needs_full_sort=any(p < 1.0 and k == vocab_size for p, k in zip(top_p, top_k)),
            max_top_k=max(enabled_k, default=0),
            penalties=_build_penalties(params, output_token_ids, prompt_token_ids, vocab_size, device),
            stop_mask=_build_stop_mask(params, output_token_ids, eos_token_ids, vocab_size, device),
            num_logprobs=max(requested) if requested else None,
            logit_bias=_build_logit_bias(params, device),
            token_mask=token_mask,
        )

    def repeat_rows(self, width: int) -> "SamplingBatch":
        """Row r becomes rows r * width .. r * width + width - 1, each with r's params, seed and position (a
        draft tree's verify rows: the caller offsets the positions). On the device, no host copy; only for rows
        with no state of their own beyond params and seed (token histories, biases, a grammar mask)."""
        if not (self.penalties is None and self.stop_mask is None and self.logit_bias is None
                and self.token_mask is None):
            raise ValueError("rows with histories, biases or a grammar mask cannot be repeated")
        if self.all_greedy:
            return replace(self, num_rows=self.num_rows * width, all_random=self.num_rows == 0)
        slots = torch.arange(width, device=self.random_rows.device)
        return replace(self, num_rows=self.num_rows * width,
                       random_rows=(self.random_rows[:, None] * width + slots).reshape(-1),
                       **{name: getattr(self, name).repeat_interleave(width)
                          for name in ("temperature", "top_k", "top_p", "min_p", "seed_lo", "seed_hi", "positions")})


class SequenceTokens:
    """Row i = sequence i's prompt or output token ids, as `SamplingBatch.build` takes its histories: sliced only
    for the rows it reads (penalties, a min_tokens check), not copied for every row of every step."""

    def __init__(self, seqs: Sequence, prompt: bool):
        self.seqs, self.prompt = seqs, prompt

    def __len__(self) -> int:
        return len(self.seqs)

    def __getitem__(self, i: int) -> list[int]:
        s = self.seqs[i]
        return s.prompt_token_ids if self.prompt else s.output_token_ids


def _effective_top_k(top_k: int, vocab_size: int) -> int:
    return vocab_size if top_k <= 0 or top_k >= vocab_size else top_k


def _padded_ids(lists: list[Sequence[int]], vocab_size: int) -> torch.Tensor:
    """[B, L] int64 on the host, padded with `vocab_size` (a column the scatter target drops)."""
    width = max((len(t) for t in lists), default=0)
    ids = np.full((len(lists), max(width, 1)), vocab_size, dtype=np.int64)
    for row, toks in enumerate(lists):
        if len(toks):
            ids[row, :len(toks)] = toks
    return torch.from_numpy(ids)


def _scatter_ids(lists: list[Sequence[int]], vocab_size: int, device, dtype) -> torch.Tensor:
    """[B, V] with out[b, t] = number of times t occurs in lists[b] (cast to dtype)."""
    ids = to_device(_padded_ids(lists, vocab_size), device)
    out = torch.zeros(len(lists), vocab_size + 1, dtype=torch.float32, device=device)
    out.scatter_add_(1, ids, torch.ones(ids.shape, dtype=torch.float32, device=device))
    return out[:, :vocab_size].to(dtype)


def _build_penalties(params, output_token_ids, prompt_token_ids, vocab_size, device) -> Optional[PenaltyState]:
    rows = [i for i, p in enumerate(params) if p.penalized]
    if not rows:
        return None
    on = set(rows)
    outputs = [output_token_ids[i] if i in on else () for i in range(len(params))]
    prompts = [prompt_token_ids[i] if i in on and params[i].repetition_penalty != 1.0 else ()
               for i in range(len(params))]
    counts = _scatter_ids(outputs, vocab_size, device, torch.float32)
    seen = _scatter_ids(prompts, vocab_size, device, torch.bool) | (counts > 0)

    def column(values):
        return to_device(torch.tensor(values, dtype=torch.float32).unsqueeze(1), device)

    return PenaltyState(
        repetition=column([float(p.repetition_penalty) for p in params]),
        presence=column([float(p.presence_penalty) for p in params]),
        frequency=column([float(p.frequency_penalty) for p in params]),
        output_counts=counts,
        seen=seen,
    )


def _build_logit_bias(params: list[SamplingParams], device) -> Optional[LogitBias]:
    """The entries of the rows with a logit_bias (its token ids were checked against the vocabulary at admission)."""
    rows = [i for i, p in enumerate(params) if p.logit_bias]
    if not rows:
        return None
    biases = [params[i].logit_bias for i in rows]
    index = np.stack([np.repeat(np.asarray(rows, dtype=np.int64), [len(b) for b in biases]),
                      np.concatenate([np.fromiter(b.keys(), np.int64, len(b)) for b in biases])])
    values = np.concatenate([np.fromiter(b.values(), np.float32, len(b)) for b in biases])
    index = to_device(index, device)
    return LogitBias((index[0], index[1]), to_device(values, device))


def _build_stop_mask(params, output_token_ids, eos_token_ids, vocab_size, device) -> Optional[torch.Tensor]:
    stops: list[tuple[int, ...]] = []
    any_short = False
    for i, p in enumerate(params):
        if p.min_tokens > 0 and len(output_token_ids[i]) < p.min_tokens:
            ids = tuple(p.stop_token_ids) + (() if p.ignore_eos else tuple(eos_token_ids))
            ids = tuple(t for t in ids if 0 <= t < vocab_size)
            any_short = any_short or bool(ids)
            stops.append(ids)
        else:
            stops.append(())
    if not any_short:
        return None
    return _scatter_ids(stops, vocab_size, device, torch.bool)
