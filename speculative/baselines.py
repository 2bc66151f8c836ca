"""The draft-structure methods behind one builder interface: `builder.build(TreeRound) -> DraftTree`.

  dominotree  best-first tree, children scored by the path-dependent GRU correction (the method)
  chain       Domino's own decoding: one path, each token the best corrected candidate (top-1 children)
  ddtree      best-first tree over the drafter's per-position marginals only (no GRU correction)

All share the candidate restriction (top-M base logits per depth), the same scoring functions and the same
builders, so a comparison changes one thing at a time. The published DDTree expands up to `budget` children
per node; `ddtree_config(node_topk=budget)` gives that, the default matches DominoTree's top-8.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from speculative.draft_tree import DraftTree, TreeConfig, TreeRound
from speculative.tree_gpu import build_frontier
from speculative.tree_reference import build_reference


class TreeBuilder(Protocol):
    cfg: TreeConfig

    def build(self, rnd: TreeRound) -> DraftTree: ...


def dominotree_config(budget: int = 16, node_topk: int = 8, candidates: int = 64, max_depth: int = 16,
                      **extra) -> TreeConfig:
    return TreeConfig(budget=budget, node_topk=node_topk, candidates=candidates, max_depth=max_depth, **extra)


def chain_config(max_depth: int = 16, candidates: int = 64, **extra) -> TreeConfig:
    return TreeConfig(budget=max_depth, node_topk=1, candidates=candidates, max_depth=max_depth, **extra)


def ddtree_config(budget: int = 16, node_topk: int = 8, candidates: int = 64, max_depth: int = 16,
                  **extra) -> TreeConfig:
    return TreeConfig(budget=budget, node_topk=node_topk, candidates=candidates, max_depth=max_depth,
                      corrected=False, **extra)


METHODS = {"dominotree": dominotree_config, "chain": chain_config, "ddtree": ddtree_config}


@dataclass(frozen=True)
class FrontierBuilder:
    cfg: TreeConfig

    def build(self, rnd: TreeRound) -> DraftTree:
        return build_frontier(rnd, self.cfg)


@dataclass(frozen=True)
class ReferenceBuilder:
    cfg: TreeConfig

    def build(self, rnd: TreeRound) -> DraftTree:
        return build_reference(rnd, self.cfg)


def make_builder(method: str, reference: bool = False, **options) -> TreeBuilder:
    """method: dominotree | chain | ddtree; options: that method's config arguments or other TreeConfig fields
    (e.g. uncorrected_depths=0)."""
    if method not in METHODS:
        raise ValueError(f"unknown draft method {method!r}; choose from {sorted(METHODS)}")
    cfg = METHODS[method](**options)
    return ReferenceBuilder(cfg) if reference else FrontierBuilder(cfg)
