"""The tree walk (speculative.acceptance.walk) in one launch, one program per request, writing the round's one
host-bound tensor directly (speculative.acceptance.walk_packed's layout).

The program holds its request's N nodes in registers and takes at most N steps from the root: at each step the
accepted node is the valid child of the current slot whose token is the target's choice there (siblings hold
distinct tokens, so there is at most one; the lowest index is taken if a tree broke that rule, as the walk by
depth does); the walk stops at the first slot with no such child, whose choice is the bonus token.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from speculative.draft_tree import DraftTree


@triton.jit
def walk_kernel(tokens, parents, valid, choices, out, N, W, NP: tl.constexpr, WP: tl.constexpr):
    b = tl.program_id(0)
    i = tl.arange(0, NP)
    inside = i < N
    tok = tl.load(tokens + b * N + i, inside, other=-1)
    par = tl.load(parents + b * N + i, inside, other=-2)
    ok = (tl.load(valid + b * N + i, inside, other=0) != 0) & inside
    # the row is built in registers and stored once: no two stores of a program write the same address
    j = tl.arange(0, WP)
    emitted = tl.full([WP], -1, tl.int64)
    path = tl.where(j == 0, 0, -1).to(tl.int64)
    cur = b * 0 - 1                 # the current node (-1: the root) and its verify slot
    slot = b * 0
    n = b * 0                       # accepted nodes so far
    going = b >= 0
    for _ in range(N):
        choice = tl.load(choices + b * W + slot).to(tl.int64)
        hit = ok & (par == cur) & (tok == choice) & going
        node = tl.min(tl.where(hit, i, NP), 0)
        found = node < NP
        emitted = tl.where((j == n) & found, choice, emitted)
        path = tl.where((j == n + 1) & found, (node + 1).to(tl.int64), path)
        n += found.to(n.dtype)
        cur = tl.where(found, node, cur)
        slot = tl.where(found, node + 1, slot)
        going = going & found
    emitted = tl.where(j == n, tl.load(choices + b * W + slot).to(tl.int64), emitted)
    row = out + b * (2 + 2 * W)
    tl.store(row + 2 + j, emitted, j < W)
    tl.store(row + 2 + W + j, path, j < W)
    tl.store(row, (n + 1).to(tl.int64))
    tl.store(row + 1, tl.sum(ok.to(tl.int64), 0))


def walk_fused(tree: DraftTree, choices: torch.Tensor) -> torch.Tensor:
    b, n = tree.tokens.shape
    out = torch.empty(b, 2 + 2 * (n + 1), dtype=torch.int64, device=choices.device)
    walk_kernel[(b,)](tree.tokens.contiguous(), tree.parents.contiguous(), tree.valid.contiguous(),
                      choices.contiguous(), out, n, n + 1, NP=triton.next_power_of_2(max(n, 1)),
                      WP=triton.next_power_of_2(n + 1), num_warps=1)
    return out
