"""The draft tree's data types: the builder's configuration, a batch of trees, and one round's scoring inputs.

A batch of trees is a set of tensors over N node slots per request (N = budget): node i has a token, a parent
node (-1: a child of the root, i.e. of the last committed token), a depth (0: child of the root) and a path
score (sum of log-probs along its path). Verification feeds [root, node 0 .. node N-1] to the target.

The math that fills them is speculative.tree (torch) and speculative.kernels (Triton); this module imports
neither.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
from torch import Tensor

from replicas.step_input import DraftRows


@dataclass(frozen=True)
class TreeConfig:
    budget: int = 16              # nodes per request (not counting the root)
    node_topk: int = 8            # children kept per expanded node
    candidates: int = 64          # M: top-M base-logit candidates per depth
    max_depth: int = 16           # <= the drafter's block size
    uncorrected_depths: int = 1   # depths below this score with the base logits (Domino's position 0)
    corrected: bool = True        # False: marginals only (DDTree)

    def __post_init__(self):
        if min(self.budget, self.node_topk, self.candidates, self.max_depth) < 1:
            raise ValueError(f"tree sizes must be positive: {self}")
        if self.node_topk > self.candidates:
            raise ValueError(f"node_topk {self.node_topk} > candidates {self.candidates}")

    @property
    def lanes(self) -> int:
        """Frontier width: a depth never holds more than `budget` useful nodes, nor more than topk^(depth+1)."""
        return min(self.budget, self.node_topk ** min(self.max_depth, 20))


@dataclass
class DraftTree:
    tokens: Tensor     # [B, N] long
    parents: Tensor    # [B, N] long, -1 = child of the root
    depths: Tensor     # [B, N] long, 0 = child of the root
    scores: Tensor     # [B, N] float32 path log-prob, -inf where invalid
    valid: Tensor      # [B, N] bool; invalid slots (budget larger than the tree) have token 0, parent -1
    rows: Optional[DraftRows] = None   # verify_rows() when a builder computed them with the tree (its CUDA graph)

    @property
    def num_nodes(self) -> Tensor:
        return self.valid.sum(1)

    def verify_tokens(self, root_ids: Tensor) -> Tensor:
        """[B, 1+N]: what the target verifies, root first."""
        return torch.cat([root_ids[:, None], self.tokens], 1)

    def position_offsets(self) -> Tensor:
        """[B, 1+N]: position of each verify slot relative to the root (root 0, node depth+1)."""
        return torch.cat([torch.zeros_like(self.depths[:, :1]), self.depths + 1], 1)

    def verify_rows(self) -> DraftRows:
        """What the verify step reads of the trees (replicas.step_input.DraftRows), computed on their device."""
        if self.rows is not None:
            return self.rows
        return DraftRows(self.tokens, self.position_offsets(), self.tree_attention_mask())

    def tree_attention_mask(self) -> Tensor:
        """[B, 1+N, 1+N] bool: slot i may see slot j iff j is i or an ancestor of i (the root is everyone's).
        The tree-masked extend attention's `tree_mask` (the prefix stays visible to all)."""
        b, n = self.tokens.shape
        up = torch.cat([torch.zeros_like(self.parents[:, :1]),
                        torch.where(self.valid, self.parents + 1, 0)], 1)        # parent slot; root -> root
        # the reflexive-transitive closure of the parent links: k squarings of the one-step relation cover paths
        # of 2^k links, and no slot is more than n links below the root; entries stay 0/1 (exact in any float)
        reach = torch.zeros(b, n + 1, n + 1, dtype=torch.float32, device=up.device)
        reach.scatter_(2, up[..., None], 1.0)
        reach.diagonal(dim1=1, dim2=2).fill_(1.0)
        for _ in range((n - 1).bit_length()):
            reach = torch.bmm(reach, reach).clamp_(max=1.0)
        return reach > 0


@dataclass(frozen=True)
class HeadTables:
    """The Domino head's weights as the row math reads them: contiguous, [K, O] for a dot over k, the matrices in
    the head's own dtype (read as float32: exact) and the gate table float32. They depend only on the weights;
    a serving builder computes them once (speculative.tree.head_tables)."""
    gates: Tensor          # [V, 3G] W_ih embed(v): every token's GRU input gates
    w_hh_t: Tensor         # [G, 3G] W_hh^T
    w1_hidden_t: Tensor    # [H, R]  W1[:, :H]^T
    w1_state_t: Tensor     # [G, R]  W1[:, H:]^T
    w2: Tensor             # [V, R]


@dataclass
class TreeRound:
    """Everything a builder reads, computed once per round. D = depths, M = candidates, G = GRU, R = rank."""
    cand_ids: Tensor                     # [B, D, M] candidate tokens, best base logit first
    base_logp: Tensor                    # [B, D, M] float32 full-vocab log-softmax of the base logits
    base_cand: Optional[Tensor] = None   # [B, D, M] float32 base logits at the candidates
    zproj: Optional[Tensor] = None       # [B, D, R] W1[:, :H] z_d
    root_state: Optional[Tensor] = None  # [B, G] GRU state after reading the root token
    tables: Optional[HeadTables] = None

    @property
    def corrected(self) -> bool:
        return self.root_state is not None
