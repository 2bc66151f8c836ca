"""Fused Gumbel-max sampling: one pass over each row's scores, no [rows, vocab] noise tensor.

For float32 scores [R, V] (the random rows' logits, cut; divided by their temperature here or before) and each
row's seed and position, the token argmax_v (scores[v] + g(key, v)) with the sampler's counter-based Gumbel noise
(replicas/sampler.py): code(v) = mix32(v ^ VOCAB_SALT), m = mix32(code(v) ^ key) >> 9 (23 bits),
u = (2m + 1) / 2**24, g = -log(-log u). The torch path builds the noise as a dozen int64 [R, V] passes (the
hash held in int64 so that no product overflows); here the hash runs in uint32 registers, where a product wraps
mod 2**32 by definition, and the noise never reaches memory.

Same contract as `first_max_index` over the noisy scores: the first index among equal maxima, NaN above every
number (the first NaN wins, as torch.argmax), a row of -inf gives 0. The integer hash and u are exact in both
paths; the two logs can differ in the last bit from the torch kernels', so the two paths agree except where two
noisy scores tie to within rounding.
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl
from torch import Tensor

BLOCK = 1024


@triton.jit
def _mix32_tail(x):
    x = x * 0x7FEB352D
    x = x ^ (x >> 15)
    x = x * 0x846CA68B
    return x ^ (x >> 16)


@triton.jit
def _mix32(x):
    return _mix32_tail(x ^ (x >> 16))


@triton.jit
def _gumbel_argmax_kernel(scores_ptr, stride, temperature_ptr, seed_lo_ptr, seed_hi_ptr, positions_ptr, out_ptr, V,
                          SEED_SALT: tl.constexpr, POSITION_SALT: tl.constexpr, VOCAB_SALT: tl.constexpr,
                          DIVIDE: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    seed_lo = tl.load(seed_lo_ptr + row).to(tl.uint32)
    seed_hi = tl.load(seed_hi_ptr + row).to(tl.uint32)
    position = tl.load(positions_ptr + row).to(tl.uint32)
    key = _mix32(_mix32(_mix32(seed_hi ^ SEED_SALT) ^ seed_lo) ^ _mix32(position ^ POSITION_SALT))
    key = key ^ (key >> 16)
    if DIVIDE:
        temperature = tl.load(temperature_ptr + row)
    lanes = tl.arange(0, BLOCK)
    best = tl.full([BLOCK], float("-inf"), tl.float32)
    best_idx = lanes
    for start in range(0, V, BLOCK):
        cols = start + lanes
        inside = cols < V
        s = tl.load(scores_ptr + row * stride + cols, mask=inside, other=float("-inf"))
        if DIVIDE:
            s = tl.math.div_rn(s, temperature)          # IEEE division, as torch's
        code = cols.to(tl.uint32) ^ VOCAB_SALT
        code = _mix32_tail(code ^ (code >> 16))
        bits = _mix32_tail((code ^ (code >> 16)) ^ key) >> 9
        u = bits.to(tl.float32) * (1.0 / 8388608.0) + (1.0 / 16777216.0)
        v = -tl.log(-tl.log(u)) + s
        v = tl.where(inside, v, float("-inf"))
        take = (v > best) | ((v != v) & (best == best))         # strictly greater, or the first NaN
        best = tl.where(take, v, best)
        best_idx = tl.where(take, cols, best_idx)
    is_nan = best != best
    nan_idx = tl.min(tl.where(is_nan, best_idx, 2147483647), 0)
    top = tl.max(tl.where(is_nan, float("-inf"), best), 0)
    top_idx = tl.min(tl.where(best == top, best_idx, 2147483647), 0)
    tl.store(out_ptr + row, tl.where(nan_idx < 2147483647, nan_idx, top_idx).to(tl.int64))


def gumbel_argmax(scores: Tensor, seed_lo: Tensor, seed_hi: Tensor, positions: Tensor, salts: tuple[int, int, int],
                  temperature: Optional[Tensor] = None) -> Tensor:
    """int64 [R] token ids for float32 scores [R, V] (rows contiguous): each row's key hashed from its seed halves
    and position (int64 [R], values in [0, 2**32)) with `salts` (seed, position, vocabulary), as the sampler's
    `row_keys`; with `temperature` (float32 [R]) the scores are divided by it first, in the kernel. One launch:
    the sampler's host cost for random rows does not grow with the hash's arithmetic."""
    assert scores.dtype == torch.float32 and scores.dim() == 2 and scores.stride(1) == 1
    rows, vocab = scores.shape
    out = torch.empty(rows, dtype=torch.int64, device=scores.device)
    if rows:
        seed_salt, position_salt, vocab_salt = salts
        _gumbel_argmax_kernel[(rows,)](scores, scores.stride(0), temperature if temperature is not None else scores,
                                       seed_lo, seed_hi, positions, out, vocab, SEED_SALT=seed_salt,
                                       POSITION_SALT=position_salt, VOCAB_SALT=vocab_salt,
                                       DIVIDE=temperature is not None, BLOCK=BLOCK, num_warps=4)
    return out
