"""Draft trees and the per-node scoring both tree builders share.

A batch of trees is a set of tensors over N node slots per request (N = budget): node i has a token, a parent
node (-1: a child of the root, i.e. of the last committed token), a depth (0: child of the root) and a path
score (sum of log-probs along its path). Verification feeds [root, node 0 .. node N-1] to the target.

Scoring (DominoTree): at depth d the candidates are the top-M tokens of the base logits of slot d. A node's
children come from a distribution over those M candidates: at depths below `uncorrected_depths` (and always in
the DDTree mode) the base logits' full-vocabulary log-softmax at the candidates (path-independent); deeper, the
log-softmax over the M candidates of base + W2 SiLU(W1 [z_d; s]), s = the GRU state of the node's own path.

Bit-identity between the reference heap and the batched frontier builders: every number a builder compares is
produced by the functions below, row by row, from tensors computed once per round (`prepare_round`). Those
functions avoid kernels whose per-row result can depend on the batch shape (GEMMs, reductions, CPU sigmoid):
dot products are elementwise products summed in a fixed pairwise order, sigmoid is 1/(1+exp(-x)). So a node
scores the same bits whether it is expanded alone (reference) or among B x lanes rows (frontier). Do not
torch.compile them: fusion may contract a*b+c into an FMA and change the bits.

Two implementations of that math: torch ops (CPU tensors) and Triton kernels (CUDA tensors; CPU tensors too
inside `triton_on_cpu()`, under TRITON_INTERPRET=1), see speculative/tree_triton.py. Each function dispatches
on its inputs' device, so on CUDA the reference heap, the torch frontier and the fused Triton frontier all take
their numbers from the same Triton device code. The two implementations differ in the last bits (summation
order, exp/log), so trees are compared within one implementation, never across.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor


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

    @property
    def num_nodes(self) -> Tensor:
        return self.valid.sum(1)

    def verify_tokens(self, root_ids: Tensor) -> Tensor:
        """[B, 1+N]: what the target verifies, root first."""
        return torch.cat([root_ids[:, None], self.tokens], 1)

    def position_offsets(self) -> Tensor:
        """[B, 1+N]: position of each verify slot relative to the root (root 0, node depth+1)."""
        return torch.cat([torch.zeros_like(self.depths[:, :1]), self.depths + 1], 1)

    def tree_attention_mask(self) -> Tensor:
        """[B, 1+N, 1+N] bool: slot i may see slot j iff j is i or an ancestor of i (the root is everyone's).
        The tree-masked extend attention's `tree_mask` (the prefix stays visible to all)."""
        b, n = self.tokens.shape
        up = torch.cat([torch.zeros_like(self.parents[:, :1]),
                        torch.where(self.valid, self.parents + 1, 0)], 1)        # parent slot; root -> root
        eye = torch.eye(n + 1, dtype=torch.bool, device=up.device)
        mask = eye.expand(b, n + 1, n + 1).clone()
        cur = torch.arange(n + 1, device=up.device).expand(b, n + 1)
        for _ in range(n):
            cur = up.gather(1, cur)
            mask.scatter_(2, cur[..., None], True)
        return mask


# ---- batch-invariant arithmetic -------------------------------------------------------------------------------

def pairwise_sum(x: Tensor) -> Tensor:
    """Sum over the last dim in a fixed binary-tree order, with elementwise adds only."""
    n = x.shape[-1]
    width = 1 << (n - 1).bit_length()
    if width != n:
        x = F.pad(x, (0, width - n))
    while x.shape[-1] > 1:
        half = x.shape[-1] // 2
        x = x[..., :half] + x[..., half:]
    return x[..., 0]


def rowdot(x: Tensor, w: Tensor) -> Tensor:
    """x [N, K] times w [O, K] (shared) or [N, O, K] (per row) -> [N, O]."""
    return pairwise_sum(x.unsqueeze(-2) * w)


def sigmoid(x: Tensor) -> Tensor:
    return 1.0 / (1.0 + torch.exp(-x))


def log_softmax(x: Tensor) -> Tensor:
    m = x.amax(-1, keepdim=True)
    return x - (m + torch.log(pairwise_sum(torch.exp(x - m)))[..., None])


def gru_step(gate_in: Tensor, gate_hidden: Tensor, h: Tensor) -> Tensor:
    """torch.nn.GRU's cell (gate order r, z, n; no bias) from precomputed W_ih x and W_hh h."""
    ir, iz, i_n = gate_in.chunk(3, -1)
    hr, hz, h_n = gate_hidden.chunk(3, -1)
    r, z = sigmoid(ir + hr), sigmoid(iz + hz)
    n = torch.tanh(i_n + r * h_n)
    return (1.0 - z) * n + z * h


# ---- one round's scoring inputs ---------------------------------------------------------------------------------

@dataclass(frozen=True)
class HeadTables:
    """The Domino head's weights as the row math reads them: contiguous, [K, O] for a dot over k, the matrices in
    the head's own dtype (read as float32: exact) and the gate table float32. They depend only on the weights;
    a serving builder computes them once."""
    gates: Tensor          # [V, 3G] W_ih embed(v): every token's GRU input gates
    w_hh_t: Tensor         # [G, 3G] W_hh^T
    w1_hidden_t: Tensor    # [H, R]  W1[:, :H]^T
    w1_state_t: Tensor     # [G, R]  W1[:, H:]^T
    w2: Tensor             # [V, R]

    @staticmethod
    @torch.no_grad()
    def of(head, embed_weight: Tensor, gates: Optional[Tensor] = None) -> "HeadTables":
        """head: speculative.drafter.DominoHead; gates: `gate_table(head, embed_weight)` if cached."""
        t = lambda w: w.detach().t().contiguous()
        w1, w_hh = head.w1.weight, head.gru.weight_hh_l0
        h = w1.shape[1] - w_hh.shape[1]
        return HeadTables((gate_table(head, embed_weight) if gates is None else gates).contiguous(), t(w_hh),
                          t(w1[:, :h]), t(w1[:, h:]), head.w2.weight.detach().contiguous())


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


_triton_on_cpu = False


@contextlib.contextmanager
def triton_on_cpu():
    """Run the Triton implementation on CPU tensors too (tests; needs TRITON_INTERPRET=1 before the kernels'
    module is first imported, as tests/conftest.py arranges on machines without CUDA)."""
    global _triton_on_cpu
    before, _triton_on_cpu = _triton_on_cpu, True
    try:
        yield
    finally:
        _triton_on_cpu = before


def on_triton(t: Tensor) -> bool:
    return t.is_cuda or _triton_on_cpu


def top_candidates(logits: Tensor, m: int) -> Tensor:
    """Indices of the m largest logits [.., V] (float32), best first, ties to the lower index: a topk over unique
    int64 keys (order-preserving float bits, then the index), so the result never depends on the batch shape."""
    bits = logits.contiguous().view(torch.int32)
    ordered = torch.where(bits < 0, bits ^ 0x7FFFFFFF, bits).long()
    v = logits.shape[-1]
    return torch.topk(ordered * (1 << 24) + (v - 1 - torch.arange(v, device=logits.device)), m, dim=-1).indices


def gate_table(head, embed_weight: Tensor) -> Tensor:
    """[V, 3G] = W_ih embed(v) for every token: the GRU input gates, one GEMM of a batch-independent shape.
    Depends only on weights; a serving builder computes it once."""
    return embed_weight.detach().float() @ head.gru.weight_ih_l0.detach().float().t()


@torch.no_grad()
def prepare_round(head, hidden: Tensor, base_logits: Tensor, root_ids: Tensor, embed_weight: Tensor,
                  cfg: TreeConfig, gates: Optional[Tensor] = None) -> TreeRound:
    """head: speculative.drafter.DominoHead; hidden [B, S, H] and base_logits [B, S, V] from one draft block;
    root_ids [B]; embed_weight [V, H] the target's; gates: `gate_table` if cached."""
    tables = HeadTables.of(head, embed_weight, gates) if cfg.corrected else None
    return prepare_round_with(tables, hidden, base_logits, root_ids, cfg)


@torch.no_grad()
def prepare_round_with(tables: Optional[HeadTables], hidden: Tensor, base_logits: Tensor, root_ids: Tensor,
                       cfg: TreeConfig) -> TreeRound:
    """prepare_round from the head's tables (None: an uncorrected round). float32 throughout. Each request's
    TreeRound rows depend only on that request's inputs (padding a batch changes no bit)."""
    d = min(cfg.max_depth, base_logits.shape[1])
    m = min(cfg.candidates, base_logits.shape[-1])
    if on_triton(base_logits):
        from speculative import tree_triton
        return tree_triton.prepare_round(tables, hidden, base_logits, root_ids, d, m)
    base = base_logits[:, :d].detach().float()
    cand_ids = top_candidates(base, m)
    base_cand = base.gather(-1, cand_ids)
    top = base.amax(-1, keepdim=True)
    base_logp = base_cand - (top + torch.log(pairwise_sum(torch.exp(base - top)))[..., None])
    if tables is None:
        return TreeRound(cand_ids, base_logp)
    b, h = root_ids.shape[0], hidden.shape[-1]
    root_in = tables.gates[root_ids]
    g = tables.w_hh_t.shape[0]
    root_state = gru_step(root_in, torch.zeros_like(root_in), torch.zeros(b, g, device=root_in.device))
    zproj = rowdot(hidden[:, :d].detach().float().reshape(b * d, h), tables.w1_hidden_t.t()).view(b, d, -1)
    return TreeRound(cand_ids, base_logp, base_cand, zproj, root_state, tables)


def child_logprobs(rnd: TreeRound, rows: Tensor, depth: int, states: Optional[Tensor], corrected: bool) -> Tensor:
    """Log-probs over the M candidates of `depth` for the children of nodes whose paths have GRU `states`
    [N, G]; rows [N] says which request each node belongs to. -> [N, M] float32."""
    if not corrected:
        return rnd.base_logp[rows, depth]
    if on_triton(states):
        from speculative import tree_triton
        return tree_triton.child_logprobs(rnd, rows, depth, states)
    u = rnd.zproj[rows, depth] + rowdot(states, rnd.tables.w1_state_t.t())
    w2_cand = rnd.tables.w2[rnd.cand_ids[rows, depth]]                       # [N, M, R]
    return log_softmax(rnd.base_cand[rows, depth] + rowdot(u * sigmoid(u), w2_cand))


def top_children(logp: Tensor, k: int) -> tuple[Tensor, Tensor]:
    """Best k candidates per row, ties to the lower candidate index: (candidate index [.., k], log-prob)."""
    if on_triton(logp):
        from speculative import tree_triton
        return tree_triton.top_children(logp, k)
    vals, idx = torch.sort(logp, dim=-1, descending=True, stable=True)
    return idx[..., :k], vals[..., :k]


def hidden_gates(rnd: TreeRound, states: Tensor) -> Tensor:
    """W_hh h [N, 3G] for nodes with GRU states [N, G]: what their children's GRU steps read."""
    if on_triton(states):
        from speculative import tree_triton
        return tree_triton.hidden_gates(rnd.tables, states)
    return rowdot(states, rnd.tables.w_hh_t.t())


def child_states(rnd: TreeRound, rows: Tensor, depth: int, cand: Tensor, parent_states: Tensor,
                 parent_gates: Tensor) -> Tensor:
    """GRU state of the child holding candidate `cand` [N] of `depth`, from its parent's state and gates."""
    if on_triton(parent_states):
        from speculative import tree_triton
        return tree_triton.child_states(rnd, rows, depth, cand, parent_states, parent_gates)
    return gru_step(rnd.tables.gates[rnd.cand_ids[rows, depth, cand]], parent_gates, parent_states)
