"""The Triton implementation of the tree math on CPU, in Triton's interpreter (tests/conftest.py sets
TRITON_INTERPRET=1 on machines without CUDA): fused frontier build == torch frontier == reference heap, all three
on the Triton row math (ties, DDTree mode, budgets beyond the tree, batches), the Triton round preparation's
candidates and batch invariance, and the kernels compiled for sm_90 without FMA contraction or register spills."""
import json
import os
import random
import subprocess
import sys

import pytest
import torch

triton = pytest.importorskip("triton")

from speculative.drafter import DominoHead, DrafterConfig  # noqa: E402
from speculative.draft_tree import DraftTree, TreeConfig, TreeRound  # noqa: E402
from speculative.tree import prepare_round, top_candidates, triton_on_cpu  # noqa: E402
from speculative.tree_gpu import build_frontier, build_frontier_torch  # noqa: E402
from speculative.tree_reference import build_reference  # noqa: E402
from speculative.acceptance import walk, walk_packed  # noqa: E402
from tests.support.trees import batched, following_choices, random_trees  # noqa: E402
from tests.support import REPO  # noqa: E402

interpreted = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available(),
                                 reason="needs TRITON_INTERPRET=1 (set by tests/conftest.py without CUDA)")
DEV = "cuda" if torch.cuda.is_available() else "cpu"


def small_round(seed: int, ties: bool, corrected: bool, **overrides):
    """A round small enough for the interpreter: vocab <= 97, depth <= 3, GRU 8/16, batch 1-2."""
    rng, g = random.Random(seed), torch.Generator().manual_seed(seed)
    v, h, gru, rank, s = rng.choice([24, 40, 97]), 8, rng.choice([8, 16]), rng.choice([4, 8]), 4
    head = DominoHead(DrafterConfig(vocab_size=v, hidden_size=h, intermediate_size=16, num_layers=1, num_heads=2,
                                    num_kv_heads=1, head_dim=4, target_layer_ids=(0,), block_size=s,
                                    gru_hidden=gru, correction_rank=rank))
    for p in head.parameters():
        p.data = torch.randn(p.shape, generator=g) * rng.choice([0.3, 1.0, 3.0])
        if ties:
            p.data = p.data.round() * rng.choice([0.0, 0.5]) + 0.0
    b = rng.choice([1, 2])
    hidden, base = torch.randn(b, s, h, generator=g), torch.randn(b, s, v, generator=g) * rng.choice([1.0, 3.0])
    if ties:
        base = base.round() + 0.0
    cfg = dict(budget=rng.choice([1, 4, 7, 20]), node_topk=rng.choice([1, 2, 3]), candidates=rng.choice([4, 8, 64]),
               max_depth=rng.choice([1, 2, 3]), uncorrected_depths=rng.choice([0, 1, 2]), corrected=corrected)
    cfg.update(overrides)

    def to(t):
        return t.to(DEV)

    return (head.to(DEV), to(hidden), to(base), to(torch.randint(0, v, (b,), generator=g)),
            to(torch.randn(v, h, generator=g)), TreeConfig(**cfg))


def assert_same_tree(a: DraftTree, b: DraftTree, msg):
    for field in ("tokens", "parents", "depths", "valid", "scores"):
        assert torch.equal(getattr(a, field), getattr(b, field)), (msg, field, getattr(a, field), getattr(b, field))


@interpreted
@pytest.mark.parametrize("chunk", range(4))
def test_fused_frontier_equals_torch_frontier_and_reference_on_triton_math(chunk):
    with triton_on_cpu():
        for seed in range(chunk * 8, chunk * 8 + 8):
            head, hidden, base, roots, embed, tc = small_round(seed, ties=seed % 3 == 0, corrected=seed % 4 != 3)
            rnd = prepare_round(head, hidden, base, roots, embed, tc)
            ref = build_reference(rnd, tc)
            assert_same_tree(ref, build_frontier(rnd, tc), ("fused", seed, tc))
            assert_same_tree(ref, build_frontier_torch(rnd, tc), ("torch frontier", seed, tc))


@interpreted
def test_budget_beyond_the_tree_and_ddtree_mode_on_triton_math():
    with triton_on_cpu():
        for seed, corrected in ((100, True), (101, False)):
            head, hidden, base, roots, embed, tc = small_round(seed, False, corrected, budget=20, node_topk=2,
                                                               candidates=8, max_depth=3)
            rnd = prepare_round(head, hidden, base, roots, embed, tc)
            tree = build_frontier(rnd, tc)
            assert_same_tree(build_reference(rnd, tc), tree, seed)
            assert tree.num_nodes.tolist() == [14] * roots.shape[0]          # 2 + 4 + 8 nodes
            assert (tree.parents[:, 14:] == -1).all() and not tree.valid[:, 14:].any()


@interpreted
def test_triton_round_candidates_and_batch_invariance():
    """Candidates are exactly the torch path's (unique keys: best logit first, ties to the lower index), the
    log-probs agree to float tolerance, and a request's rows are the same bits alone, batched or padded."""
    head, hidden, base, roots, embed, _ = small_round(7, ties=True, corrected=True)
    tc = TreeConfig(budget=8, node_topk=2, candidates=16, max_depth=4)
    extra = (torch.randn(3, *hidden.shape[1:], device=DEV), torch.randn(3, *base.shape[1:], device=DEV).round(),
             torch.randint(0, base.shape[2], (3,), device=DEV))
    with triton_on_cpu():
        batched = prepare_round(head, hidden, base, roots, embed, tc)
        padded = prepare_round(head, torch.cat([hidden, extra[0]]), torch.cat([base, extra[1]]),
                               torch.cat([roots, extra[2]]), embed, tc)
        alone = [prepare_round(head, hidden[i:i + 1], base[i:i + 1], roots[i:i + 1], embed, tc)
                 for i in range(roots.shape[0])]
    torch_round = prepare_round(head, hidden.cpu(), base.cpu(), roots.cpu(), embed.cpu(), tc) if DEV == "cpu" else None
    assert torch.equal(batched.cand_ids.cpu(), top_candidates(base.float().cpu(), 16))
    if torch_round is not None:
        assert torch.allclose(batched.base_logp, torch_round.base_logp, atol=1e-5)
        assert torch.allclose(batched.zproj, torch_round.zproj, atol=1e-5)
        assert torch.allclose(batched.root_state, torch_round.root_state, atol=1e-5)
    for field in TreeRound.__dataclass_fields__:
        if field == "tables":
            continue
        for i, one in enumerate(alone):
            a, b, c = getattr(one, field)[0], getattr(batched, field)[i], getattr(padded, field)[i]
            assert torch.equal(a, b) and torch.equal(a, c), field


@interpreted
@pytest.mark.parametrize("budget", [1, 2, 5, 16, 17, 40])
def test_fused_walk_equals_the_torch_walk(budget):
    """The walk's one launch (speculative.kernels.tree_walk) writes what walk()'s ops write, on trees with invalid
    trailing slots and choices that mostly follow a drafted child (deep paths), a miss at the root included."""
    rng = random.Random(budget)
    for _ in range(6):
        tree = batched(random_trees(rng, 5, budget), DEV)
        for b in range(5):                      # a tree smaller than the budget: its last slots are invalid
            n = rng.randint(0, budget)
            tree.valid[b, n:] = False
            tree.tokens[b, n:] = 0
            tree.parents[b, n:] = -1
        choices = following_choices(rng, tree)
        acc = walk(tree, choices)
        expected = torch.cat([acc.num_emitted[:, None], tree.num_nodes[:, None], acc.tokens, acc.path_slots], 1)
        with triton_on_cpu():
            got = walk_packed(tree, choices)
        assert torch.equal(got, expected)


def test_kernels_compile_for_sm90_without_contraction_or_spills(tmp_path):
    """Offline (no GPU; a fresh process, since this one may interpret the kernels): every kernel at SmolLM2's
    sizes compiles for sm_90 with no `contract` flag in its LLVM IR (no a*b+c becomes an FMA: part of the
    numbers' definition) and no spills."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = tmp_path / "compile.json"
    run = subprocess.run([sys.executable, "-m", "bench.tree_builder", "--compile-report", "--out", str(out)],
                         cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    report = json.loads(out.read_text())["compile"]
    assert set(report) >= {"expand", "ledger", "vocab_chunk", "merge_keys", "round_rows", "walk"}
    assert all(r["contract_flags"] == 0 and r["spilled_bytes"] == 0 for r in report.values()), report
