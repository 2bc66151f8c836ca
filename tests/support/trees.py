"""Random draft trees for the acceptance tests (torch walk, Triton walk): a small vocabulary, every shape."""
from __future__ import annotations

import random

import torch

from speculative.draft_tree import DraftTree

V = 4               # vocabulary of the random trees (the acceptance tests' chi-square cells are V ** 3)


def random_trees(rng: random.Random, count: int, budget: int) -> list[DraftTree]:
    """Trees drawn from a draft distribution unrelated to the target (token 3 favoured, shapes random)."""
    trees = []
    for _ in range(count):
        tokens, parents, depths = [], [], []
        for i in range(budget):
            p = rng.choice([q for q in [-1] + list(range(i)) if sum(parents[j] == q for j in range(i)) < V])
            taken = {tokens[j] for j in range(i) if parents[j] == p}
            free = [t for t in range(V) if t not in taken]
            tokens.append(rng.choices(free, weights=[4 if t == 3 else 1 for t in free])[0])
            parents.append(p)
            depths.append(0 if p < 0 else depths[p] + 1)
        n = len(tokens)
        pad = budget - n
        trees.append(DraftTree(torch.tensor([tokens + [0] * pad]), torch.tensor([parents + [-1] * pad]),
                               torch.tensor([depths + [0] * pad]), torch.zeros(1, budget),
                               torch.tensor([[True] * n + [False] * pad])))
    return trees


def batched(trees: list[DraftTree], device="cpu") -> DraftTree:
    return DraftTree(*(torch.cat([getattr(t, f) for t in trees]).to(device) for f in
                       ("tokens", "parents", "depths", "scores", "valid")))


def following_choices(rng: random.Random, tree: DraftTree) -> torch.Tensor:
    """The target's choice at every verify slot, mostly one of the slot's drafted children (so paths reach deep)."""
    b, budget = tree.tokens.shape
    choices = torch.randint(0, V, (b, budget + 1), device=tree.tokens.device)
    for r in range(b):
        for slot in range(budget + 1):
            kids = [i for i in range(budget) if tree.valid[r, i] and tree.parents[r, i] + 1 == slot]
            if kids and rng.random() < 0.8:
                choices[r, slot] = tree.tokens[r, rng.choice(kids)]
    return choices
