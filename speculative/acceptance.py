"""Tree verification: which drafted nodes the target accepts, and the tokens a round emits.

The target runs once over [root, node 0 .. node N-1] with the tree mask; its logits at verify slot s (root = 0,
node i = 1+i) are its next-token distribution after the path ending at s. At every slot we draw the target's
own choice y_s: the argmax at T=0, else `sample_fn` (the same logits processors plain decoding uses). From the
root we walk while y_s is one of the current slot's children; the first y_s that is not becomes the bonus
token. Every emitted token is the target's own draw after the committed prefix plus the accepted path, so the
output has exactly the target's distribution whatever the tree (lossless). No min(1, p/q) on top-k children,
no acceptance threshold below 1: both bias the output.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch
from torch import Tensor

from speculative.draft_tree import DraftTree
from speculative.tree import on_triton

SampleFn = Callable[[Tensor], Tensor]   # logits [rows, V] -> token ids [rows]


@dataclass
class Acceptance:
    path: Tensor                # [B, N] accepted node indices in path order, -1 padded
    num_accepted: Tensor        # [B] accepted draft tokens
    tokens: Tensor              # [B, N+1] emitted tokens: the accepted path then the bonus token, -1 padded
    num_emitted: Tensor         # [B] = num_accepted + 1
    path_slots: Tensor          # [B, N+1] verify slots to keep (KV, hidden states): root 0, then 1+node; -1 padded
    accepted_per_depth: Tensor  # [N] how many requests accepted a token at depth d (for metrics)


def target_choices(target_logits: Tensor, sample_fn: Optional[SampleFn] = None) -> Tensor:
    """target_logits [B, 1+N, V] -> the target's token at every verify slot [B, 1+N] (argmax if no sample_fn).
    sample_fn sees the logits flattened request-major: row b*(1+N)+s is request b, slot s."""
    if sample_fn is None:
        return target_logits.argmax(-1)
    b, slots, v = target_logits.shape
    return sample_fn(target_logits.reshape(b * slots, v)).view(b, slots)


def accept(tree: DraftTree, target_logits: Tensor, sample_fn: Optional[SampleFn] = None) -> Acceptance:
    return walk(tree, target_choices(target_logits, sample_fn))


def walk(tree: DraftTree, choices: Tensor) -> Acceptance:
    """choices [B, 1+N]: the target's token at each verify slot. A fixed number of batched ops (log2 N pointer
    jumps), no loop over depths and no host sync.

    A node is accepted iff its token is the target's choice at its parent's slot and its parent is accepted (the
    root always is). Siblings hold distinct tokens, so the accepted nodes form one path from the root with one
    node per depth: the path's d-th node is the accepted node at depth d."""
    b, n = tree.tokens.shape
    parent_slot = torch.where(tree.valid, tree.parents + 1, 0)
    ok = tree.valid & (tree.tokens == choices.gather(1, parent_slot))   # matches its parent's choice
    up = torch.where(tree.valid, tree.parents, -1)                       # -1: the root (always accepted)
    for _ in range(max(1, n - 1).bit_length()):                          # every ancestor within 2^k levels
        has_up = up >= 0
        ok = ok & (~has_up | ok.gather(1, up.clamp(min=0)))
        up = torch.where(has_up, up.gather(1, up.clamp(min=0)), -1)
    num_accepted = ok.sum(1)
    nodes = torch.arange(n, device=ok.device).expand(b, n)
    path = torch.full((b, n + 1), -1, dtype=torch.long, device=ok.device)
    path.scatter_(1, torch.where(ok, tree.depths, n), torch.where(ok, nodes, -1))   # column n: not accepted
    path = path[:, :n]
    last = path.gather(1, (num_accepted - 1).clamp(min=0)[:, None])[:, 0]
    cur = torch.where(num_accepted > 0, last + 1, 0)                     # the last accepted slot (root: 0)
    bonus = choices.gather(1, cur[:, None])
    tokens = torch.where(path >= 0, tree.tokens.gather(1, path.clamp(min=0)), -1)
    tokens = torch.cat([tokens, torch.full_like(tokens[:, :1], -1)], 1).scatter(1, num_accepted[:, None], bonus)
    slots = torch.cat([torch.zeros_like(path[:, :1]), torch.where(path >= 0, path + 1, -1)], 1)
    return Acceptance(path, num_accepted, tokens, num_accepted + 1, slots, (path >= 0).sum(0))


def walk_packed(tree: DraftTree, choices: Tensor) -> Tensor:
    """[B, 2 + 2W] int64, W = 1 + N: per request the number of emitted tokens, the tree's node count, the emitted
    tokens and the path slots (walk()'s `tokens` and `path_slots`), the one tensor a round copies to the host.
    One launch where the tree runs on Triton (speculative.kernels.tree_walk), walk()'s ops elsewhere."""
    if on_triton(choices):
        from speculative.kernels.tree_walk import walk_fused
        return walk_fused(tree, choices)
    acc = walk(tree, choices)
    return torch.cat([acc.num_emitted[:, None], tree.num_nodes[:, None], acc.tokens, acc.path_slots], 1)
