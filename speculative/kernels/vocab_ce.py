"""The drafter's two training cross-entropies over the vocabulary and their gradients, for a chunk of rows
(speculative/vocab_loss.py; TrainConfig.vocab_loss picks the kernel).

`chunked`: `ce_grad_kernel`, one program per row of a logit matrix in memory. Pass 1 reads the row once: a running
max and sum of exponentials per lane (the log-sum-exp) and the first index of the largest logit. Pass 2 (with
`GRAD`) reads it again and overwrites it with the gradient of weight * CE: weight * (softmax - one_hot), plus the
row of `acc` where given. The loss runs it on the corrected logits f, then on the base logits b accumulating f's
gradient: with the GEMMs that make and consume them, about 13 passes over a chunk's logits.

`tiled`: `corrected_ce_kernel`. Given b = hidden @ lm_head.T (in memory) and the Domino head's low-rank input z
with W2, f = b + z @ W2.T is never stored: a program owns BM rows and walks the vocabulary in tiles of BN columns,
making each tile of f from the tile of b and a tensor-core product of z with the tile of W2. Pass 1 reads b once:
per row both log-sum-exps, the label's logits and the first index of f's largest logit. Pass 2 (with `GRAD`) reads
b again and writes
    b   <- w_base * (softmax(b) - one_hot) + w_final * (softmax(f) - one_hot)     (hidden's gradient, via lm_head)
    g_f <- w_final * (softmax(f) - one_hot)                                       (W2's gradient, via z)
and accumulates z's gradient g_f @ W2 in registers: about 7 passes over a chunk's logits in all.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 4096                       # chunked: columns a lane block reads at a time
BM, BN, WARPS = 16, 128, 4         # tiled: 16 rows a program, so a chunk of ~5,000 rows fills the GPU's SMs


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


@triton.jit
def _logit_tile(base, stride, safe, w2, zt, ks, R, start, V, BN: tl.constexpr, PRECISION: tl.constexpr):
    """One [BM, BN] tile of b (float32; -inf past V) and of f = b + z W2^T, and W2's tile [BN, RP]."""
    cols = start + tl.arange(0, BN)
    col_ok = cols < V
    xb = tl.load(base + safe[:, None] * stride + cols[None, :], mask=col_ok[None, :],
                 other=float("-inf")).to(tl.float32)
    w2t = tl.load(w2 + cols[:, None] * R + ks[None, :], mask=col_ok[:, None] & (ks[None, :] < R), other=0.0)
    return cols, col_ok, xb, xb + tl.dot(zt, tl.trans(w2t), input_precision=PRECISION), w2t


@triton.jit
def _online_lse(m, s, x):
    """The running max m and sum s of exp(x - m) per row, after one more tile x."""
    new = tl.maximum(m, tl.max(x, 1))
    return new, s * tl.exp(m - new) + tl.sum(tl.exp(x - new[:, None]), 1)


@triton.jit
def corrected_ce_kernel(base, stride, z, w2, labels, w_final, w_base, ce_final, ce_base, argmax_out,
                        g_final, g_z, n, V, R,
                        GRAD: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, RP: tl.constexpr,
                        PRECISION: tl.constexpr):
    rows = tl.program_id(0) * BM + tl.arange(0, BM)
    row_ok = rows < n
    safe = tl.minimum(rows, n - 1).to(tl.int64)        # loads stay in bounds; stores are masked
    ks = tl.arange(0, RP)
    zt = tl.load(z + safe[:, None] * R + ks[None, :], mask=ks[None, :] < R, other=0.0)     # [BM, RP]
    label = tl.load(labels + safe)
    m_b = tl.full([BM], float("-inf"), tl.float32)
    m_f = tl.full([BM], float("-inf"), tl.float32)
    s_b = tl.zeros([BM], tl.float32)
    s_f = tl.zeros([BM], tl.float32)
    x_b = tl.zeros([BM], tl.float32)                    # the label's logit in b and in f
    x_f = tl.zeros([BM], tl.float32)
    top = tl.full([BM], float("-inf"), tl.float32)     # f's largest logit so far and its first index
    best = tl.zeros([BM], tl.int32)
    for start in range(0, V, BN):
        cols, col_ok, xb, xf, w2t = _logit_tile(base, stride, safe, w2, zt, ks, R, start, V, BN, PRECISION)
        m_b, s_b = _online_lse(m_b, s_b, xb)
        m_f, s_f = _online_lse(m_f, s_f, xf)
        hit = cols[None, :] == label[:, None]
        x_b += tl.sum(tl.where(hit, xb, 0.0), 1)
        x_f += tl.sum(tl.where(hit, xf, 0.0), 1)
        tile_top = tl.max(xf, 1)
        first = tl.min(tl.where(xf == tile_top[:, None], cols[None, :], V), 1)
        grew = tile_top > top                           # strict: an earlier tile keeps a tie
        best = tl.where(grew, first, best)
        top = tl.where(grew, tile_top, top)
    lse_b = m_b + tl.log(s_b)
    lse_f = m_f + tl.log(s_f)
    tl.store(ce_base + rows, lse_b - x_b, mask=row_ok)
    tl.store(ce_final + rows, lse_f - x_f, mask=row_ok)
    tl.store(argmax_out + rows, best.to(tl.int64), mask=row_ok)
    if GRAD:
        wf = tl.load(w_final + safe)
        wb = tl.load(w_base + safe)
        gz = tl.zeros([BM, RP], tl.float32)
        for start in range(0, V, BN):
            cols, col_ok, xb, xf, w2t = _logit_tile(base, stride, safe, w2, zt, ks, R, start, V, BN, PRECISION)
            at = rows[:, None] * stride + cols[None, :]
            one_hot = tl.where(cols[None, :] == label[:, None], 1.0, 0.0)
            gf = wf[:, None] * (tl.exp(xf - lse_f[:, None]) - one_hot)
            gb = wb[:, None] * (tl.exp(xb - lse_b[:, None]) - one_hot)
            keep = row_ok[:, None] & col_ok[None, :]
            tl.store(base + at, (gb + gf).to(base.dtype.element_ty), mask=keep)
            gf = gf.to(w2t.dtype)
            tl.store(g_final + at, gf, mask=keep)
            gz += tl.dot(gf, w2t, input_precision=PRECISION)
        tl.store(g_z + rows[:, None] * R + ks[None, :], gz.to(g_z.dtype.element_ty),
                 mask=row_ok[:, None] & (ks[None, :] < R))


def corrected_cross_entropy(base: torch.Tensor, z: torch.Tensor, w2: torch.Tensor, labels: torch.Tensor,
                            w_final: torch.Tensor, w_base: torch.Tensor, grad: bool):
    """base [n, V] (rows contiguous), z [n, R], w2 [V, R] (z's dtype), labels [n] int64, w_final / w_base [n]
    float32 -> (CE(final) [n], CE(base) [n], argmax(final) [n], g_final [n, V] or None, g_z [n, R] or None); with
    `grad`, base is overwritten with the gradient of w_base CE(base) + w_final CE(final) over the logits."""
    n, v = base.shape
    r = z.shape[1]
    dev = base.device
    ce_f, ce_b = torch.empty(n, dtype=torch.float32, device=dev), torch.empty(n, dtype=torch.float32, device=dev)
    argmax = torch.empty(n, dtype=torch.int64, device=dev)
    g_final = torch.empty_like(base) if grad else None
    g_z = torch.empty_like(z) if grad else None
    if n:
        corrected_ce_kernel[(triton.cdiv(n, BM),)](
            base, base.stride(0), z.contiguous(), w2.contiguous(), labels, w_final, w_base, ce_f, ce_b, argmax,
            g_final if grad else base, g_z if grad else z, n, v, r, GRAD=grad, BM=BM,
            BN=min(BN, max(16, triton.next_power_of_2(v))), RP=max(16, triton.next_power_of_2(r)),
            PRECISION="ieee" if z.dtype == torch.float32 else "tf32", num_warps=WARPS)
    return ce_f, ce_b, argmax, g_final, g_z
