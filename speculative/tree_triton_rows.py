"""The tree's per-row Triton math and round preparation: the shared @triton.jit device functions (GRU cell,
fixed-order dot products, log-softmax, ranks), the row kernels the reference heap launches once per node, and
`prepare_round`'s candidate pre-selection. speculative.tree_triton's fused frontier build inlines the same
device functions; its docstring states the bit-identity rules they follow.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from speculative.tree import HeadTables, TreeRound

LAUNCH = dict(num_warps=4, enable_fp_fusion=False)
DOT_SPLIT = 16               # interleaved partial sums of every dot product (part of the numbers' definition)
RANK_BLOCK = 32              # entries ranked per step of a rank loop
VOCAB_CHUNK = 1024           # logits per program of the candidate pre-selection (one warp: no shared memory)
MERGE_GROUP = 8              # candidate lists merged per program


def _p2(n: int) -> int:
    return triton.next_power_of_2(max(int(n), 1))


# ---- shared device math -----------------------------------------------------------------------------------

@triton.jit
def _sigmoid(x):
    return 1.0 / (1.0 + tl.exp(-x))


@triton.jit
def _tanh(x):
    return 1.0 - 2.0 / (tl.exp(2.0 * x) + 1.0)


@triton.jit
def _gru(gi_ptr, gh_ptr, h_ptr, G, GP: tl.constexpr, ZERO_STATE: tl.constexpr):
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
    r = _sigmoid(ir + hr)
    z = _sigmoid(iz + hz)
    n = _tanh(i_n + r * h_n)
    return (1.0 - z) * n + z * h


@triton.jit
def _pairwise_rows(acc, LOG_ROWS: tl.constexpr):
    """Sum of the rows of acc [2^LOG_ROWS, C]: row j with row j + half first, then halving again. Each step
    sums an axis of two, a single exact add whatever the layout."""
    for _ in tl.static_range(LOG_ROWS):
        acc = tl.sum(tl.reshape(acc, [2, acc.shape[0] // 2, acc.shape[1]]), 0)
    return tl.reshape(acc, [acc.shape[1]])


@triton.jit
def _pairwise_sum(x, LOG_N: tl.constexpr):
    """Sum of a vector of 2^LOG_N entries in the same halving order."""
    return tl.sum(_pairwise_rows(tl.reshape(x, [x.shape[0], 1]), LOG_N), 0)


@triton.jit
def _matvec(x_ptr, w_ptr, K, stride_k, cols, mask, KT: tl.constexpr, LOG_KT: tl.constexpr):
    """out[c] = sum_k x[k] * w[k * stride_k + cols[c]] in a fixed order: KT partial sums, partial j adding
    k = j, j + KT, j + 2 KT, ... one term at a time, then `_pairwise_rows`. Tiles of KT rows are loaded one
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
    return _pairwise_rows(acc, LOG_KT)


@triton.jit
def _log_softmax(logits, mask, LOG_MP: tl.constexpr):
    """Log-softmax over the valid entries (the exp terms summed by `_pairwise_sum`)."""
    mx = tl.max(tl.where(mask, logits, float("-inf")), 0)
    total = _pairwise_sum(tl.where(mask, tl.exp(logits - mx), 0.0), LOG_MP)
    return logits - (mx + tl.log(total))


@triton.jit
def _child_logp(h_ptr, zproj_ptr, base_cand_ptr, cand_ptr, w1s_t, w2, scratch, G, R, M,
                MP: tl.constexpr, LOG_MP: tl.constexpr, RP: tl.constexpr, KT: tl.constexpr, LOG_KT: tl.constexpr):
    """Corrected log-probs [MP] over one depth's M candidates for a node whose GRU state is at h_ptr:
    log_softmax(base + W2 silu(zproj + W1s h)). scratch: RP floats."""
    r = tl.arange(0, RP)
    rm = r < R
    u = tl.load(zproj_ptr + r, rm, other=0.0) + _matvec(h_ptr, w1s_t, G, R, r, rm, KT, LOG_KT)
    tl.store(scratch + r, u * _sigmoid(u), rm)
    tl.debug_barrier()
    m = tl.arange(0, MP)
    mm = m < M
    cand = tl.load(cand_ptr + m, mm, other=0)
    logits = tl.load(base_cand_ptr + m, mm, other=0.0) + _matvec(scratch, w2, R, 1, cand * R, mm, KT, LOG_KT)
    return _log_softmax(logits, mm, LOG_MP)


@triton.jit
def _ranks(vals_ptr, N, i, NP: tl.constexpr):
    """Positions of entries i in the stable descending order of vals[0:N] (equal values: lower index first)."""
    vi = tl.load(vals_ptr + i, i < N, other=float("-inf"))
    j = tl.arange(0, NP)
    vj = tl.load(vals_ptr + j, j < N, other=float("-inf"))
    ahead = (vj[None, :] > vi[:, None]) | ((vj[None, :] == vi[:, None]) & (j[None, :] < i[:, None]))
    return tl.sum((ahead & (j[None, :] < N)).to(tl.int32), 1)


# ---- row kernels: one node per program (the reference heap and the torch frontier on this path) ------------

def _dot_meta() -> dict:
    return dict(KT=DOT_SPLIT, LOG_KT=DOT_SPLIT.bit_length() - 1)


def _log2(n: int) -> int:
    return n.bit_length() - 1


@triton.jit(do_not_specialize=["depth"])
def _child_logp_kernel(states, rows, cand_ids, base_cand, zproj, w1s_t, w2, scratch, out, depth, D, G, R, M,
                       MP: tl.constexpr, LOG_MP: tl.constexpr, RP: tl.constexpr, KT: tl.constexpr,
                       LOG_KT: tl.constexpr):
    n = tl.program_id(0)
    at = tl.load(rows + n) * D + depth
    logp = _child_logp(states + n * G, zproj + at * R, base_cand + at * M, cand_ids + at * M, w1s_t, w2,
                       scratch + n * RP, G, R, M, MP, LOG_MP, RP, KT, LOG_KT)
    m = tl.arange(0, MP)
    tl.store(out + n * M + m, logp, m < M)


@triton.jit
def _top_children_kernel(logp, out_idx, out_val, M, K, MP: tl.constexpr, BI: tl.constexpr):
    n = tl.program_id(0)
    for i0 in range(0, M, BI):
        i = i0 + tl.arange(0, BI)
        rank = _ranks(logp + n * M, M, i, MP)
        keep = (i < M) & (rank < K)
        tl.store(out_idx + n * K + rank, i.to(tl.int64), keep)
        tl.store(out_val + n * K + rank, tl.load(logp + n * M + i, keep), keep)


@triton.jit
def _hidden_gates_kernel(states, w_hh_t, out, G, GP: tl.constexpr, KT: tl.constexpr, LOG_KT: tl.constexpr):
    n = tl.program_id(0)
    o = tl.arange(0, GP)
    for gate in tl.static_range(3):
        c = gate * G + o
        tl.store(out + n * 3 * G + c, _matvec(states + n * G, w_hh_t, G, 3 * G, c, o < G, KT, LOG_KT), o < G)


@triton.jit(do_not_specialize=["depth"])
def _child_state_kernel(rows, cand, cand_ids, gates, parent_states, parent_gates, out, depth, D, G, M,
                        GP: tl.constexpr):
    n = tl.program_id(0)
    token = tl.load(cand_ids + (tl.load(rows + n) * D + depth) * M + tl.load(cand + n))
    h = _gru(gates + token * 3 * G, parent_gates + n * 3 * G, parent_states + n * G, G, GP, False)
    o = tl.arange(0, GP)
    tl.store(out + n * G + o, h, o < G)


def _rows_launch(kernel, n: int, *args, **meta) -> None:
    if n:
        kernel[(n,)](*args, **meta, **LAUNCH)


def child_logprobs(rnd: TreeRound, rows: Tensor, depth: int, states: Tensor) -> Tensor:
    t, (n, g), (_, d, m) = rnd.tables, states.shape, rnd.cand_ids.shape
    r = t.w2.shape[1]
    out = torch.empty(n, m, dtype=torch.float32, device=states.device)
    scratch = torch.empty(n, _p2(r), dtype=torch.float32, device=states.device)
    _rows_launch(_child_logp_kernel, n, states.contiguous(), rows.contiguous(), rnd.cand_ids, rnd.base_cand,
                 rnd.zproj, t.w1_state_t, t.w2, scratch, out, depth, d, g, r, m, MP=_p2(m), LOG_MP=_log2(_p2(m)),
                 RP=_p2(r), **_dot_meta())
    return out


def top_children(logp: Tensor, k: int) -> tuple[Tensor, Tensor]:
    lead, m = logp.shape[:-1], logp.shape[-1]
    flat = logp.reshape(-1, m).contiguous()
    idx = torch.empty(flat.shape[0], k, dtype=torch.long, device=logp.device)
    val = torch.empty(flat.shape[0], k, dtype=logp.dtype, device=logp.device)
    _rows_launch(_top_children_kernel, flat.shape[0], flat, idx, val, m, k, MP=_p2(m), BI=min(RANK_BLOCK, _p2(m)))
    return idx.view(*lead, k), val.view(*lead, k)


def hidden_gates(tables: HeadTables, states: Tensor) -> Tensor:
    n, g = states.shape
    out = torch.empty(n, 3 * g, dtype=torch.float32, device=states.device)
    _rows_launch(_hidden_gates_kernel, n, states.contiguous(), tables.w_hh_t, out, g, GP=_p2(g), **_dot_meta())
    return out


def child_states(rnd: TreeRound, rows: Tensor, depth: int, cand: Tensor, parent_states: Tensor,
                 parent_gates: Tensor) -> Tensor:
    n, g = parent_states.shape
    out = torch.empty(n, g, dtype=torch.float32, device=parent_states.device)
    _rows_launch(_child_state_kernel, n, rows.contiguous(), cand.contiguous(), rnd.cand_ids, rnd.tables.gates,
                 parent_states.contiguous(), parent_gates.contiguous(), out, depth, rnd.cand_ids.shape[1], g,
                 rnd.cand_ids.shape[2], GP=_p2(g))
    return out


# ---- round preparation: candidates, base log-probs, z projections, root states ---------------------------

@triton.jit
def _vocab_chunk_kernel(base, part_keys, part_max, part_sum, stride_b, stride_s, D, V, NCH,
                        KP: tl.constexpr, CH: tl.constexpr):
    """Program (row, chunk): the chunk's max, sum of exp(x - max), and its KP best candidate keys (order-
    preserving float bits, then the lower index first: unique, so the selection never depends on the layout)."""
    row = tl.program_id(0)
    c = tl.program_id(1)
    idx = c * CH + tl.arange(0, CH)
    ok = idx < V
    x = tl.load(base + (row // D) * stride_b + (row % D) * stride_s + idx, ok, other=float("-inf")).to(tl.float32)
    mx = tl.max(x, 0)
    tl.store(part_max + row * NCH + c, mx)
    tl.store(part_sum + row * NCH + c, tl.sum(tl.exp(x - mx), 0))
    bits = x.to(tl.int32, bitcast=True)
    key = tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits).to(tl.int64) * 16777216 + (V - 1 - idx)
    key = tl.where(ok, key, -(1 << 62))
    tl.store(part_keys + (row * NCH + c) * KP + tl.arange(0, KP), tl.topk(key, KP))


@triton.jit
def _merge_keys_kernel(src, dst, n_lists, KP: tl.constexpr, GROUP: tl.constexpr):
    """Program (row, group): the KP best keys of GROUP consecutive KP-key lists of the row."""
    row = tl.program_id(0)
    grp = tl.program_id(1)
    q = tl.arange(0, GROUP * KP)
    ok = grp * GROUP + q // KP < n_lists
    keys = tl.load(src + (row * n_lists + grp * GROUP) * KP + q, ok, other=-(1 << 62))
    tl.store(dst + (row * tl.num_programs(1) + grp) * KP + tl.arange(0, KP), tl.topk(keys, KP))


@triton.jit
def _round_rows_kernel(base, root_ids, part_keys, n_lists, part_max, part_sum, cand_ids, base_logp,
                       stride_b, stride_s, D, V, M, NCH,
                       hidden, gates, w1h_t, base_cand, zproj, root_state, hidden_b, hidden_s, H, G, R,
                       CORRECTED: tl.constexpr, KP: tl.constexpr, NKP: tl.constexpr, NCHP: tl.constexpr,
                       RP: tl.constexpr, GP: tl.constexpr, KT: tl.constexpr, LOG_KT: tl.constexpr):
    """Program per (request, depth) row: merge the candidate lists and the chunks' log-sum-exp; corrected rounds get
    the row's W1[:, :H] z projection and (depth 0) the request's root GRU state."""
    row = tl.program_id(0)
    b = row // D
    d = row % D
    q = tl.arange(0, NKP)
    top = tl.topk(tl.load(part_keys + row * n_lists * KP + q, q < n_lists * KP, other=-(1 << 62)), KP)
    m = tl.arange(0, KP)
    mm = m < M
    cand = V - 1 - (top & 16777215)
    c = tl.arange(0, NCHP)
    cmax = tl.load(part_max + row * NCH + c, c < NCH, other=float("-inf"))
    mx = tl.max(cmax, 0)
    total = tl.sum(tl.load(part_sum + row * NCH + c, c < NCH, other=0.0) * tl.exp(cmax - mx), 0)
    x = tl.load(base + b * stride_b + d * stride_s + cand, mm, other=0.0).to(tl.float32)
    tl.store(cand_ids + row * M + m, cand, mm)
    tl.store(base_logp + row * M + m, x - (mx + tl.log(total)), mm)
    if CORRECTED:
        tl.store(base_cand + row * M + m, x, mm)
        r = tl.arange(0, RP)
        z = _matvec(hidden + b * hidden_b + d * hidden_s, w1h_t, H, R, r, r < R, KT, LOG_KT)
        tl.store(zproj + row * R + r, z, r < R)
        if d == 0:
            o = tl.arange(0, GP)
            h = _gru(gates + tl.load(root_ids + b) * 3 * G, gates, gates, G, GP, True)
            tl.store(root_state + b * G + o, h, o < G)


def prepare_round(tables, hidden: Tensor, base_logits: Tensor, root_ids: Tensor, depths: int,
                  m: int) -> TreeRound:
    """speculative.tree.prepare_round_with on this path: two launches."""
    b, _, v = base_logits.shape
    if v >= 1 << 24:
        raise ValueError(f"vocabulary {v} too large for 24-bit candidate keys")
    base = base_logits if base_logits.stride(-1) == 1 else base_logits.contiguous()
    dev, f32 = base.device, torch.float32
    kp = _p2(m)
    ch = max(kp, min(VOCAB_CHUNK, _p2(v)))
    nch = triton.cdiv(v, ch)
    rows = b * depths
    part_keys = torch.empty(rows, nch, kp, dtype=torch.long, device=dev)
    part_max, part_sum = torch.empty(2, rows, nch, dtype=f32, device=dev)
    one_warp = dict(LAUNCH, num_warps=1)
    _vocab_chunk_kernel[(rows, nch)](base, part_keys, part_max, part_sum, base.stride(0), base.stride(1),
                                     depths, v, nch, KP=kp, CH=ch, **one_warp)
    keys, lists = part_keys, nch
    while lists > MERGE_GROUP:                            # 48 lists of a 49152 vocabulary -> 6
        merged = torch.empty(rows, triton.cdiv(lists, MERGE_GROUP), kp, dtype=torch.long, device=dev)
        _merge_keys_kernel[(rows, merged.shape[1])](keys, merged, lists, KP=kp, GROUP=MERGE_GROUP, **one_warp)
        keys, lists = merged, merged.shape[1]
    cand_ids = torch.empty(b, depths, m, dtype=torch.long, device=dev)
    base_logp = torch.empty(b, depths, m, dtype=f32, device=dev)
    if tables is None:
        rnd = TreeRound(cand_ids, base_logp)
        g = r = 1
        corrected = (base_logp,) * 6 + (0, 0, 1, 1, 1)       # unused pointers and sizes
    else:
        g, r = tables.w_hh_t.shape[0], tables.w2.shape[1]
        hidden = hidden if hidden.stride(-1) == 1 else hidden.contiguous()
        rnd = TreeRound(cand_ids, base_logp, torch.empty_like(base_logp),
                        torch.empty(b, depths, r, dtype=f32, device=dev), torch.empty(b, g, dtype=f32, device=dev),
                        tables)
        corrected = (hidden, tables.gates, tables.w1_hidden_t, rnd.base_cand, rnd.zproj, rnd.root_state,
                     hidden.stride(0), hidden.stride(1), hidden.shape[-1], g, r)
    _round_rows_kernel[(rows,)](base, root_ids, keys, lists, part_max, part_sum, cand_ids, base_logp,
                                base.stride(0), base.stride(1), depths, v, m, nch, *corrected,
                                CORRECTED=tables is not None, KP=kp, NKP=_p2(lists * kp), NCHP=_p2(nch),
                                RP=_p2(r), GP=_p2(g), **_dot_meta(), **LAUNCH)
    return rnd
