"""The grammar's packed token bitmask applied to logits in place, in one launch.

Bit t % 32 of word t // 32 of a row's int32 words set = token t allowed (replicas/structured/bitmask.py). Each
program reads one block of a constrained row's logits' columns and their words and writes -inf where the bit is
clear; allowed logits are not written. The torch path unpacks the words through a byte table into a bool
[rows, vocab] mask (an int64 index of every byte, then the table's rows) and fills from it: four launches and
two full-size temporaries per step, where this reads the words once.
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl
from torch import Tensor

BLOCK = 2048


@triton.jit
def _apply_token_bitmask_kernel(logits_ptr, logits_stride, bitmask_ptr, bitmask_stride, rows_ptr, V,
                                HAS_ROWS: tl.constexpr, BLOCK: tl.constexpr):
    i = tl.program_id(0).to(tl.int64)
    row = tl.load(rows_ptr + i) if HAS_ROWS else i
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    inside = cols < V
    words = tl.load(bitmask_ptr + i * bitmask_stride + cols // 32, mask=inside, other=-1)
    blocked = ((words >> (cols % 32)) & 1) == 0
    tl.store(logits_ptr + row * logits_stride + cols, tl.full([BLOCK], float("-inf"), tl.float32),
             mask=inside & blocked)


def apply_token_bitmask_kernel_(logits: Tensor, bitmask: Tensor, rows: Optional[Tensor]) -> Tensor:
    """Row rows[i] (i when `rows` is None) of float32 logits [B, V] := -inf where row i of the int32 bitmask
    [C, words] has the token's bit clear; in place, returns `logits`."""
    assert logits.dtype == torch.float32 and logits.stride(1) == 1 and bitmask.dtype == torch.int32
    count, vocab = bitmask.shape[0], logits.shape[1]
    assert bitmask.stride(1) == 1 and bitmask.shape[1] * 32 >= vocab
    if count:
        _apply_token_bitmask_kernel[(count, triton.cdiv(vocab, BLOCK))](
            logits, logits.stride(0), bitmask, bitmask.stride(0), rows if rows is not None else bitmask, vocab,
            HAS_ROWS=rows is not None, BLOCK=BLOCK, num_warps=4)
    return logits
