"""The tree's per-row Triton kernels, one node per program, and their launchers: what speculative.tree's row
functions (child_logprobs, top_children, hidden_gates, child_states) run on the Triton path, so the reference heap
and the torch frontier score nodes with the device math the fused build inlines (tree_ops).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from speculative.draft_tree import HeadTables, TreeRound
from speculative.kernels.tree_ops import (LAUNCH, RANK_BLOCK, child_logp, dot_meta, gru_cell, log2, matvec,
                                          next_pow2, ranks)


@triton.jit(do_not_specialize=["depth"])
def child_logp_kernel(states, rows, cand_ids, base_cand, zproj, w1s_t, w2, scratch, out, depth, D, G, R, M,
                      MP: tl.constexpr, LOG_MP: tl.constexpr, RP: tl.constexpr, KT: tl.constexpr,
                      LOG_KT: tl.constexpr):
    n = tl.program_id(0)
    at = tl.load(rows + n) * D + depth
    logp = child_logp(states + n * G, zproj + at * R, base_cand + at * M, cand_ids + at * M, w1s_t, w2,
                      scratch + n * RP, G, R, M, MP, LOG_MP, RP, KT, LOG_KT)
    m = tl.arange(0, MP)
    tl.store(out + n * M + m, logp, m < M)


@triton.jit
def top_children_kernel(logp, out_idx, out_val, M, K, MP: tl.constexpr, BI: tl.constexpr):
    n = tl.program_id(0)
    for i0 in range(0, M, BI):
        i = i0 + tl.arange(0, BI)
        rank = ranks(logp + n * M, M, i, MP)
        keep = (i < M) & (rank < K)
        tl.store(out_idx + n * K + rank, i.to(tl.int64), keep)
        tl.store(out_val + n * K + rank, tl.load(logp + n * M + i, keep), keep)


@triton.jit
def hidden_gates_kernel(states, w_hh_t, out, G, GP: tl.constexpr, KT: tl.constexpr, LOG_KT: tl.constexpr):
    n = tl.program_id(0)
    o = tl.arange(0, GP)
    for gate in tl.static_range(3):
        c = gate * G + o
        tl.store(out + n * 3 * G + c, matvec(states + n * G, w_hh_t, G, 3 * G, c, o < G, KT, LOG_KT), o < G)


@triton.jit(do_not_specialize=["depth"])
def child_state_kernel(rows, cand, cand_ids, gates, parent_states, parent_gates, out, depth, D, G, M,
                       GP: tl.constexpr):
    n = tl.program_id(0)
    token = tl.load(cand_ids + (tl.load(rows + n) * D + depth) * M + tl.load(cand + n))
    h = gru_cell(gates + token * 3 * G, parent_gates + n * 3 * G, parent_states + n * G, G, GP, False)
    o = tl.arange(0, GP)
    tl.store(out + n * G + o, h, o < G)


def _rows_launch(kernel, n: int, *args, **meta) -> None:
    if n:
        kernel[(n,)](*args, **meta, **LAUNCH)


def child_logprobs(rnd: TreeRound, rows: Tensor, depth: int, states: Tensor) -> Tensor:
    t, (n, g), (_, d, m) = rnd.tables, states.shape, rnd.cand_ids.shape
    r = t.w2.shape[1]
    out = torch.empty(n, m, dtype=torch.float32, device=states.device)
    scratch = torch.empty(n, next_pow2(r), dtype=torch.float32, device=states.device)
    _rows_launch(child_logp_kernel, n, states.contiguous(), rows.contiguous(), rnd.cand_ids, rnd.base_cand,
                 rnd.zproj, t.w1_state_t, t.w2, scratch, out, depth, d, g, r, m, MP=next_pow2(m),
                 LOG_MP=log2(next_pow2(m)), RP=next_pow2(r), **dot_meta())
    return out


def top_children(logp: Tensor, k: int) -> tuple[Tensor, Tensor]:
    lead, m = logp.shape[:-1], logp.shape[-1]
    flat = logp.reshape(-1, m).contiguous()
    idx = torch.empty(flat.shape[0], k, dtype=torch.long, device=logp.device)
    val = torch.empty(flat.shape[0], k, dtype=logp.dtype, device=logp.device)
    _rows_launch(top_children_kernel, flat.shape[0], flat, idx, val, m, k, MP=next_pow2(m),
                 BI=min(RANK_BLOCK, next_pow2(m)))
    return idx.view(*lead, k), val.view(*lead, k)


def hidden_gates(tables: HeadTables, states: Tensor) -> Tensor:
    n, g = states.shape
    out = torch.empty(n, 3 * g, dtype=torch.float32, device=states.device)
    _rows_launch(hidden_gates_kernel, n, states.contiguous(), tables.w_hh_t, out, g, GP=next_pow2(g), **dot_meta())
    return out


def child_states(rnd: TreeRound, rows: Tensor, depth: int, cand: Tensor, parent_states: Tensor,
                 parent_gates: Tensor) -> Tensor:
    n, g = parent_states.shape
    out = torch.empty(n, g, dtype=torch.float32, device=parent_states.device)
    _rows_launch(child_state_kernel, n, rows.contiguous(), cand.contiguous(), rnd.cand_ids, rnd.tables.gates,
                 parent_states.contiguous(), parent_gates.contiguous(), out, depth, rnd.cand_ids.shape[1], g,
                 rnd.cand_ids.shape[2], GP=next_pow2(g))
    return out
