"""The drafter's cached context: batched, incremental observations equal a full recompute (gaps, cut-backs on
recompute, pool growth, forgotten sequences), and the verify rows' mask lets each slot see exactly its ancestors."""
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from speculative.speculator import Speculator
from speculative.context_cache import PagedDraftContext
from speculative.cost_model import KneeBudgetPolicy
from speculative.drafter import DominoDrafter, DrafterConfig
from speculative.draft_tree import DraftTree

CFG = DrafterConfig(vocab_size=50, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4,
                    num_kv_heads=2, head_dim=8, target_layer_ids=(1, 3), block_size=4, gru_hidden=16,
                    correction_rank=8)


def make_speculator(seed=0):
    torch.manual_seed(seed)
    drafter = DominoDrafter(CFG)
    embed = torch.randn(CFG.vocab_size, CFG.hidden_size)
    spec = Speculator(drafter, "dominotree", 8, embed, embed, CFG.vocab_size, max_num_seqs=4)
    spec.contexts = PagedDraftContext(CFG.num_layers, CFG.num_kv_heads, CFG.head_dim, torch.float32,
                                      torch.device("cpu"), page_size=4, num_pages=2)      # grows several times
    return spec


def full_context(spec, hidden_by_pos: dict, positions: list[int]):
    """The reference: the drafter's context of all kept positions, computed in one call."""
    h = torch.stack([hidden_by_pos[p] for p in positions])[None]
    return spec.drafter.backbone.context(h, torch.tensor(positions)[None])


def test_incremental_batched_context_equals_full_recompute():
    spec = make_speculator()
    g = torch.Generator().manual_seed(1)
    seqs = [SimpleNamespace(seq_id=i) for i in range(3)]
    truth = {i: {} for i in range(3)}                   # seq -> position -> [layers * hidden] hidden state
    kept = {i: [] for i in range(3)}
    # per step: (seq, first position, count); seq 1 starts at 5 (a prefix-cache hit), seq 2 is preempted and
    # recomputes from 0 at step 3, seq 0 skips position 9 (never computed) and continues
    plan = [[(0, 0, 6), (1, 5, 3), (2, 0, 4)],
            [(0, 6, 1), (1, 8, 1), (2, 4, 2)],
            [(0, 7, 2), (2, 6, 3)],
            [(0, 10, 3), (1, 9, 4), (2, 0, 5)],
            [(0, 13, 1), (2, 5, 1)]]
    for step in plan:
        total = sum(n for _, _, n in step)
        aux = [torch.randn(total + 2, CFG.hidden_size, generator=g) for _ in CFG.target_layer_ids]
        row = 1
        for sid, pos, n in step:
            spec.observe_rows(seqs[sid], aux, row, pos, n)
            for j in range(n):
                truth[sid][pos + j] = torch.cat([aux[k][row + j] for k in spec._aux_order])
            kept[sid] = [p for p in kept[sid] if p < pos] + list(range(pos, pos + n))
            row += n
    spec.flush()
    ctx = spec.contexts.gather([0, 1, 2])
    for b in range(3):
        assert spec.contexts.positions(b) == kept[b]
        ref = full_context(spec, truth[b], kept[b])
        n = len(kept[b])
        assert ctx.valid[b].sum() == n and ctx.valid[b, :n].all()
        for layer in range(CFG.num_layers):
            torch.testing.assert_close(ctx.keys[layer][b, :n], ref.keys[layer][0], rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(ctx.values[layer][b, :n], ref.values[layer][0], rtol=1e-5, atol=1e-5)


def test_forgotten_pages_are_reused_and_drafting_reads_the_cache():
    spec = make_speculator(seed=2)
    aux = [torch.randn(12, CFG.hidden_size) for _ in CFG.target_layer_ids]
    a, b = SimpleNamespace(seq_id=7), SimpleNamespace(seq_id=8)
    spec.observe_rows(a, aux, 0, 0, 10)
    spec.observe_rows(b, aux, 10, 0, 2)
    spec.flush()
    spec.forget(a)
    pages = spec.contexts.pool.shape[2]
    spec.observe_rows(SimpleNamespace(seq_id=9), [x + 1 for x in aux], 0, 0, 9)
    spec.flush()
    assert spec.contexts.pool.shape[2] == pages                    # a's pages served the new sequence
    assert spec.contexts.positions(8) == [0, 1] and 7 not in spec.contexts.lengths
    seq = SimpleNamespace(seq_id=8, last_token_id=5, num_tokens=3)
    proposal = spec.propose([seq], 8)
    assert proposal.trees.tokens.shape == proposal.rows.tokens.shape == (1, 8) and proposal.rows.width == 9


@pytest.mark.parametrize("n", [1, 2, 9, 16, 17])
def test_verify_rows_follow_the_parent_links(n):
    """Slot i (node i - 1) sees slot j iff j is i, the root or an ancestor of i, on random trees, a chain as deep
    as the budget and trees with invalid slots; offsets are depth + 1."""
    g = torch.Generator().manual_seed(3)
    b = 4
    parents = torch.full((b, n), -1)
    depths = torch.zeros(b, n, dtype=torch.long)
    for r in range(b):
        for i in range(1, n):
            parents[r, i] = i - 1 if r == 3 else int(torch.randint(-1, i, (1,), generator=g))   # row 3: a chain
            depths[r, i] = 0 if parents[r, i] < 0 else depths[r, parents[r, i]] + 1
    valid = torch.arange(n)[None] < torch.tensor([[n], [min(n, 5)], [1], [n]])
    tree = DraftTree(torch.randint(0, 50, (b, n), generator=g), torch.where(valid, parents, -1),
                     torch.where(valid, depths, 0), torch.zeros(b, n), valid)
    rows = tree.verify_rows()
    assert rows.width == n + 1 and torch.equal(rows.tokens, tree.tokens)
    for r in range(b):
        want = np.eye(n + 1, dtype=bool)
        want[:, 0] = True
        for i in range(n):
            node = i
            while node >= 0 and valid[r, i]:
                want[1 + i, 1 + node] = True
                node = int(parents[r, node])
        assert np.array_equal(rows.mask[r].numpy(), want), r
        assert rows.offsets[r].tolist() == [0] + (tree.depths[r] + 1).tolist()


def test_knee_policy_stops_speculating_where_the_verify_forward_leaves_the_knee():
    policy = KneeBudgetPolicy(16)
    assert [policy.budget(b) for b in (1, 7, 8, 16, 25, 26, 32, 256)] == [16, 16, 15, 7, 4, 0, 0, 0]
    assert KneeBudgetPolicy(2).budget(1) == 2                      # a small budget is not cut to zero


def test_graph_tree_builder_with_shared_gates_builds_the_engines_tree():
    """The CUDA path's GraphTreeBuilder (here eager: no CUDA) with the speculator's shared gate table builds the
    tree the CPU path builds."""
    from speculative.tree import prepare_round
    from speculative.tree_gpu import GraphTreeBuilder
    spec = make_speculator(seed=4)
    g = torch.Generator().manual_seed(5)
    hidden = torch.randn(3, CFG.block_size, CFG.hidden_size, generator=g)
    base = torch.randn(3, CFG.block_size, CFG.vocab_size, generator=g)
    roots = torch.tensor([1, 7, 9])
    cfg = spec.builder(6).cfg
    want = spec.builder(6).build(prepare_round(spec.drafter.head, hidden, base, roots, spec.embed_weight, cfg,
                                               spec.gates(cfg)))
    graphs = GraphTreeBuilder(spec.drafter.head, spec.embed_weight, cfg, CFG.block_size, CFG.vocab_size,
                              CFG.hidden_size, torch.float32, use_graphs=False, gates=spec.gates(cfg))
    assert graphs.gates is spec.gates(cfg)
    got = graphs.build(hidden, base, roots)
    for a, b in zip((want.tokens, want.parents, want.depths, want.valid), (got.tokens, got.parents, got.depths,
                                                                          got.valid)):
        assert torch.equal(a, b)


def context_of(spec, seq_id, truth_rows):
    """The cached context of one sequence against a one-shot recompute from its (position -> hidden) rows."""
    positions = spec.contexts.positions(seq_id)
    assert positions == sorted(truth_rows)
    ctx = spec.contexts.gather([seq_id])
    ref = full_context(spec, truth_rows, positions)
    for layer in range(CFG.num_layers):
        torch.testing.assert_close(ctx.keys[layer][0, :len(positions)], ref.keys[layer][0], rtol=1e-5, atol=1e-5)


def test_deferred_rows_of_a_forgotten_sequence_are_dropped_and_the_bound_flushes():
    spec = make_speculator(seed=6)
    spec._pending.max_held_rows = 8
    g = torch.Generator().manual_seed(7)
    one = [torch.randn(6, CFG.hidden_size, generator=g) for _ in CFG.target_layer_ids]
    two = [torch.randn(4, CFG.hidden_size, generator=g) for _ in CFG.target_layer_ids]
    row = lambda aux, r: torch.cat([aux[k][r] for k in spec._aux_order])
    spec.observe_rows(SimpleNamespace(seq_id=7), one, 0, 0, 3)
    spec.observe_rows(SimpleNamespace(seq_id=8), one, 3, 0, 3)
    assert not spec.contexts.lengths and spec._pending                # deferred: nothing projected yet
    spec.forget(SimpleNamespace(seq_id=7))
    spec.observe_rows(SimpleNamespace(seq_id=7), two, 1, 0, 2)         # the id again (the profile reuses ids)
    assert not spec._pending                                          # 6 + 4 held rows passed the bound of 8
    context_of(spec, 7, {0: row(two, 1), 1: row(two, 2)})
    context_of(spec, 8, {p: row(one, 3 + p) for p in range(3)})


def test_observe_step_takes_the_plain_rows_of_a_mixed_step():
    spec = make_speculator(seed=8)
    g = torch.Generator().manual_seed(9)
    aux = [torch.randn(7, CFG.hidden_size, generator=g) for _ in CFG.target_layer_ids]
    row = lambda r: torch.cat([aux[k][r] for k in spec._aux_order])
    seqs = [SimpleNamespace(seq_id=i) for i in (3, 4, 5)]
    # sequence 3: a 2-token chunk at 5, 6; sequence 4 verifies a 3-node tree (rows 2..5); sequence 5 decodes at 9
    batch = SimpleNamespace(seqs=seqs, drafts=[0, 3, 0])
    step = SimpleNamespace(query_start_loc=np.asarray([0, 2, 6, 7], np.int32), num_tokens=7,
                           positions=np.asarray([5, 6, 10, 11, 11, 12, 9]))
    spec.observe_step(batch, step, aux)
    spec.flush()
    context_of(spec, 3, {5: row(0), 6: row(1)})
    context_of(spec, 5, {9: row(6)})
    assert spec.contexts.length(4) == 0
    decode = SimpleNamespace(query_start_loc=np.arange(4, dtype=np.int32), num_tokens=3,
                             positions=np.asarray([7, 11, 10]))
    spec.observe_step(SimpleNamespace(seqs=seqs, drafts=[0, 0, 0]), decode, [a[:3] for a in aux])
    spec.flush()
    context_of(spec, 3, {5: row(0), 6: row(1), 7: row(0)})
    context_of(spec, 4, {11: row(1)})
