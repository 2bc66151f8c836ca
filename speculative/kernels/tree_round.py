"""A round's preparation as Triton kernels: each (request, depth) row's top-M candidates of the base logits,
their full-vocabulary log-probs, and for corrected rounds the W1[:, :H] z projections and the root GRU states.
speculative.tree.prepare_round_with runs `prepare_round` on the Triton path.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from speculative.draft_tree import HeadTables, TreeRound
from speculative.kernels.tree_ops import LAUNCH, MERGE_GROUP, VOCAB_CHUNK, dot_meta, gru_cell, matvec, next_pow2


@triton.jit
def vocab_chunk_kernel(base, part_keys, part_max, part_sum, stride_b, stride_s, D, V, NCH,
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
def merge_keys_kernel(src, dst, n_lists, KP: tl.constexpr, GROUP: tl.constexpr):
    """Program (row, group): the KP best keys of GROUP consecutive KP-key lists of the row."""
    row = tl.program_id(0)
    grp = tl.program_id(1)
    q = tl.arange(0, GROUP * KP)
    ok = grp * GROUP + q // KP < n_lists
    keys = tl.load(src + (row * n_lists + grp * GROUP) * KP + q, ok, other=-(1 << 62))
    tl.store(dst + (row * tl.num_programs(1) + grp) * KP + tl.arange(0, KP), tl.topk(keys, KP))


@triton.jit
def round_rows_kernel(base, root_ids, part_keys, n_lists, part_max, part_sum, cand_ids, base_logp,
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
        z = matvec(hidden + b * hidden_b + d * hidden_s, w1h_t, H, R, r, r < R, KT, LOG_KT)
        tl.store(zproj + row * R + r, z, r < R)
        if d == 0:
            o = tl.arange(0, GP)
            h = gru_cell(gates + tl.load(root_ids + b) * 3 * G, gates, gates, G, GP, True)
            tl.store(root_state + b * G + o, h, o < G)


def prepare_round(tables: HeadTables | None, hidden: Tensor, base_logits: Tensor, root_ids: Tensor, depths: int,
                  m: int) -> TreeRound:
    """speculative.tree.prepare_round_with on this path: two launches."""
    b, _, v = base_logits.shape
    if v >= 1 << 24:
        raise ValueError(f"vocabulary {v} too large for 24-bit candidate keys")
    base = base_logits if base_logits.stride(-1) == 1 else base_logits.contiguous()
    dev, f32 = base.device, torch.float32
    kp = next_pow2(m)
    ch = max(kp, min(VOCAB_CHUNK, next_pow2(v)))
    nch = triton.cdiv(v, ch)
    rows = b * depths
    part_keys = torch.empty(rows, nch, kp, dtype=torch.long, device=dev)
    part_max, part_sum = torch.empty(2, rows, nch, dtype=f32, device=dev)
    one_warp = dict(LAUNCH, num_warps=1)
    vocab_chunk_kernel[(rows, nch)](base, part_keys, part_max, part_sum, base.stride(0), base.stride(1),
                                    depths, v, nch, KP=kp, CH=ch, **one_warp)
    keys, lists = part_keys, nch
    while lists > MERGE_GROUP:
        merged = torch.empty(rows, triton.cdiv(lists, MERGE_GROUP), kp, dtype=torch.long, device=dev)
        merge_keys_kernel[(rows, merged.shape[1])](keys, merged, lists, KP=kp, GROUP=MERGE_GROUP, **one_warp)
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
    round_rows_kernel[(rows,)](base, root_ids, keys, lists, part_max, part_sum, cand_ids, base_logp,
                               base.stride(0), base.stride(1), depths, v, m, nch, *corrected,
                               CORRECTED=tables is not None, KP=kp, NKP=next_pow2(lists * kp),
                               NCHP=next_pow2(nch), RP=next_pow2(r), GP=next_pow2(g), **dot_meta(), **LAUNCH)
    return rnd
