"""The drafter's two cross-entropies over the vocabulary and their gradients, one program per block of rows
(speculative/vocab_loss.py).

A row's base logits x come in (a GEMM's output, [n, V]); its corrected logits f = x + z W2^T are made here tile
by tile (a [rows, rank] x [rank, tile] product on the tensor cores, W2's tile read from L2) and never stored.
Pass 1 reads x once: per row the log-sum-exp of x and of f, both at the label, and the first index of the largest
f. Pass 2 (with `GRAD`) reads x again and writes

    g_final = w_final * (softmax(f) - one_hot(label))            into `g_final`
    g_base  = w_base * (softmax(x) - one_hot(label)) + g_final   over x, in place

and accumulates g_z = g_final W2 for the block's rows. So a row's logits cost two reads and two writes in HBM,
where making f with a GEMM and taking the two cross-entropies one after the other reads or writes them nine times.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_ROWS = 64
BLOCK_COLS = 128
NUM_WARPS = 8


@triton.jit
def pair_ce_kernel(x_ptr, x_stride, z_ptr, z_stride, w2_ptr, w2_stride, gf_ptr, gf_stride, gz_ptr, gz_stride,
                   labels_ptr, wf_ptr, wb_ptr, ce_f_ptr, ce_b_ptr, argmax_ptr, n, V, R,
                   GRAD: tl.constexpr, BM: tl.constexpr, BV: tl.constexpr, BR: tl.constexpr):
    rows = tl.program_id(0) * BM + tl.arange(0, BM)
    row_ok = rows < n
    rows64 = rows.to(tl.int64)
    rk = tl.arange(0, BR)
    rank_ok = rk < R
    z = tl.load(z_ptr + rows64[:, None] * z_stride + rk[None, :], mask=row_ok[:, None] & rank_ok[None, :], other=0.0)
    labels = tl.load(labels_ptr + rows, mask=row_ok, other=0)
    cols0 = tl.arange(0, BV)
    m_b = tl.full([BM], float("-inf"), tl.float32)      # per row: running max and sum of exp(. - max), base
    s_b = tl.zeros([BM], tl.float32)
    m_f = tl.full([BM], float("-inf"), tl.float32)      # the same for the corrected logits
    s_f = tl.zeros([BM], tl.float32)
    best = tl.zeros([BM], tl.int32)                     # first index of the largest corrected logit
    at_b = tl.zeros([BM], tl.float32)                   # the logits at the label
    at_f = tl.zeros([BM], tl.float32)
    for start in range(0, V, BV):
        cols = start + cols0
        col_ok = cols < V
        tile = row_ok[:, None] & col_ok[None, :]
        x = tl.load(x_ptr + rows64[:, None] * x_stride + cols[None, :], mask=tile, other=0.0).to(tl.float32)
        w2 = tl.load(w2_ptr + cols.to(tl.int64)[:, None] * w2_stride + rk[None, :],
                     mask=col_ok[:, None] & rank_ok[None, :], other=0.0)
        f = x + tl.dot(z, tl.trans(w2))
        x = tl.where(col_ok[None, :], x, float("-inf"))
        f = tl.where(col_ok[None, :], f, float("-inf"))
        new_m = tl.maximum(m_b, tl.max(x, 1))
        s_b = s_b * tl.exp(m_b - new_m) + tl.sum(tl.exp(x - new_m[:, None]), 1)
        m_b = new_m
        top = tl.max(f, 1)
        best = tl.where(top > m_f, start + tl.argmax(f, 1, tie_break_left=True), best)   # strict: first tile wins
        new_m = tl.maximum(m_f, top)
        s_f = s_f * tl.exp(m_f - new_m) + tl.sum(tl.exp(f - new_m[:, None]), 1)
        m_f = new_m
        hit = cols[None, :] == labels[:, None]
        at_b += tl.sum(tl.where(hit, x, 0.0), 1)
        at_f += tl.sum(tl.where(hit, f, 0.0), 1)
    lse_b = m_b + tl.log(s_b)
    lse_f = m_f + tl.log(s_f)
    tl.store(ce_b_ptr + rows, lse_b - at_b, mask=row_ok)
    tl.store(ce_f_ptr + rows, lse_f - at_f, mask=row_ok)
    tl.store(argmax_ptr + rows, best.to(tl.int64), mask=row_ok)
    if GRAD:
        wf = tl.load(wf_ptr + rows, mask=row_ok, other=0.0)
        wb = tl.load(wb_ptr + rows, mask=row_ok, other=0.0)
        gz = tl.zeros([BM, BR], tl.float32)
        for start in range(0, V, BV):
            cols = start + cols0
            col_ok = cols < V
            tile = row_ok[:, None] & col_ok[None, :]
            x = tl.load(x_ptr + rows64[:, None] * x_stride + cols[None, :], mask=tile, other=0.0).to(tl.float32)
            w2 = tl.load(w2_ptr + cols.to(tl.int64)[:, None] * w2_stride + rk[None, :],
                         mask=col_ok[:, None] & rank_ok[None, :], other=0.0)
            f = x + tl.dot(z, tl.trans(w2))
            one_hot = tl.where(cols[None, :] == labels[:, None], 1.0, 0.0)
            g_f = tl.where(col_ok[None, :], wf[:, None] * (tl.exp(f - lse_f[:, None]) - one_hot), 0.0)
            g_b = wb[:, None] * (tl.exp(x - lse_b[:, None]) - one_hot) + g_f
            g_f = g_f.to(gf_ptr.dtype.element_ty)
            tl.store(x_ptr + rows64[:, None] * x_stride + cols[None, :], g_b.to(x_ptr.dtype.element_ty), mask=tile)
            tl.store(gf_ptr + rows64[:, None] * gf_stride + cols[None, :], g_f, mask=tile)
            gz += tl.dot(g_f, w2.to(g_f.dtype))
        tl.store(gz_ptr + rows64[:, None] * gz_stride + rk[None, :], gz, mask=row_ok[:, None] & rank_ok[None, :])


def pair_cross_entropy_grad(logits: torch.Tensor, z: torch.Tensor, w2: torch.Tensor, labels: torch.Tensor,
                            w_final: torch.Tensor, w_base: torch.Tensor, grad: bool):
    """logits [n, V] (the base logits, rows contiguous), z [n, r], w2 [V, r] (logits' dtype), labels [n] int64,
    w_final and w_base [n] float32 -> (CE(final) [n], CE(base) [n] float32, argmax(final) [n] int64, g_final
    [n, V] in logits' dtype, g_z [n, r] float32); without `grad` the last two are None and logits are left alone,
    with it logits become g_base."""
    n, v = logits.shape
    r = z.shape[1]
    dev = logits.device
    ce_f = torch.empty(n, dtype=torch.float32, device=dev)
    ce_b, argmax = torch.empty_like(ce_f), torch.empty(n, dtype=torch.int64, device=dev)
    g_final = torch.empty_like(logits) if grad else None
    g_z = torch.empty(n, r, dtype=torch.float32, device=dev) if grad else None
    if n:
        pair_ce_kernel[(triton.cdiv(n, BLOCK_ROWS),)](
            logits, logits.stride(0), z, z.stride(0), w2, w2.stride(0),
            g_final if grad else logits, g_final.stride(0) if grad else 0, g_z if grad else ce_f,
            g_z.stride(0) if grad else 0, labels, w_final, w_base, ce_f, ce_b, argmax, n, v, r,
            GRAD=grad, BM=BLOCK_ROWS, BV=BLOCK_COLS, BR=max(16, triton.next_power_of_2(r)), num_warps=NUM_WARPS)
    return ce_f, ce_b, argmax, g_final, g_z
