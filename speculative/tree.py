"""The per-node scoring both tree builders share, over the data types of speculative.draft_tree.

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
inside `triton_on_cpu()`, under TRITON_INTERPRET=1), see speculative/kernels/, imported only where they run
(their first import needs Triton and reads TRITON_INTERPRET). Each function dispatches on its inputs' device,
so on CUDA the reference heap, the torch frontier and the fused Triton frontier all take their numbers from the
same Triton device code. The two implementations differ in the last bits (summation order, exp/log), so trees
are compared within one implementation, never across.
"""
from __future__ import annotations

import contextlib
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from speculative.draft_tree import HeadTables, TreeConfig, TreeRound


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


# ---- dispatch: torch ops or Triton kernels --------------------------------------------------------------------

_triton_on_cpu = False


@contextlib.contextmanager
def triton_on_cpu():
    """Run the Triton implementation on CPU tensors too (tests; needs TRITON_INTERPRET=1 before
    speculative.kernels is first imported, as tests/conftest.py arranges on machines without CUDA)."""
    global _triton_on_cpu
    before, _triton_on_cpu = _triton_on_cpu, True
    try:
        yield
    finally:
        _triton_on_cpu = before


def on_triton(t: Tensor) -> bool:
    return t.is_cuda or _triton_on_cpu


# ---- one round's scoring inputs -------------------------------------------------------------------------------

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
def head_tables(head, embed_weight: Tensor, gates: Optional[Tensor] = None) -> HeadTables:
    """head: speculative.drafter.DominoHead; gates: `gate_table(head, embed_weight)` if cached."""
    def t(w: Tensor) -> Tensor:
        return w.detach().t().contiguous()

    w1, w_hh = head.w1.weight, head.gru.weight_hh_l0
    h = w1.shape[1] - w_hh.shape[1]
    return HeadTables((gate_table(head, embed_weight) if gates is None else gates).contiguous(), t(w_hh),
                      t(w1[:, :h]), t(w1[:, h:]), head.w2.weight.detach().contiguous())


@torch.no_grad()
def prepare_round(head, hidden: Tensor, base_logits: Tensor, root_ids: Tensor, embed_weight: Tensor,
                  cfg: TreeConfig, gates: Optional[Tensor] = None) -> TreeRound:
    """head: speculative.drafter.DominoHead; hidden [B, S, H] and base_logits [B, S, V] from one draft block;
    root_ids [B]; embed_weight [V, H] the target's; gates: `gate_table` if cached."""
    tables = head_tables(head, embed_weight, gates) if cfg.corrected else None
    return prepare_round_with(tables, hidden, base_logits, root_ids, cfg)


@torch.no_grad()
def prepare_round_with(tables: Optional[HeadTables], hidden: Tensor, base_logits: Tensor, root_ids: Tensor,
                       cfg: TreeConfig) -> TreeRound:
    """prepare_round from the head's tables (None: an uncorrected round). float32 throughout. Each request's
    TreeRound rows depend only on that request's inputs (padding a batch changes no bit)."""
    d = min(cfg.max_depth, base_logits.shape[1])
    m = min(cfg.candidates, base_logits.shape[-1])
    if on_triton(base_logits):
        from speculative.kernels import tree_round
        return tree_round.prepare_round(tables, hidden, base_logits, root_ids, d, m)
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


# ---- row scoring ----------------------------------------------------------------------------------------------

def child_logprobs(rnd: TreeRound, rows: Tensor, depth: int, states: Optional[Tensor], corrected: bool) -> Tensor:
    """Log-probs over the M candidates of `depth` for the children of nodes whose paths have GRU `states`
    [N, G]; rows [N] says which request each node belongs to. -> [N, M] float32."""
    if not corrected:
        return rnd.base_logp[rows, depth]
    if on_triton(states):
        from speculative.kernels import tree_rows
        return tree_rows.child_logprobs(rnd, rows, depth, states)
    u = rnd.zproj[rows, depth] + rowdot(states, rnd.tables.w1_state_t.t())
    w2_cand = rnd.tables.w2[rnd.cand_ids[rows, depth]]                       # [N, M, R]
    return log_softmax(rnd.base_cand[rows, depth] + rowdot(u * sigmoid(u), w2_cand))


def top_children(logp: Tensor, k: int) -> tuple[Tensor, Tensor]:
    """Best k candidates per row, ties to the lower candidate index: (candidate index [.., k], log-prob)."""
    if on_triton(logp):
        from speculative.kernels import tree_rows
        return tree_rows.top_children(logp, k)
    vals, idx = torch.sort(logp, dim=-1, descending=True, stable=True)
    return idx[..., :k], vals[..., :k]


def hidden_gates(rnd: TreeRound, states: Tensor) -> Tensor:
    """W_hh h [N, 3G] for nodes with GRU states [N, G]: what their children's GRU steps read."""
    if on_triton(states):
        from speculative.kernels import tree_rows
        return tree_rows.hidden_gates(rnd.tables, states)
    return rowdot(states, rnd.tables.w_hh_t.t())


def child_states(rnd: TreeRound, rows: Tensor, depth: int, cand: Tensor, parent_states: Tensor,
                 parent_gates: Tensor) -> Tensor:
    """GRU state of the child holding candidate `cand` [N] of `depth`, from its parent's state and gates."""
    if on_triton(parent_states):
        from speculative.kernels import tree_rows
        return tree_rows.child_states(rnd, rows, depth, cand, parent_states, parent_gates)
    return gru_step(rnd.tables.gates[rnd.cand_ids[rows, depth, cand]], parent_gates, parent_states)
