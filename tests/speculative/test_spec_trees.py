"""DominoTree trees: structure and masks, the shared scoring math, reference heap vs batched frontier (bit-identical
trees over hundreds of random cases, ties included), brute-force best-first order, and the baseline methods."""
import random

import pytest
import torch

from speculative.baselines import make_builder
from speculative.drafter import DominoHead, DrafterConfig
from speculative.draft_tree import DraftTree, TreeConfig, TreeRound
from speculative.tree import (child_logprobs, child_states, hidden_gates, pairwise_sum, prepare_round, rowdot,
                              top_candidates, top_children)
from speculative.tree_gpu import GraphTreeBuilder, build_frontier
from speculative.tree_reference import build_reference


from tests.support.threads import one_thread  # noqa: F401,E402  (autouse)


def random_round(seed: int, ties: bool = False, corrected: bool = True, **tree_overrides):
    """A random DominoHead, draft block and tree config; `ties` quantizes logits and weights to force exact ties."""
    rng, g = random.Random(seed), torch.Generator().manual_seed(seed)
    v, h, gru, rank, s = rng.choice([40, 97, 200]), rng.choice([16, 24]), rng.choice([8, 12, 32]), \
        rng.choice([4, 8]), rng.choice([4, 8, 16])
    cfg = DrafterConfig(vocab_size=v, hidden_size=h, intermediate_size=32, num_layers=1, num_heads=2,
                        num_kv_heads=1, head_dim=8, target_layer_ids=(0,), block_size=s, gru_hidden=gru,
                        correction_rank=rank)
    head = DominoHead(cfg)
    scale = rng.choice([0.3, 1.0, 3.0])
    for p in head.parameters():
        p.data = torch.randn(p.shape, generator=g) * scale
        if ties:
            p.data = p.data.round() * rng.choice([0.0, 0.5])
    b = rng.choice([1, 3, 5])
    hidden = torch.randn(b, s, h, generator=g)
    base = torch.randn(b, s, v, generator=g) * rng.choice([1.0, 3.0])
    if ties:
        base = base.round()
    embed = torch.randn(v, h, generator=g)
    roots = torch.randint(0, v, (b,), generator=g)
    tc = dict(budget=rng.choice([1, 5, 16, 30]), node_topk=rng.choice([1, 2, 3, 8]),
              candidates=rng.choice([8, 16, 64]), max_depth=rng.choice([1, 3, s]),
              uncorrected_depths=rng.choice([0, 1, 2]), corrected=corrected)
    tc.update(tree_overrides)
    tcfg = TreeConfig(**tc)
    return head, hidden, base, roots, embed, tcfg


def assert_same_tree(a: DraftTree, b: DraftTree, msg=""):
    for field in ("tokens", "parents", "depths", "valid", "scores"):
        assert torch.equal(getattr(a, field), getattr(b, field)), (msg, field, getattr(a, field), getattr(b, field))


def test_tree_mask_and_positions_on_a_hand_built_tree():
    # root -> 0 (a), 1 (b); 0 -> 2 (c); 2 -> 3 (d); slot 4 invalid
    tree = DraftTree(tokens=torch.tensor([[10, 11, 12, 13, 0]]), parents=torch.tensor([[-1, -1, 0, 2, -1]]),
                     depths=torch.tensor([[0, 0, 1, 2, 0]]),
                     scores=torch.tensor([[-0.1, -0.2, -0.3, -0.4, float("-inf")]]),
                     valid=torch.tensor([[True, True, True, True, False]]))
    mask = tree.tree_attention_mask()[0].int().tolist()
    assert mask == [[1, 0, 0, 0, 0, 0],
                    [1, 1, 0, 0, 0, 0],
                    [1, 0, 1, 0, 0, 0],
                    [1, 1, 0, 1, 0, 0],
                    [1, 1, 0, 1, 1, 0],
                    [1, 0, 0, 0, 0, 1]]
    assert tree.position_offsets().tolist() == [[0, 1, 1, 2, 3, 1]]
    assert tree.verify_tokens(torch.tensor([7])).tolist() == [[7, 10, 11, 12, 13, 0]]
    assert tree.num_nodes.tolist() == [4]


def test_scoring_rows_are_batch_invariant():
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(37, 29, generator=g), torch.randn(13, 29, generator=g)
    full = rowdot(x, w)
    assert all(torch.equal(rowdot(x[i:i + 1], w)[0], full[i]) for i in range(37))
    assert torch.allclose(full, x @ w.t(), atol=1e-5)
    assert torch.equal(pairwise_sum(torch.ones(5, 7)), torch.full((5,), 7.0))
    head, hidden, base, roots, embed, tc = random_round(3, budget=16, node_topk=8, candidates=64, max_depth=4,
                                                        uncorrected_depths=0)
    rnd = prepare_round(head, hidden, base, roots, embed, tc)
    rows = torch.arange(roots.shape[0])
    states = torch.randn(rows.shape[0], rnd.root_state.shape[1], generator=g)
    logp = child_logprobs(rnd, rows, 2, states, True)
    gates = hidden_gates(rnd, states)
    for i in range(rows.shape[0]):
        assert torch.equal(child_logprobs(rnd, rows[i:i + 1], 2, states[i:i + 1], True)[0], logp[i])
        assert torch.equal(hidden_gates(rnd, states[i:i + 1])[0], gates[i])


def test_round_inputs_do_not_depend_on_the_batch():
    """A request's TreeRound rows are the same bits alone, in a batch, or padded (graph buckets)."""
    head, hidden, base, roots, embed, tc = random_round(4, ties=True, budget=16, node_topk=8, candidates=16,
                                                        max_depth=8)
    extra = torch.randn(7, *hidden.shape[1:]), torch.randn(7, *base.shape[1:]), torch.randint(0, base.shape[2], (7,))
    padded = prepare_round(head, torch.cat([hidden, extra[0]]), torch.cat([base, extra[1]]),
                           torch.cat([roots, extra[2]]), embed, tc)
    batched = prepare_round(head, hidden, base, roots, embed, tc)
    for i in range(roots.shape[0]):
        alone = prepare_round(head, hidden[i:i + 1], base[i:i + 1], roots[i:i + 1], embed, tc)
        for field in TreeRound.__dataclass_fields__:
            a, b, c = getattr(alone, field), getattr(batched, field), getattr(padded, field)
            if field == "tables":
                continue
            assert torch.equal(a[0], b[i]) and torch.equal(a[0], c[i]), field


def test_candidates_are_the_top_logits_ties_to_the_lower_index():
    logits = torch.tensor([[0.5, 2.0, -1.0, 2.0, 0.5, -0.0, 0.0, 7.0]])
    assert top_candidates(logits, 6).tolist() == [[7, 1, 3, 0, 4, 6]]
    x = torch.randn(50, 300).round() + 0.0                          # + 0.0: no -0.0, which ranks below +0.0
    assert torch.equal(top_candidates(x, 40), torch.sort(x, dim=-1, descending=True, stable=True).indices[:, :40])


def test_scoring_matches_the_domino_head_modules():
    """The tree's row math is the DominoHead (nn.GRU + w1/w2) restricted to the candidates."""
    head, hidden, base, roots, embed, tc = random_round(5, budget=16, node_topk=4, candidates=16, max_depth=4,
                                                        uncorrected_depths=1)
    rnd = prepare_round(head, hidden, base, roots, embed, tc)
    b = 0
    rows = torch.tensor([b])
    path = [int(rnd.cand_ids[b, d, d]) for d in range(3)]                    # root, then candidates 0, 1, 2
    with torch.no_grad():
        states = head.path_states(embed[torch.tensor([[int(roots[b])] + path])])[0]   # [4, G]
        state, gates = rnd.root_state[b:b + 1], None
        assert torch.allclose(state[0], states[0], atol=1e-5)
        for d in range(3):
            gates = hidden_gates(rnd, state)
            state = child_states(rnd, rows, d, torch.tensor([d]), state, gates)
            assert torch.allclose(state[0], states[d + 1], atol=1e-5)
            full = base[b, d + 1] + head.correction(hidden[b, d + 1], states[d + 1])
            expect = torch.log_softmax(full[rnd.cand_ids[b, d + 1]], -1)
            assert torch.allclose(child_logprobs(rnd, rows, d + 1, state, True)[0], expect, atol=1e-4)
        uncorrected = child_logprobs(rnd, rows, 0, rnd.root_state[b:b + 1], False)[0]
        assert torch.allclose(uncorrected, torch.log_softmax(base[b, 0], -1)[rnd.cand_ids[b, 0]], atol=1e-5)


@pytest.mark.parametrize("chunk", range(4))
def test_frontier_builder_is_bit_identical_to_the_reference_heap(chunk):
    for seed in range(chunk * 100, chunk * 100 + 100):
        head, hidden, base, roots, embed, tc = random_round(seed, ties=seed % 3 == 0, corrected=seed % 5 != 0)
        rnd = prepare_round(head, hidden, base, roots, embed, tc)
        assert_same_tree(build_reference(rnd, tc), build_frontier(rnd, tc), (seed, tc))


def _brute_force(rnd, tc, req):
    """Every node of the full tree (top-k children, max depth) scored along its path, sorted by the documented
    order, first `budget` kept: [(token, parent index, depth, score)]."""
    rows = torch.tensor([req])
    max_depth = min(tc.max_depth, rnd.cand_ids.shape[1])
    nodes = []

    def expand(parent_key, parent_score, state, depth, parent_id):
        if depth >= max_depth:
            return
        corrected = tc.corrected and depth >= tc.uncorrected_depths
        cand, logp = top_children(child_logprobs(rnd, rows, depth, state, corrected), tc.node_topk)
        scores = parent_score + logp
        gates = hidden_gates(rnd, state) if tc.corrected else None
        for rank in range(cand.shape[1]):
            score = float(scores[0, rank])
            key = (-score, parent_key, rank)
            node_id = len(nodes)
            nodes.append(((-score, depth, key), int(rnd.cand_ids[req, depth, cand[0, rank]]), parent_id, depth,
                          score))
            child = child_states(rnd, rows, depth, cand[0, rank:rank + 1], state, gates) if tc.corrected else None
            expand(key, scores[0, rank], child, depth + 1, node_id)

    expand((), torch.zeros(()), rnd.root_state[req:req + 1] if tc.corrected else None, 0, -1)
    order = sorted(range(len(nodes)), key=lambda i: nodes[i][0])[:tc.budget]
    where = {node: i for i, node in enumerate(order)}
    return [(nodes[i][1], where[nodes[i][2]] if nodes[i][2] >= 0 else -1, nodes[i][3], nodes[i][4]) for i in order]


def test_reference_heap_pops_the_globally_best_nodes():
    for seed in range(40):
        head, hidden, base, roots, embed, tc = random_round(seed, ties=seed % 2 == 0, node_topk=2, max_depth=4,
                                                            budget=9, corrected=seed % 4 != 0)
        rnd = prepare_round(head, hidden, base, roots, embed, tc)
        tree = build_reference(rnd, tc)
        for req in range(roots.shape[0]):
            want = _brute_force(rnd, tc, req)
            n = len(want)
            got = list(zip(tree.tokens[req, :n].tolist(), tree.parents[req, :n].tolist(),
                           tree.depths[req, :n].tolist(), tree.scores[req, :n].tolist()))
            assert got == want, (seed, req)


def test_tree_invariants():
    for seed in range(60):
        head, hidden, base, roots, embed, tc = random_round(seed)
        tree = build_frontier(prepare_round(head, hidden, base, roots, embed, tc), tc)
        for req in range(roots.shape[0]):
            n = int(tree.num_nodes[req])
            assert tree.valid[req, :n].all() and not tree.valid[req, n:].any()
            scores = tree.scores[req, :n]
            assert (scores[1:] <= scores[:-1]).all()
            children = {}
            for i in range(n):
                p = int(tree.parents[req, i])
                assert p < i
                assert int(tree.depths[req, i]) == (0 if p < 0 else int(tree.depths[req, p]) + 1)
                assert p < 0 or scores[i] <= scores[p]
                children.setdefault(p, []).append(int(tree.tokens[req, i]))
            assert all(len(c) == len(set(c)) and len(c) <= tc.node_topk for c in children.values())
            assert n == min(tc.budget, sum(min(tc.node_topk, tc.candidates) ** (d + 1)
                                           for d in range(min(tc.max_depth, hidden.shape[1]))))


def test_budget_beyond_the_whole_tree_pads_invalid_slots():
    head, hidden, base, roots, embed, _ = random_round(11)
    tc = TreeConfig(budget=20, node_topk=2, candidates=8, max_depth=3)     # the full tree has 2 + 4 + 8 = 14 nodes
    ref, fast = (f(prepare_round(head, hidden, base, roots, embed, tc), tc) for f in (build_reference, build_frontier))
    assert_same_tree(ref, fast)
    assert ref.num_nodes.tolist() == [14] * roots.shape[0]
    assert (ref.parents[:, 14:] == -1).all() and (ref.tokens[:, 14:] == 0).all()


def assert_rows_of(tree: DraftTree):
    """The rows a builder computed with the tree equal the ones computed from its fields."""
    assert tree.rows is not None
    fresh = DraftTree(tree.tokens, tree.parents, tree.depths, tree.scores, tree.valid).verify_rows()
    for field in ("tokens", "offsets", "mask"):
        assert torch.equal(getattr(tree.rows, field), getattr(fresh, field)), field


def test_graph_builder_eager_path_matches_frontier():
    head, hidden, base, roots, embed, tc = random_round(21, budget=16, node_topk=8, candidates=16, max_depth=8)
    builder = GraphTreeBuilder(head, embed, tc, block_size=hidden.shape[1], vocab_size=base.shape[2],
                               hidden_size=hidden.shape[2], dtype=torch.float32, batch_sizes=(1, 2))
    assert not builder.use_graphs
    for b in (1, 2, roots.shape[0]):                     # a bucket, the largest bucket, slices of it
        tree = builder.build(hidden[:b], base[:b], roots[:b])
        assert_same_tree(tree, build_frontier(prepare_round(head, hidden[:b], base[:b], roots[:b], embed, tc), tc), b)
        assert_rows_of(tree)
        assert tree.rows.mask.shape == (b, 17, 17)


def test_chain_baseline_is_the_greedy_corrected_path():
    head, hidden, base, roots, embed, _ = random_round(8)
    builder = make_builder("chain", max_depth=hidden.shape[1], candidates=16)
    tree = builder.build(prepare_round(head, hidden, base, roots, embed, builder.cfg))
    s = hidden.shape[1]
    assert (tree.parents[:, 1:] == torch.arange(s - 1)).all() and (tree.depths == torch.arange(s)).all()
    with torch.no_grad():
        for req in range(roots.shape[0]):
            path = [int(roots[req])]
            for d in range(s):
                cand = base[req, d].topk(16).indices
                logits = base[req, d].clone()
                if d >= 1:
                    state = head.path_states(embed[torch.tensor([path])])[0, -1]
                    logits = logits + head.correction(hidden[req, d], state)
                path.append(int(cand[logits[cand].argmax()]))
            assert tree.tokens[req].tolist() == path[1:]


def test_ddtree_baseline_ignores_the_correction_head():
    head, hidden, base, roots, embed, _ = random_round(9)
    builder = make_builder("ddtree", max_depth=hidden.shape[1])
    first = builder.build(prepare_round(head, hidden, base, roots, embed, builder.cfg))
    for p in head.parameters():
        p.data.normal_()
    assert_same_tree(first, builder.build(prepare_round(head, hidden, base, roots, embed, builder.cfg)))
    ref = make_builder("ddtree", reference=True, max_depth=hidden.shape[1])
    assert_same_tree(first, ref.build(prepare_round(head, hidden, base, roots, embed, ref.cfg)))
    # marginal scores: a node's score is the sum of its path's full-vocab log-probs
    logp = torch.log_softmax(base.float(), -1)
    for req in range(roots.shape[0]):
        for i in range(int(first.num_nodes[req])):
            total, j = 0.0, i
            while j >= 0:
                total += float(logp[req, first.depths[req, j], first.tokens[req, j]])
                j = int(first.parents[req, j])
            assert abs(total - float(first.scores[req, i])) < 1e-4
    with pytest.raises(ValueError):
        make_builder("beam")
