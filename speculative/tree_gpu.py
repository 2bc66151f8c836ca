"""Batched frontier DominoTree builders: whole batch at once, fixed shapes, no host sync, CUDA-graph capturable.

Per depth d it keeps L = `cfg.lanes` lanes per request: every lane of depth d-1 is expanded into its top-k
children (scored by the shared row functions of speculative.tree), the P*k candidates are ordered by one stable
descending sort of their scores, laid out as [parent lane, child rank], and the first L become depth d's lanes.
The ledger (all depths' lanes, depth-major) is then stably sorted once by score and its first `budget` entries
are the tree.

Why this equals the reference heap: its order is (score desc, depth, parent's order, child rank). Within a depth
the stable sort over [parent lane, rank] realises exactly that order; across depths the depth-major ledger and
a stable sort put the shallower node first on ties. A node among the best `budget` of the whole tree has fewer
than `budget` better nodes, all of whose ancestors are better still; by induction its parent is a kept lane,
and fewer than L nodes of its depth beat it, so it is a kept lane too. So the ledger holds the best `budget`
nodes, in the heap's order, and their scores are bit-identical (same row functions, same float32 adds).

Two builds of that algorithm: `build_frontier_torch` (torch ops, ~45 small kernels per depth) and
speculative.kernels.tree_fused.build_fused (one launch per depth plus one for the ledger), which `build_frontier`
picks wherever the row math runs on Triton (CUDA).
"""
from __future__ import annotations

from dataclasses import replace
from typing import Optional, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

from replicas.step_input import DraftRows
from speculative.draft_tree import DraftTree, TreeConfig, TreeRound
from speculative.tree import (child_logprobs, child_states, head_tables, hidden_gates, on_triton, prepare_round_with,
                              top_children)

NEG_INF = float("-inf")


def build_frontier(rnd: TreeRound, cfg: TreeConfig, out: Optional[DraftTree] = None) -> DraftTree:
    """The batched builder: fused Triton launches where the row math runs on Triton, torch ops elsewhere; written
    into `out`'s five fields when given."""
    if on_triton(rnd.cand_ids):
        from speculative.kernels.tree_fused import build_fused
        return build_fused(rnd, cfg, out)
    tree = build_frontier_torch(rnd, cfg)
    if out is None:
        return tree
    for f, _ in _FIELDS:
        getattr(out, f).copy_(getattr(tree, f))
    return out


@torch.no_grad()
def build_frontier_torch(rnd: TreeRound, cfg: TreeConfig) -> DraftTree:
    b, depth_count, m = rnd.cand_ids.shape
    depth_count = min(cfg.max_depth, depth_count)
    k, lanes = min(cfg.node_topk, m), cfg.lanes
    dev = rnd.cand_ids.device
    with_states = cfg.corrected and rnd.corrected
    state = rnd.root_state[:, None] if with_states else None        # [B, P, G]; P = 1 parent (the root)
    score = torch.zeros(b, 1, dtype=torch.float32, device=dev)
    alive = torch.ones(b, 1, dtype=torch.bool, device=dev)
    led_score, led_parent, led_token = [], [], []
    for depth in range(depth_count):
        p = score.shape[1]
        rows = torch.arange(b, device=dev).repeat_interleave(p)
        flat_state = state.reshape(b * p, -1) if with_states else None
        corrected = with_states and depth >= cfg.uncorrected_depths
        cand, logp = top_children(child_logprobs(rnd, rows, depth, flat_state, corrected), k)
        child = torch.where(alive[..., None], score[..., None] + logp.view(b, p, k), NEG_INF).view(b, p * k)
        order = torch.sort(child, dim=1, descending=True, stable=True).indices[:, :lanes]
        pad = lanes - order.shape[1]
        lane_score = F.pad(child.gather(1, order), (0, pad), value=NEG_INF)
        lane_parent = F.pad(order // k, (0, pad))
        lane_cand = F.pad(cand.reshape(b, p * k).gather(1, order), (0, pad))
        led_score.append(lane_score)
        led_parent.append(lane_parent)
        led_token.append(rnd.cand_ids[:, depth].gather(1, lane_cand))
        if with_states and depth + 1 < depth_count:
            gates = hidden_gates(rnd, flat_state).view(b, p, -1)
            pick = lane_parent[..., None]
            par_state = state.gather(1, pick.expand(-1, -1, state.shape[-1])).reshape(b * lanes, -1)
            par_gates = gates.gather(1, pick.expand(-1, -1, gates.shape[-1])).reshape(b * lanes, -1)
            lane_rows = torch.arange(b, device=dev).repeat_interleave(lanes)
            state = child_states(rnd, lane_rows, depth, lane_cand.reshape(-1), par_state, par_gates).view(b, lanes, -1)
        score, alive = lane_score, lane_score > NEG_INF
    return _pick_from_ledger(torch.stack(led_score, 1), torch.stack(led_parent, 1), torch.stack(led_token, 1),
                             cfg.budget)


def _pick_from_ledger(score: Tensor, parent_lane: Tensor, token: Tensor, budget: int) -> DraftTree:
    """score/parent_lane/token [B, D, L] -> the best `budget` entries as a DraftTree, parents before children."""
    b, d, lanes = score.shape
    flat = score.reshape(b, d * lanes)
    order = torch.sort(flat, dim=1, descending=True, stable=True).indices[:, :budget]
    n = order.shape[1]
    node_score = flat.gather(1, order)
    node_depth = order // lanes
    parent_entry = (node_depth - 1) * lanes + parent_lane.reshape(b, -1).gather(1, order)
    position = torch.full((b, d * lanes), -1, dtype=torch.long, device=flat.device)
    position.scatter_(1, order, torch.arange(n, device=flat.device).expand(b, n))
    valid = node_score > NEG_INF
    parents = torch.where(node_depth > 0, position.gather(1, parent_entry.clamp(min=0)), -1)
    tree = DraftTree(torch.where(valid, token.reshape(b, -1).gather(1, order), 0), torch.where(valid, parents, -1),
                     torch.where(valid, node_depth, 0), node_score, valid)
    if n < budget:
        extra = budget - n
        tree = DraftTree(F.pad(tree.tokens, (0, extra)), F.pad(tree.parents, (0, extra), value=-1),
                         F.pad(tree.depths, (0, extra)), F.pad(tree.scores, (0, extra), value=NEG_INF),
                         F.pad(tree.valid, (0, extra)))
    return tree


_FIELDS = (("tokens", torch.long), ("parents", torch.long), ("depths", torch.long), ("scores", torch.float32),
           ("valid", torch.bool))


def _layout(batch: int, budget: int) -> list[tuple[str, torch.dtype, tuple[int, ...]]]:
    """The packed buffer: the tree's five [batch, budget] fields and its verify rows' offsets [batch, 1+budget] and
    mask [batch, 1+budget, 1+budget], widest element first so that every view starts aligned."""
    w = 1 + budget
    fields = [(f, dtype, (batch, budget)) for f, dtype in _FIELDS] + [("offsets", torch.long, (batch, w)),
                                                                     ("mask", torch.bool, (batch, w, w))]
    return sorted(fields, key=lambda field: -torch.empty((), dtype=field[1]).element_size())


def _packed_views(packed: Tensor, batch: int, budget: int) -> DraftTree:
    """A DraftTree, its verify rows included, whose fields are consecutive slices of one byte buffer."""
    views, at = {}, 0
    for name, dtype, shape in _layout(batch, budget):
        size = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
        views[name] = packed[at:at + size].view(dtype).view(shape)
        at += size
    return DraftTree(*(views[f] for f, _ in _FIELDS),
                     rows=DraftRows(views["tokens"], views["offsets"], views["mask"]))


def _packed_bytes(batch: int, budget: int) -> int:
    return sum(torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
               for _, dtype, shape in _layout(batch, budget))


def _columns(tree: DraftTree) -> list[Tensor]:
    """The batch-major tensors of packed views: the tree's fields, then its rows' offsets and mask."""
    return [getattr(tree, f) for f, _ in _FIELDS] + [tree.rows.offsets, tree.rows.mask]


def _first(tree: DraftTree, b: int) -> DraftTree:
    """The first b trees of packed views, their rows included."""
    rows = tree.rows
    return DraftTree(*(getattr(tree, f)[:b] for f, _ in _FIELDS),
                     rows=DraftRows(rows.tokens[:b], rows.offsets[:b], rows.mask[:b]))


class GraphTreeBuilder:
    """prepare_round + build_frontier for one draft block, replayed from a CUDA graph per batch-size bucket.

    Inputs are copied into static buffers (rows past the batch keep stale data: requests never mix, and every
    row's computation is batch-invariant, so padding changes no bit), the bucket's graph replays and writes the
    tree and its verify rows (DraftTree.verify_rows: offsets and masks) into one packed buffer, and one copy
    clones it. A batch above the largest bucket runs in slices of it. Off CUDA the same body runs eagerly. The
    head's tables (gate table included) are computed once here; recreate the builder if the drafter's weights
    change.
    """

    def __init__(self, head, embed_weight: Tensor, cfg: TreeConfig, block_size: int, vocab_size: int,
                 hidden_size: int, dtype: torch.dtype, batch_sizes: Sequence[int] = (1, 2, 4, 8, 16, 32),
                 use_graphs: Optional[bool] = None, gates: Optional[Tensor] = None, pool=None):
        """gates: `gate_table(head, embed_weight)` when the caller already has it; pool: a graph memory pool
        shared with builders that never run at the same time (outputs are cloned right after each replay)."""
        self.cfg, self.pool = cfg, pool
        self.device = embed_weight.device
        self.tables = head_tables(head, embed_weight, gates) if cfg.corrected else None
        self.buckets = sorted(set(batch_sizes))
        self.use_graphs = self.device.type == "cuda" if use_graphs is None else use_graphs
        top = self.buckets[-1]
        self.hidden = torch.zeros(top, block_size, hidden_size, dtype=dtype, device=self.device)
        self.base_logits = torch.zeros(top, block_size, vocab_size, dtype=dtype, device=self.device)
        self.root_ids = torch.zeros(top, dtype=torch.long, device=self.device)
        self.packed = torch.zeros(_packed_bytes(top, cfg.budget), dtype=torch.uint8, device=self.device)
        self.out = _packed_views(self.packed, top, cfg.budget)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        if self.use_graphs:
            self._capture()

    @property
    def gates(self) -> Optional[Tensor]:
        """The gate table the builder reads (the caller's when it passed one)."""
        return self.tables.gates if self.tables is not None else None

    def _body(self, bs: int) -> None:
        rnd = prepare_round_with(self.tables, self.hidden[:bs], self.base_logits[:bs], self.root_ids[:bs], self.cfg)
        out = build_frontier(rnd, self.cfg, _first(self.out, bs))
        rows = replace(out, rows=None).verify_rows()            # computed from the fields just written
        out.rows.offsets.copy_(rows.offsets)
        out.rows.mask.copy_(rows.mask)

    @torch.no_grad()
    def _capture(self) -> None:
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            for bs in self.buckets:
                self._body(bs)
        torch.cuda.current_stream(self.device).wait_stream(side)
        pool = self.pool if self.pool is not None else torch.cuda.graph_pool_handle()
        for bs in reversed(self.buckets):
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self._body(bs)
            self.graphs[bs] = graph
        torch.cuda.synchronize(self.device)

    def _run(self, hidden: Tensor, base_logits: Tensor, root_ids: Tensor) -> None:
        b = root_ids.shape[0]
        self.hidden[:b].copy_(hidden)
        self.base_logits[:b].copy_(base_logits)
        self.root_ids[:b].copy_(root_ids)
        bucket = next(bs for bs in self.buckets if bs >= b)
        if self.use_graphs:
            self.graphs[bucket].replay()
        else:
            self._body(bucket)

    @torch.no_grad()
    def build(self, hidden: Tensor, base_logits: Tensor, root_ids: Tensor) -> DraftTree:
        """The trees of this batch, their verify rows (`rows`) computed with them."""
        b, top, n = root_ids.shape[0], self.buckets[-1], self.cfg.budget
        if b <= top:
            self._run(hidden, base_logits, root_ids)
            return _first(_packed_views(self.packed.clone(), top, n), b)
        packed = torch.empty(_packed_bytes(b, n), dtype=torch.uint8, device=self.device)
        tree = _packed_views(packed, b, n)
        for start in range(0, b, top):
            stop = min(b, start + top)
            self._run(hidden[start:stop], base_logits[start:stop], root_ids[start:stop])
            for mine, built in zip(_columns(tree), _columns(self.out)):
                mine[start:stop].copy_(built[:stop - start])
        return tree
