"""The batched on-device sampler: last-position logits [B, V] in, one token per row out.

Order of processing, all batched torch ops on the logits' device:

1. Logprobs (only if a row asked): log_softmax of the *raw* logits, before any processing; the
   sampled token's logprob and the top-K alternatives (K = max requested in the batch).
2. Penalties, for tokens of the row's history:
   repetition (HF/vLLM): a token seen in prompt or output has its logit divided by r if positive,
   multiplied by r otherwise; then presence: minus `presence` once if the token is in the output;
   frequency: minus `frequency * count` of the token in the output.
3. min_tokens: while a row has fewer outputs than min_tokens, EOS (unless ignore_eos) and its
   stop_token_ids get -inf.
   logit_bias: each entry is added to its row's logit (one batched index_put over every row's entries).
   Grammar: the tokens a constrained row's grammar does not allow next get -inf (the row's packed bitmask,
   replicas/structured/bitmask.py; on CUDA with fused sampling one Triton launch, replicas/kernels/
   token_bitmask.py), in place: float32 logits given to the sampler may come back with those entries at -inf,
   so a caller passes logits it does not read again. Rows without a grammar are untouched.
   Logprobs stay those of step 1.
4. Greedy rows (temperature 0): argmax of the penalised logits (first index on ties).
5. Random rows: divide by temperature; top-k (keep logits >= the k-th largest); top-p on the
   renormalised top-k distribution (keep the smallest descending prefix whose mass reaches p);
   min-p on the renormalised result (keep p >= min_p * p_max). Cuts are value thresholds, so ties
   at a cut are all kept. Then sample by the Gumbel-max trick (an exponential race):
   argmax(logits + g), g = -log(-log u), u from a counter-based hash of (seed, position, token id).
   Fast paths (flags set by SamplingBatch.build): an all-greedy batch does only argmax; top-k and
   top-p cost one torch.topk of width max(top_k), or one full sort when a row uses top-p alone.
   On CUDA (unless TIDAL_FUSED_SAMPLING=0) the row's key, the noise, the add and the argmax are one Triton
   kernel (replicas/kernels/gumbel.py), with the division by temperature too when no cut applies: the same hash
   in uint32 registers instead of a hundred small int64 ops and [R, V] passes.

Reproducibility: u depends only on the row's 64-bit seed, the position of the token being sampled
and the vocabulary index, computed with exact 32-bit integer arithmetic held in int64 (every
product stays below 2**63, nothing relies on overflow). A request's sample is thus the same in any
batch, at any row, on any run; floats enter only through the row's own logits and the logs of u
(so CPU and GPU agree except where two scores tie to within rounding).

Speculative verification reuses `Sampler.forward` unchanged: make one row per tree node
([num_nodes, V] logits), each with its request's SamplingParams and seed and with position = the
index of the token that node's row samples (the node's depth + the request's next position), and
for penalties the output history extended by the node's path. Rows are independent, so the tree
walk (accept while the sample at a node is one of its children) yields exactly the tokens plain
decoding would sample from the same logits: the sample at a position never depends on how many
rows the batch had. Siblings share a position and hence their uniforms; only one path is walked.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
from torch import nn

from replicas import envs
from replicas.sampling_batch import PenaltyState, SamplingBatch
from replicas.structured.bitmask import apply_token_bitmask_

_MASK32 = 0xFFFFFFFF
_SEED_SALT = 0x5BD1E995
_POSITION_SALT = 0x27D4EB2F
_VOCAB_SALT = 0x165667B1
_SALTS = (_SEED_SALT, _POSITION_SALT, _VOCAB_SALT)


@dataclass
class SamplerOutput:
    token_ids: torch.Tensor                 # [B] int64
    logprobs: Optional[torch.Tensor]        # [B] float32: raw logprob of the sampled token
    top_ids: Optional[torch.Tensor]         # [B, K] int64: top-K tokens by raw logprob
    top_logprobs: Optional[torch.Tensor]    # [B, K] float32


def _mul32_(x: torch.Tensor, c: int, tmp: torch.Tensor) -> torch.Tensor:
    """In place: x = (x * c) mod 2**32, x in [0, 2**32) held in int64; no product reaches 2**63."""
    if c < 1 << 31:
        return x.mul_(c).bitwise_and_(_MASK32)
    # x*c = x*(c - 2**31) + x*2**31, and x*2**31 mod 2**32 is the low bit of x moved to bit 31.
    high = torch.bitwise_and(x, 1, out=tmp).bitwise_left_shift_(31)
    return x.mul_(c - (1 << 31)).add_(high).bitwise_and_(_MASK32)


def _xorshift_(x: torch.Tensor, shift: int, tmp: torch.Tensor) -> torch.Tensor:
    return x.bitwise_xor_(torch.bitwise_right_shift(x, shift, out=tmp))


def _mix32_tail_(x: torch.Tensor, tmp: torch.Tensor) -> torch.Tensor:
    _mul32_(x, 0x7FEB352D, tmp)
    _xorshift_(x, 15, tmp)
    _mul32_(x, 0x846CA68B, tmp)
    return _xorshift_(x, 16, tmp)


def mix32(x: torch.Tensor) -> torch.Tensor:
    """A bijective 32-bit avalanche mix (xorshift-multiply) of int64 values in [0, 2**32)."""
    x, tmp = x.clone(), torch.empty_like(x)
    return _mix32_tail_(_xorshift_(x, 16, tmp), tmp)


def row_keys(seed_lo: torch.Tensor, seed_hi: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """[R] 32-bit keys, one per (seed, position)."""
    seed_key = mix32(mix32(seed_hi ^ _SEED_SALT) ^ seed_lo)
    return mix32(seed_key ^ mix32(positions ^ _POSITION_SALT))


def vocab_codes(vocab_size: int, device) -> torch.Tensor:
    """[V] distinct 32-bit codes, one per token id (mix32 is a bijection)."""
    return mix32(torch.arange(vocab_size, dtype=torch.long, device=device) ^ _VOCAB_SALT)


def counter_uniforms(keys: torch.Tensor, codes: torch.Tensor) -> torch.Tensor:
    """[R, V] float32 uniforms u = (2m + 1) / 2**24, m = top 23 bits of mix32(code ^ key): 0 < u < 1."""
    # mix32 opens with x ^= x >> 16, which is linear over xor: apply it to the [V] codes and the
    # [R] keys apart, so the [R, V] work starts at the first multiply. The [R, V] work runs in
    # place in two buffers (large CPU allocations cost more than the arithmetic).
    x = (codes ^ (codes >> 16)).unsqueeze(0) ^ (keys ^ (keys >> 16)).unsqueeze(1)
    bits = _mix32_tail_(x, torch.empty_like(x)).bitwise_right_shift_(9)
    return bits.to(torch.float32).mul_(2.0 ** -23).add_(2.0 ** -24)


def gumbel_noise(keys: torch.Tensor, codes: torch.Tensor) -> torch.Tensor:
    """[R, V] float32 Gumbel(0, 1) samples -log(-log u)."""
    return counter_uniforms(keys, codes).log_().neg_().log_().neg_()


def first_max_index(x: torch.Tensor) -> torch.Tensor:
    """Per row of x [R, V], the index of its first maximum (argmax's contract, NaN counting as the maximum). On the
    CPU through `max(dim)`, whose reduction is vectorized where argmax's is not: several times faster over a
    vocabulary."""
    return x.max(dim=-1).indices if x.device.type == "cpu" else x.argmax(dim=-1)


class Sampler(nn.Module):
    def __init__(self, fused: Optional[bool] = None):
        """fused: sample random rows on CUDA with the fused kernel (replicas/kernels/gumbel.py); default
        TIDAL_FUSED_SAMPLING."""
        super().__init__()
        self._codes: Optional[torch.Tensor] = None
        self.fused = envs.fused_sampling() if fused is None else fused

    @torch.inference_mode()         # the runner's logits are inference tensors, and the grammar mask writes into them
    def forward(self, logits: torch.Tensor, batch: SamplingBatch) -> SamplerOutput:
        assert logits.dim() == 2 and logits.shape[0] == batch.num_rows, (tuple(logits.shape), batch.num_rows)
        if logits.shape[-1] > batch.vocab_size:        # padded LM head columns are never sampled
            logits = logits[:, :batch.vocab_size]
        logits = logits.float()
        raw_logprobs = torch.log_softmax(logits, dim=-1) if batch.num_logprobs is not None else None
        if batch.penalties is not None:
            logits = apply_penalties(logits, batch.penalties)
        if batch.stop_mask is not None:
            logits = logits.masked_fill(batch.stop_mask, float("-inf"))
        if batch.logit_bias is not None:
            logits = logits.index_put(batch.logit_bias.index, batch.logit_bias.values, accumulate=True)
        if batch.token_mask is not None:
            apply_token_bitmask_(logits, batch.token_mask, fused=self.fused)

        if batch.all_greedy:
            token_ids = first_max_index(logits)
        elif batch.all_random:
            token_ids = self._sample(logits, batch)
        else:
            token_ids = first_max_index(logits)
            sampled = self._sample(logits.index_select(0, batch.random_rows), batch)
            token_ids = token_ids.index_copy(0, batch.random_rows, sampled)

        if raw_logprobs is None:
            return SamplerOutput(token_ids, None, None, None)
        sampled_logprobs = raw_logprobs.gather(1, token_ids.unsqueeze(1)).squeeze(1)
        if batch.num_logprobs == 0:
            return SamplerOutput(token_ids, sampled_logprobs, None, None)
        top = raw_logprobs.topk(batch.num_logprobs, dim=-1)
        return SamplerOutput(token_ids, sampled_logprobs, top.indices, top.values)

    def _sample(self, logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        """Token ids [R] for the random rows' logits [R, V]."""
        fused = logits.is_cuda and self.fused
        divide_in_kernel = fused and not (batch.use_top_k or batch.use_top_p or batch.use_min_p)
        if not divide_in_kernel:
            logits = logits / batch.temperature.unsqueeze(1)
        if batch.use_top_k or batch.use_top_p:
            logits = logits.masked_fill(logits < top_k_top_p_cut(logits, batch), float("-inf"))
        if batch.use_min_p:
            # p >= min_p * p_max  <=>  logit >= max_logit + log(min_p); min_p = 0 gives -inf (keep all).
            cut = logits.amax(dim=-1, keepdim=True) + torch.log(batch.min_p).unsqueeze(1)
            logits = logits.masked_fill(logits < cut, float("-inf"))
        if fused:
            from replicas.kernels.gumbel import gumbel_argmax
            return gumbel_argmax(logits.contiguous(), batch.seed_lo, batch.seed_hi, batch.positions, _SALTS,
                                 batch.temperature if divide_in_kernel else None)
        keys = row_keys(batch.seed_lo, batch.seed_hi, batch.positions)
        noise = gumbel_noise(keys, self._vocab_codes(logits.shape[-1], logits.device))
        return first_max_index(noise.add_(logits))

    def _vocab_codes(self, vocab_size: int, device) -> torch.Tensor:
        codes = self._codes
        if codes is None or codes.numel() != vocab_size or codes.device != torch.device(device):
            codes = self._codes = vocab_codes(vocab_size, device)
        return codes


def apply_penalties(logits: torch.Tensor, pen: PenaltyState) -> torch.Tensor:
    repeated = torch.where(logits > 0, logits / pen.repetition, logits * pen.repetition)
    logits = torch.where(pen.seen, repeated, logits)
    in_output = (pen.output_counts > 0).to(logits.dtype)
    return logits - pen.presence * in_output - pen.frequency * pen.output_counts


def top_k_top_p_cut(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """[R, 1] logit thresholds: a token survives top-k and top-p iff its logit >= the threshold.

    Works on the descending values of a window: the top max_top_k values (torch.topk) when every
    row that uses top-p also uses top-k, else the whole sorted row. Top-p mass is summed over the
    row's k largest values, unnormalised and from the row's maximum, so the arithmetic for a row
    does not depend on the window's width (that is, on the other rows of the batch).
    """
    if batch.needs_full_sort:
        ordered = logits.sort(dim=-1, descending=True).values
    else:
        ordered = logits.topk(batch.max_top_k, dim=-1).values
    width = ordered.shape[-1]
    top_k = batch.top_k.unsqueeze(1)                # vocab_size when disabled
    k = top_k.clamp(max=width)
    k_cut = ordered.gather(1, k - 1).masked_fill(top_k > width, float("-inf"))
    if not batch.use_top_p:
        return k_cut
    rank = torch.arange(width, device=logits.device).unsqueeze(0)
    weights = torch.exp(ordered - ordered[:, :1]).masked_fill(rank >= k, 0.0)
    cumulative = weights.cumsum(dim=-1)
    top_p = batch.top_p.unsqueeze(1)
    keep = cumulative - weights < top_p * cumulative.gather(1, k - 1)
    # A row keeps at least its top token, also when its weights are not finite (logits overflowed to inf).
    p_cut = ordered.gather(1, (keep.sum(dim=-1, keepdim=True) - 1).clamp(min=0))
    # top_p = 1 cuts nothing (rounding in the sums must not drop tail tokens).
    return torch.maximum(k_cut, p_cut.masked_fill(top_p >= 1.0, float("-inf")))
