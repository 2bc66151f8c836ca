"""Cross-entropy over the vocabulary and its gradient, in place, one program per row (speculative/vocab_loss.py).

Pass 1 reads the row once: a running max and sum of exponentials per lane (the log-sum-exp) and the first
index of the largest logit. Pass 2 (with `GRAD`) reads it again and overwrites it with the gradient of
weight * CE: weight * (softmax - one_hot(label)), plus the row of `acc` where given. So a row costs two reads
and one write of its logits, where the same math in torch ops makes several float32 copies of them.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 4096


@triton.jit
def ce_grad_kernel(logits, stride, labels, weights, ce_out, argmax_out, acc, acc_stride, V,
                   GRAD: tl.constexpr, HAS_ACC: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    x_row = logits + row * stride
    cols = tl.arange(0, BLOCK)
    m = tl.full([BLOCK], float("-inf"), tl.float32)       # per lane: the largest logit seen, its index, and
    best = tl.zeros([BLOCK], tl.int32)                    # the sum of exp(x - m) over what the lane has seen
    s = tl.zeros([BLOCK], tl.float32)
    for start in range(0, V, BLOCK):
        idx = start + cols
        inside = idx < V
        x = tl.load(x_row + idx, mask=inside, other=float("-inf")).to(tl.float32)
        grew = x > m                                      # strict: a lane keeps its first index of a tie
        new_m = tl.where(grew, x, m)
        scale = tl.where(grew, tl.exp(m - new_m), 1.0)
        s = s * scale + tl.where(inside, tl.exp(x - new_m), 0.0)
        best = tl.where(grew, idx, best)
        m = new_m
    top = tl.max(m, 0)
    lse = top + tl.log(tl.sum(s * tl.exp(m - top), 0))
    label = tl.load(labels + row)
    ce = lse - tl.load(x_row + label).to(tl.float32)
    tl.store(ce_out + row, ce)
    tl.store(argmax_out + row, tl.min(tl.where(m == top, best, V), 0).to(tl.int64))
    if GRAD:
        w = tl.load(weights + row)
        for start in range(0, V, BLOCK):
            idx = start + cols
            inside = idx < V
            x = tl.load(x_row + idx, mask=inside, other=0.0).to(tl.float32)
            g = tl.exp(x - lse) * w - tl.where(idx == label, w, 0.0)
            if HAS_ACC:
                g += tl.load(acc + row * acc_stride + idx, mask=inside, other=0.0).to(tl.float32)
            tl.store(x_row + idx, g.to(logits.dtype.element_ty), mask=inside)


def cross_entropy_grad(logits: torch.Tensor, labels: torch.Tensor, weights: torch.Tensor, grad: bool,
                       acc: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [n, V] (rows contiguous), labels [n] int64, weights [n] float32 -> (CE [n] float32, argmax [n]);
    with `grad`, logits become weight * (softmax - one_hot) (+ acc)."""
    n, v = logits.shape
    ce = torch.empty(n, dtype=torch.float32, device=logits.device)
    argmax = torch.empty(n, dtype=torch.int64, device=logits.device)
    if n:
        ce_grad_kernel[(n,)](logits, logits.stride(0), labels, weights, ce, argmax,
                             acc if acc is not None else logits, acc.stride(0) if acc is not None else 0, v,
                             GRAD=grad, HAS_ACC=acc is not None, BLOCK=min(BLOCK, triton.next_power_of_2(v)),
                             num_warps=8)
    return ce, argmax
