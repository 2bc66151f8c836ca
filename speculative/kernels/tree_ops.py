"""The tree builder's shared @triton.jit device math (GRU cell, fixed-order dot products, log-softmax, ranks)
and the launch constants every tree kernel uses.

Bit-identity: on the Triton path every number a builder compares comes from the device functions below. The
reference heap launches the row kernels (tree_rows) once per node, the fused build (tree_fused) runs a whole
frontier per launch; both inline the same functions on the same inputs. A function's result never depends on
the kernel it is inlined in: dot products and candidate sums add one term at a time in ascending index,
elementwise over the outputs (no tl.sum, whose order follows the compiler's layout), maxima and comparisons are
exact, and every launch passes enable_fp_fusion=False so no a*b+c becomes an FMA. exp/log are Triton's, so this
path's bits differ from the torch path's; each path is only compared with itself. Reductions that only the
round preparation computes (the vocab log-sum-exp, tree_round) may use tl.sum: one kernel computes them for
both builders, one program per row.
"""
from __future__ import annotations

import triton
import triton.language as tl

LAUNCH = dict(num_warps=4, enable_fp_fusion=False)
DOT_SPLIT = 16               # interleaved partial sums of every dot product (part of the numbers' definition)
RANK_BLOCK = 32              # entries ranked per step of a rank loop
VOCAB_CHUNK = 1024           # logits per program of the candidate pre-selection (one warp: no shared memory)
MERGE_GROUP = 8              # candidate lists merged per program


def next_pow2(n: int) -> int:
    return triton.next_power_of_2(max(int(n), 1))


def log2(n: int) -> int:
    return n.bit_length() - 1


def dot_meta() -> dict:
    """The constexprs of `matvec`'s fixed summation order."""
    return dict(KT=DOT_SPLIT, LOG_KT=DOT_SPLIT.bit_length() - 1)


@triton.jit
def sigmoid(x):
    return 1.0 / (1.0 + tl.exp(-x))


@triton.jit
def tanh(x):
    return 1.0 - 2.0 / (tl.exp(2.0 * x) + 1.0)


@triton.jit
def gru_cell(gi_ptr, gh_ptr, h_ptr, G, GP: tl.constexpr, ZERO_STATE: tl.constexpr):
    """torch.nn.GRU's cell (gates r, z, n; no bias) from W_ih x [3G] and W_hh h [3G] in memory -> h' [GP]."""
    o = tl.arange(0, GP)
    m = o < G
    ir = tl.load(gi_ptr + o, m, other=0.0)
    iz = tl.load(gi_ptr + G + o, m, other=0.0)
    i_n = tl.load(gi_ptr + 2 * G + o, m, other=0.0)
    if ZERO_STATE:
        hr = tl.zeros([GP], tl.float32)
        hz, h_n, h = hr, hr, hr
    else:
        hr = tl.load(gh_ptr + o, m, other=0.0)
        hz = tl.load(gh_ptr + G + o, m, other=0.0)
        h_n = tl.load(gh_ptr + 2 * G + o, m, other=0.0)
        h = tl.load(h_ptr + o, m, other=0.0)
    r = sigmoid(ir + hr)
    z = sigmoid(iz + hz)
    n = tanh(i_n + r * h_n)
    return (1.0 - z) * n + z * h


@triton.jit
def pairwise_rows(acc, LOG_ROWS: tl.constexpr):
    """Sum of the rows of acc [2^LOG_ROWS, C]: row j with row j + half first, then halving again. Each step
    sums an axis of two, a single exact add whatever the layout."""
    for _ in tl.static_range(LOG_ROWS):
        acc = tl.sum(tl.reshape(acc, [2, acc.shape[0] // 2, acc.shape[1]]), 0)
    return tl.reshape(acc, [acc.shape[1]])


@triton.jit
def pairwise_sum(x, LOG_N: tl.constexpr):
    """Sum of a vector of 2^LOG_N entries in the same halving order."""
    return tl.sum(pairwise_rows(tl.reshape(x, [x.shape[0], 1]), LOG_N), 0)


@triton.jit
def matvec(x_ptr, w_ptr, K, stride_k, cols, mask, KT: tl.constexpr, LOG_KT: tl.constexpr):
    """out[c] = sum_k x[k] * w[k * stride_k + cols[c]] in a fixed order: KT partial sums, partial j adding
    k = j, j + KT, j + 2 KT, ... one term at a time, then `pairwise_rows`. Tiles of KT rows are loaded one
    ahead of their use, so a program keeps a tile in flight while it multiplies the previous one."""
    k = tl.arange(0, KT)[:, None]
    acc = tl.zeros([KT, cols.shape[0]], tl.float32)
    x = tl.load(x_ptr + k, k < K, other=0.0).to(tl.float32)
    w = tl.load(w_ptr + k * stride_k + cols[None, :], (k < K) & mask[None, :], other=0.0).to(tl.float32)
    for k0 in range(KT, K + KT, KT):
        kk = k0 + k
        x_next = tl.load(x_ptr + kk, kk < K, other=0.0).to(tl.float32)
        w_next = tl.load(w_ptr + kk * stride_k + cols[None, :], (kk < K) & mask[None, :], other=0.0).to(tl.float32)
        acc = acc + x * w
        x, w = x_next, w_next
    return pairwise_rows(acc, LOG_KT)


@triton.jit
def log_softmax(logits, mask, LOG_MP: tl.constexpr):
    """Log-softmax over the valid entries (the exp terms summed by `pairwise_sum`)."""
    mx = tl.max(tl.where(mask, logits, float("-inf")), 0)
    total = pairwise_sum(tl.where(mask, tl.exp(logits - mx), 0.0), LOG_MP)
    return logits - (mx + tl.log(total))


@triton.jit
def child_logp(h_ptr, zproj_ptr, base_cand_ptr, cand_ptr, w1s_t, w2, scratch, G, R, M,
               MP: tl.constexpr, LOG_MP: tl.constexpr, RP: tl.constexpr, KT: tl.constexpr, LOG_KT: tl.constexpr):
    """Corrected log-probs [MP] over one depth's M candidates for a node whose GRU state is at h_ptr:
    log_softmax(base + W2 silu(zproj + W1s h)). scratch: RP floats."""
    r = tl.arange(0, RP)
    rm = r < R
    u = tl.load(zproj_ptr + r, rm, other=0.0) + matvec(h_ptr, w1s_t, G, R, r, rm, KT, LOG_KT)
    tl.store(scratch + r, u * sigmoid(u), rm)
    tl.debug_barrier()
    m = tl.arange(0, MP)
    mm = m < M
    cand = tl.load(cand_ptr + m, mm, other=0)
    logits = tl.load(base_cand_ptr + m, mm, other=0.0) + matvec(scratch, w2, R, 1, cand * R, mm, KT, LOG_KT)
    return log_softmax(logits, mm, LOG_MP)


@triton.jit
def ranks(vals_ptr, N, i, NP: tl.constexpr):
    """Positions of entries i in the stable descending order of vals[0:N] (equal values: lower index first)."""
    vi = tl.load(vals_ptr + i, i < N, other=float("-inf"))
    j = tl.arange(0, NP)
    vj = tl.load(vals_ptr + j, j < N, other=float("-inf"))
    ahead = (vj[None, :] > vi[:, None]) | ((vj[None, :] == vi[:, None]) & (j[None, :] < i[:, None]))
    return tl.sum((ahead & (j[None, :] < N)).to(tl.int32), 1)
