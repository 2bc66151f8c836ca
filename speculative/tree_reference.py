"""Reference DominoTree builder: a best-first heap per request, one node expanded at a time.

Global order of nodes (and so the pop order): higher path score first; on equal scores the shallower node; on
equal score and depth, the node whose parent comes first in this same order, then the lower child rank (rank =
position among its parent's children, best first; equal log-probs rank by lower candidate index). Since a
child never outscores its parent (log-probs are <= 0) and ties put the parent first, popping in this order
enumerates the best nodes of the whole tree; the tree is the first `budget` pops.
"""
from __future__ import annotations

import heapq
import itertools

import torch

from speculative.draft_tree import DraftTree, TreeConfig, TreeRound
from speculative.tree import child_logprobs, child_states, hidden_gates, top_children


@torch.no_grad()
def build_reference(rnd: TreeRound, cfg: TreeConfig) -> DraftTree:
    b, _, _ = rnd.cand_ids.shape
    n = cfg.budget
    dev = rnd.cand_ids.device
    tokens = torch.zeros(b, n, dtype=torch.long, device=dev)
    parents = torch.full((b, n), -1, dtype=torch.long, device=dev)
    depths = torch.zeros(b, n, dtype=torch.long, device=dev)
    scores = torch.full((b, n), float("-inf"), dtype=torch.float32, device=dev)
    for req in range(b):
        for i, (tok, par, dep, score) in enumerate(_build_one(rnd, req, cfg)):
            tokens[req, i], parents[req, i], depths[req, i], scores[req, i] = tok, par, dep, score
    return DraftTree(tokens, parents, depths, scores, scores > float("-inf"))


def _build_one(rnd: TreeRound, req: int, cfg: TreeConfig) -> list[tuple]:
    max_depth = min(cfg.max_depth, rnd.cand_ids.shape[1])
    k = min(cfg.node_topk, rnd.cand_ids.shape[2])
    rows = torch.tensor([req], device=rnd.cand_ids.device)
    with_states = cfg.corrected and rnd.corrected
    heap: list[tuple] = []
    pending: dict[int, tuple] = {}
    uids = itertools.count()

    def push_children(parent: int, parent_key: tuple, parent_score, state, depth: int) -> None:
        corrected = with_states and depth >= cfg.uncorrected_depths
        cand, logp = top_children(child_logprobs(rnd, rows, depth, state, corrected), k)
        child_scores = parent_score + logp                      # float32, the frontier builder's exact add
        gates = hidden_gates(rnd, state) if with_states else None
        for rank, score in enumerate(child_scores[0].tolist()):
            key = (-score, parent_key, rank)
            uid = next(uids)
            heapq.heappush(heap, (-score, depth, key, uid))
            pending[uid] = (parent, depth, cand[0, rank], child_scores[0, rank], state, gates)

    nodes: list[tuple] = []
    root_state = rnd.root_state[req:req + 1] if with_states else None
    push_children(-1, (), torch.zeros((), dtype=torch.float32, device=rows.device), root_state, 0)
    while heap and len(nodes) < cfg.budget:
        _, depth, key, uid = heapq.heappop(heap)
        parent, depth, cand, score, parent_state, parent_gates = pending.pop(uid)
        index = len(nodes)
        nodes.append((int(rnd.cand_ids[req, depth, cand]), parent, depth, float(score)))
        if depth + 1 < max_depth:
            state = (child_states(rnd, rows, depth, cand.view(1), parent_state, parent_gates)
                     if with_states else None)
            push_children(index, key, score, state, depth + 1)
    return nodes
