"""The fused frontier build as Triton kernels: the algorithm of speculative.tree_gpu.build_frontier_torch in
depth_count + 1 launches, on the device math of tree_ops (whose docstring states the bit-identity rules).

One `expand_kernel` launch per depth t, program (request, lane j): pick lane j of depth t-1 (the child of rank j
among the previous launch's children, a stable descending order), write its ledger entry, run its GRU step, then
score its children at depth t (correction, log-softmax over the M candidates, top-k). A last `ledger_kernel`
launch per request places the final depth's lanes and picks the best `budget` ledger entries.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from speculative.draft_tree import DraftTree, TreeConfig, TreeRound
from speculative.kernels.tree_ops import (LAUNCH, RANK_BLOCK, child_logp, dot_meta, gru_cell, log2, matvec,
                                          next_pow2, ranks)


@triton.jit(do_not_specialize=["t"])
def expand_kernel(cand_ids, base_logp, base_cand, zproj, root_state, gates, w_hh_t, w1s_t, w2,
                  kid_score, kid_cand, lane_h, lane_gh, lane_score, led_score, led_parent, led_token, scratch,
                  t, D, M, R, G, L, K, uncorrected,
                  WITH_STATES: tl.constexpr, MP: tl.constexpr, LOG_MP: tl.constexpr, RP: tl.constexpr,
                  GP: tl.constexpr, NP: tl.constexpr, BI: tl.constexpr, KT: tl.constexpr, LOG_KT: tl.constexpr):
    """Program (request b, lane j, part) of depth t's launch. Every part picks lane j of depth t-1 and runs its
    GRU step; part 0 records the lane and scores its children at depth t, parts 1..3 compute its hidden gates
    r, z, n for the next launch. Per-lane buffers have two parity slots: this launch writes slot t % 2."""
    b = tl.program_id(0)
    j = tl.program_id(1)
    part = tl.program_id(2)
    B = tl.num_programs(0)
    here = ((t % 2) * B + b) * L + j
    scr = scratch + ((b * L + j) * 4 + part) * (GP + RP + MP)       # [h (GP) | silu(u) (RP) | logp (MP)]
    o = tl.arange(0, GP)
    if t == 0:                                            # the root is the only lane of "depth -1"
        if part == 0:
            tl.store(lane_score + here, 0.0)
        if WITH_STATES:
            h = tl.load(root_state + b * G + o, o < G, other=0.0)
    else:                                                 # lane j of depth t-1: the previous kids' rank j
        lane0 = (((t - 1) % 2) * B + b) * L
        n_kids = tl.where(t == 1, 1, L) * K
        sel = j * 0
        found = j * 0
        for i0 in range(0, n_kids, BI):
            i = i0 + tl.arange(0, BI)
            hit = (ranks(kid_score + lane0 * K, n_kids, i, NP) == j) & (i < n_kids)
            sel += tl.sum(tl.where(hit, i, 0), 0)
            found += tl.sum(hit.to(tl.int32), 0)
        cand = tl.where(found > 0, tl.load(kid_cand + lane0 * K + sel), 0)
        token = tl.load(cand_ids + (b * D + t - 1) * M + cand)
        parent = tl.where(found > 0, sel // K, 0)
        if part == 0:
            score = tl.where(found > 0, tl.load(kid_score + lane0 * K + sel), float("-inf"))
            led = (b * D + t - 1) * L + j
            tl.store(led_score + led, score)
            tl.store(led_parent + led, parent)
            tl.store(led_token + led, token)
            tl.store(lane_score + here, score)
        if WITH_STATES:
            up = lane0 + parent
            h = gru_cell(gates + token * 3 * G, lane_gh + up * 3 * G, lane_h + up * G, G, GP, False)
    if WITH_STATES:
        tl.store(scr + o, h, o < G)
        if part == 0:
            tl.store(lane_h + here * G + o, h, o < G)
    tl.debug_barrier()
    if part > 0:                                          # hidden gate part-1 of this lane
        c = (part - 1) * G + o
        tl.store(lane_gh + here * 3 * G + c, matvec(scr, w_hh_t, G, 3 * G, c, o < G, KT, LOG_KT), o < G)
    else:
        at = b * D + t
        m = tl.arange(0, MP)
        if t >= uncorrected:
            logp = child_logp(scr, zproj + at * R, base_cand + at * M, cand_ids + at * M, w1s_t, w2, scr + GP,
                               G, R, M, MP, LOG_MP, RP, KT, LOG_KT)
        else:
            logp = tl.load(base_logp + at * M + m, m < M, other=0.0)
        logp_at = scr + GP + RP
        tl.store(logp_at + m, logp, m < M)
        tl.debug_barrier()
        score = tl.load(lane_score + here)
        for i0 in range(0, M, BI):                        # top-k children, in rank order
            i = i0 + tl.arange(0, BI)
            rank = ranks(logp_at, M, i, MP)
            keep = (i < M) & (rank < K)
            kid = tl.where(score > float("-inf"), score + tl.load(logp_at + i, keep, other=0.0), float("-inf"))
            tl.store(kid_score + here * K + rank, kid, keep)
            tl.store(kid_cand + here * K + rank, i, keep)


@triton.jit
def ledger_kernel(cand_ids, kid_score, kid_cand, led_score, led_parent, led_token, pos,
                  tokens, parents, depths, scores, valid, D, M, L, K, N_OUT,
                  NP: tl.constexpr, EP: tl.constexpr, BI: tl.constexpr):
    """Program per request: the last depth's lanes, then the best N_OUT ledger entries in ledger order."""
    b = tl.program_id(0)
    B = tl.num_programs(0)
    d = D - 1
    kids = kid_score + ((d % 2) * B + b) * L * K
    n_kids = tl.where(d == 0, 1, L) * K
    last = (b * D + d) * L
    for i0 in range(0, n_kids, BI):
        i = i0 + tl.arange(0, BI)
        rank = ranks(kids, n_kids, i, NP)
        keep = (i < n_kids) & (rank < L)
        cand = tl.load(kid_cand + ((d % 2) * B + b) * L * K + i, keep, other=0)
        tl.store(led_score + last + rank, tl.load(kids + i, keep), keep)
        tl.store(led_parent + last + rank, i // K, keep)
        tl.store(led_token + last + rank, tl.load(cand_ids + (b * D + d) * M + cand, keep), keep)
    for r0 in range(n_kids, L, BI):                       # fewer children than lanes: empty lanes
        r = r0 + tl.arange(0, BI)
        tl.store(led_score + last + r, tl.full([BI], float("-inf"), tl.float32), r < L)
        tl.store(led_parent + last + r, r * 0, r < L)
        tl.store(led_token + last + r, tl.load(cand_ids + (b * D + d) * M + r * 0), r < L)
    tl.debug_barrier()
    E = D * L
    ledger = led_score + b * E
    for e0 in range(0, E, BI):
        e = e0 + tl.arange(0, BI)
        tl.store(pos + b * E + e, ranks(ledger, E, e, EP), e < E)
    tl.debug_barrier()
    for e0 in range(0, E, BI):
        e = e0 + tl.arange(0, BI)
        at = tl.load(pos + b * E + e, e < E, other=N_OUT)
        keep = (e < E) & (at < N_OUT)
        sc = tl.load(ledger + e, keep, other=float("-inf"))
        ok = sc > float("-inf")
        depth = e // L
        up = (depth - 1) * L + tl.load(led_parent + b * E + e, keep, other=0)
        par = tl.load(pos + b * E + up, keep & (depth > 0), other=-1)
        out = b * N_OUT + at
        tl.store(tokens + out, tl.where(ok, tl.load(led_token + b * E + e, keep, other=0), 0), keep)
        tl.store(parents + out, tl.where(ok & (depth > 0), par, -1).to(tl.int64), keep)
        tl.store(depths + out, tl.where(ok, depth, 0).to(tl.int64), keep)
        tl.store(scores + out, sc, keep)
        tl.store(valid + out, ok, keep)
    for s0 in range(E, N_OUT, BI):                        # a budget beyond the whole tree: empty slots
        s = s0 + tl.arange(0, BI)
        keep = s < N_OUT
        tl.store(tokens + b * N_OUT + s, (s * 0).to(tl.int64), keep)
        tl.store(parents + b * N_OUT + s, (s * 0 - 1).to(tl.int64), keep)
        tl.store(depths + b * N_OUT + s, (s * 0).to(tl.int64), keep)
        tl.store(scores + b * N_OUT + s, tl.full([BI], float("-inf"), tl.float32), keep)
        tl.store(valid + b * N_OUT + s, s < 0, keep)


def empty_tree(batch: int, budget: int, device) -> DraftTree:
    long = dict(dtype=torch.long, device=device)
    return DraftTree(torch.empty(batch, budget, **long), torch.empty(batch, budget, **long),
                     torch.empty(batch, budget, **long), torch.empty(batch, budget, dtype=torch.float32, device=device),
                     torch.empty(batch, budget, dtype=torch.bool, device=device))


def build_fused(rnd: TreeRound, cfg: TreeConfig, out: DraftTree | None = None) -> DraftTree:
    """The frontier build as depth_count + 1 launches, written into `out` (fresh tensors if None)."""
    b, depth_count, m = rnd.cand_ids.shape
    depth_count = min(cfg.max_depth, depth_count)
    k, lanes, dev = min(cfg.node_topk, m), cfg.lanes, rnd.cand_ids.device
    with_states = cfg.corrected and rnd.corrected
    f32 = dict(dtype=torch.float32, device=dev)
    g, r = (rnd.root_state.shape[1], rnd.tables.w2.shape[1]) if with_states else (1, 1)
    mp, rp, gp = next_pow2(m), next_pow2(r), next_pow2(g)
    kid_score = torch.empty(2, b, lanes, k, **f32)
    kid_cand = torch.empty(2, b, lanes, k, dtype=torch.int32, device=dev)
    lane_h, lane_gh = torch.empty(2, b, lanes, g, **f32), torch.empty(2, b, lanes, 3 * g, **f32)
    lane_score = torch.empty(2, b, lanes, **f32)
    led_score = torch.empty(b, depth_count, lanes, **f32)
    led_parent = torch.empty(b, depth_count, lanes, dtype=torch.int32, device=dev)
    led_token = torch.empty(b, depth_count, lanes, dtype=torch.long, device=dev)
    scratch = torch.empty(b, lanes, 4, gp + rp + mp, **f32)
    pos = torch.empty(b, depth_count * lanes, dtype=torch.int32, device=dev)
    out = empty_tree(b, cfg.budget, dev) if out is None else out
    if with_states:
        t = rnd.tables
        corr = (rnd.base_cand, rnd.zproj, rnd.root_state, t.gates, t.w_hh_t, t.w1_state_t, t.w2)
    else:
        corr = (rnd.base_logp,) * 7                       # never read
    uncorrected = cfg.uncorrected_depths if with_states else depth_count
    np_ = next_pow2(lanes * k)
    meta = dict(WITH_STATES=with_states, MP=mp, LOG_MP=log2(mp), RP=rp, GP=gp, NP=np_,
                BI=min(RANK_BLOCK, np_, mp), **dot_meta(), **LAUNCH)
    for depth in range(depth_count):
        parts = 4 if with_states and depth + 1 < depth_count else 1
        expand_kernel[(b, 1 if depth == 0 else lanes, parts)](
            rnd.cand_ids, rnd.base_logp, *corr, kid_score, kid_cand, lane_h, lane_gh, lane_score, led_score,
            led_parent, led_token, scratch, depth, depth_count, m, r, g, lanes, k, uncorrected, **meta)
    ledger_kernel[(b,)](rnd.cand_ids, kid_score, kid_cand, led_score, led_parent, led_token, pos, out.tokens,
                        out.parents, out.depths, out.scores, out.valid, depth_count, m, lanes, k, cfg.budget,
                        NP=np_, EP=next_pow2(depth_count * lanes), BI=min(RANK_BLOCK, np_), **LAUNCH)
    return out
