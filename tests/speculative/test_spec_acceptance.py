"""Tree acceptance (greedy walk, lossless sampling checked by a chi-square test that also catches a biased rule)
and the batch-aware budget cost model."""
import math
import random

import pytest
import torch

from speculative.acceptance import accept, target_choices, walk
from speculative.cost_model import (AcceptanceProfile, BudgetPolicy, FixedBudgetPolicy, KneeBudgetPolicy,
                                    VerifyProfile, choose_budget)
from speculative.draft_tree import DraftTree
from tests.support.trees import V, batched, following_choices, random_trees


def hand_tree() -> DraftTree:
    # root -> a(0):5, b(1):6 ; a -> c(2):7, d(3):8 ; c -> e(4):9 ; slot 5 invalid (token 0)
    return DraftTree(tokens=torch.tensor([[5, 6, 7, 8, 9, 0]]), parents=torch.tensor([[-1, -1, 0, 0, 2, -1]]),
                     depths=torch.tensor([[0, 0, 1, 1, 2, 0]]), scores=torch.zeros(1, 6),
                     valid=torch.tensor([[True] * 5 + [False]]))


def test_greedy_walk_follows_the_target_argmax():
    tree = hand_tree()
    # verify slots: root, a, b, c, d, e, invalid. Target picks 5 at root, 7 after a, 9 after c, 3 after e.
    out = walk(tree, torch.tensor([[5, 7, 0, 9, 1, 3, 0]]))
    assert out.path.tolist() == [[0, 2, 4, -1, -1, -1]]
    assert out.num_accepted.tolist() == [3] and out.num_emitted.tolist() == [4]
    assert out.tokens.tolist() == [[5, 7, 9, 3, -1, -1, -1]]
    assert out.path_slots.tolist() == [[0, 1, 3, 5, -1, -1, -1]]
    assert out.accepted_per_depth.tolist() == [1, 1, 1, 0, 0, 0]
    # first miss at the root: only the bonus token; an invalid slot's token 0 is never accepted
    out = walk(tree, torch.tensor([[0, 7, 0, 9, 1, 3, 0]]))
    assert out.num_accepted.tolist() == [0] and out.tokens[0, :2].tolist() == [0, -1]
    # logits form, argmax at T=0
    logits = torch.full((1, 7, 12), -5.0)
    logits[0, 0, 6] = 1.0
    logits[0, 2, 11] = 1.0
    out = accept(tree, logits)
    assert out.tokens[0, :2].tolist() == [6, 11] and out.path_slots[0, :2].tolist() == [0, 2]


def walk_by_depth(tree: DraftTree, choices: torch.Tensor) -> list[list[int]]:
    """The walk as its definition reads, one request and one depth at a time: the accepted node indices."""
    paths = []
    for b in range(tree.tokens.shape[0]):
        path, slot = [], 0
        while True:
            kids = [i for i in range(tree.tokens.shape[1]) if tree.valid[b, i] and tree.parents[b, i] + 1 == slot
                    and tree.tokens[b, i] == choices[b, slot]]
            if not kids:
                break
            path.append(kids[0])
            slot = kids[0] + 1
        paths.append(path)
    return paths


@pytest.mark.parametrize("budget", [1, 2, 5, 16, 17])
def test_batched_walk_equals_the_walk_by_depth(budget):
    rng = random.Random(budget)
    for _ in range(40):
        tree = batched(random_trees(rng, 6, budget))
        choices = following_choices(rng, tree)
        out = walk(tree, choices)
        for b, path in enumerate(walk_by_depth(tree, choices)):
            k = len(path)
            assert out.path[b].tolist() == path + [-1] * (budget - k)
            assert out.num_accepted[b] == k and out.num_emitted[b] == k + 1
            bonus = choices[b, path[-1] + 1 if path else 0].item()
            assert out.tokens[b].tolist() == [tree.tokens[b, i].item() for i in path] + [bonus] + [-1] * (budget - k)
            assert out.path_slots[b].tolist() == [0] + [i + 1 for i in path] + [-1] * (budget - k)


def test_sample_fn_sees_request_major_rows():
    logits = torch.randn(3, 4, 10)
    seen = []

    def sample_fn(flat):
        seen.append(flat)
        return flat.argmax(-1)
    assert torch.equal(target_choices(logits, sample_fn), logits.argmax(-1))
    assert torch.equal(seen[0][1 * 4 + 2], logits[1, 2])


TRIALS, TOKENS = 24000, 3


def markov_table() -> torch.Tensor:
    return torch.log(torch.tensor([[0.10, 0.20, 0.30, 0.40],
                                   [0.40, 0.30, 0.20, 0.10],
                                   [0.25, 0.25, 0.15, 0.35],
                                   [0.15, 0.45, 0.30, 0.10]]))


def generate(rule, seed: int) -> torch.Tensor:
    """TRIALS independent generations of TOKENS tokens from root token 0, speculating every round."""
    rng, gen = random.Random(seed), torch.Generator().manual_seed(seed)
    table, budget = markov_table(), 6
    library = random_trees(rng, 16, budget)
    fields = ("tokens", "parents", "depths", "scores", "valid")
    stacked = {f: torch.cat([getattr(t, f) for t in library]) for f in fields}
    out = torch.full((TRIALS, TOKENS), -1, dtype=torch.long)
    filled = torch.zeros(TRIALS, dtype=torch.long)
    last = torch.zeros(TRIALS, dtype=torch.long)
    while (filled < TOKENS).any():
        pick = torch.randint(0, len(library), (TRIALS,), generator=gen)
        tree = DraftTree(**{f: v[pick] for f, v in stacked.items()})
        logits = table[tree.verify_tokens(last)]                         # target's next-token logits per slot
        res = rule(tree, logits, gen)
        for j in range(budget + 1):
            write = (j < res.num_emitted) & (filled < TOKENS)
            out[write, filled[write]] = res.tokens[write, j]
            filled = filled + write.long()
        last = res.tokens.gather(1, (res.num_emitted - 1)[:, None])[:, 0]
    return out


def lossless(tree, logits, gen):
    return accept(tree, logits, lambda x: torch.multinomial(torch.softmax(x, -1), 1, generator=gen)[:, 0])


def biased(tree, logits, gen):
    """A tempting wrong rule: accept the target's most likely token when it is a child, else sample."""
    sampled = target_choices(logits, lambda x: torch.multinomial(torch.softmax(x, -1), 1, generator=gen)[:, 0])
    top = logits.argmax(-1)
    is_child = torch.zeros_like(top, dtype=torch.bool)
    for s in range(logits.shape[1]):
        parent_slot = torch.where(tree.valid, tree.parents + 1, -1)
        is_child[:, s] = ((parent_slot == s) & (tree.tokens == top[:, s:s + 1])).any(1)
    return walk(tree, torch.where(is_child, top, sampled))


def chi_square(samples: torch.Tensor) -> tuple[float, float]:
    """Statistic against the target's own joint law of the first TOKENS tokens, and the 0.999 critical value."""
    table = torch.softmax(markov_table(), -1)
    counts = torch.bincount((samples * torch.tensor([V ** 2, V, 1])).sum(1), minlength=V ** TOKENS).float()
    stat = 0.0
    for cell in range(V ** TOKENS):
        a, b, c = cell // V ** 2, cell // V % V, cell % V
        expected = TRIALS * float(table[0, a] * table[a, b] * table[b, c])
        stat += (float(counts[cell]) - expected) ** 2 / expected
    k, z = V ** TOKENS - 1, 3.09                                          # Wilson-Hilferty 0.999 quantile
    return stat, k * (1 - 2 / (9 * k) + z * math.sqrt(2 / (9 * k))) ** 3


def test_tree_sampling_is_lossless_chi_square():
    stat, critical = chi_square(generate(lossless, seed=1))
    assert stat < critical, (stat, critical)


def test_chi_square_catches_a_biased_acceptance_rule():
    stat, critical = chi_square(generate(biased, seed=1))
    assert stat > 3 * critical, (stat, critical)


# ---- cost model ---------------------------------------------------------------------------------------------------

MS = 1e-3
VERIFY = VerifyProfile(
    step_seconds={1: {0: 10 * MS, 16: 11 * MS, 32: 13 * MS},
                  8: {0: 12 * MS, 16: 20 * MS, 32: 30 * MS},
                  64: {0: 30 * MS, 16: 150 * MS, 32: 290 * MS}},
    draft_seconds={1: 2 * MS, 8: 3 * MS, 64: 5 * MS})
ACCEPT = AcceptanceProfile({16: 3.0, 32: 3.5, 64: 3.8})


def test_budget_shrinks_with_batch_and_turns_off():
    one = choose_budget(1, VERIFY, ACCEPT)
    assert one.budget == 16 and one.tokens_per_second == pytest.approx(4 / (13 * MS))
    assert one.speedup == pytest.approx(4 / 13 * 10)
    assert choose_budget(8, VERIFY, ACCEPT).budget == 16          # 4/23ms beats 4.5/33ms and 1/12ms
    sixty_four = choose_budget(64, VERIFY, ACCEPT)
    assert sixty_four.budget == 0 and sixty_four.speedup == 1.0   # 4/155ms < 1/30ms: no speculation
    assert BudgetPolicy(VERIFY, ACCEPT).budget(1) == 0           # where it speculates, plain is measured first
    policy = BudgetPolicy(VERIFY, ACCEPT, probe_steps=0)         # the profile's choices alone
    assert [policy.budget(b) for b in (1, 2, 8, 9, 64, 500)] == [16, 16, 16, 0, 0, 0]


def test_cost_model_prefers_more_nodes_when_they_pay():
    rich = AcceptanceProfile({16: 3.0, 32: 6.0})
    assert choose_budget(1, VERIFY, rich).budget == 32             # 7/15ms > 4/13ms


def test_interpolation_limits_and_memory_cap():
    assert VERIFY.step_time(1, 8) == pytest.approx(10.5 * MS)
    assert VERIFY.step_time(1, 64) is None                          # never extrapolated: budget 64 is skipped
    assert VERIFY.batch_row(3) == 8 and VERIFY.batch_row(1000) == 64
    capped = choose_budget(8, VERIFY, ACCEPT, vocab_size=49152, max_logits_bytes=8 * 10 * 49152 * 4)
    assert capped.budget == 0                                       # 8 x 17 x V logits exceed the cap
    assert AcceptanceProfile.from_rounds({16: [2, 4, 3], 32: []}).accepted == {16: 3.0}
    with pytest.raises(ValueError):
        VerifyProfile({1: {16: 1.0}})


def test_policy_reports_what_it_saw_and_why_and_its_largest_budget():
    policy = BudgetPolicy(VERIFY, ACCEPT)
    assert policy.top_budget == 16
    report = policy.describe()
    assert report["kind"] == "measured" and set(report["by_batch"]) == {"b1", "b8", "b64"}
    one, sixty_four = report["by_batch"]["b1"], report["by_batch"]["b64"]
    assert one["budget"] == 16 and one["reason"].startswith("16 nodes")
    assert one["plain_ms"] == pytest.approx(10) and one["draft_ms"] == pytest.approx(2)
    assert one["verify_ms"] == {"16": pytest.approx(11), "32": pytest.approx(13)}
    assert one["round_ms_per_token"]["16"] == pytest.approx(13 / 4)
    assert sixty_four["budget"] == 0 and sixty_four["reason"].startswith("plain 30.000 ms/token beats")
    never = BudgetPolicy(VERIFY, AcceptanceProfile({16: 0.0}))
    assert never.top_budget == 0 and all(never.budget(b) == 0 for b in (1, 8, 64))
    capped = BudgetPolicy(VERIFY, ACCEPT, vocab_size=49152, max_logits_bytes=10 * 49152 * 4)
    assert "memory cap" in capped.describe()["by_batch"]["b8"]["reason"]
    assert KneeBudgetPolicy(16).top_budget == 16 and KneeBudgetPolicy(16, knee_tokens=4).top_budget == 0
    assert FixedBudgetPolicy(5).budget(1000) == 5 and FixedBudgetPolicy(0).top_budget == 0
