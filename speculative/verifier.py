"""The verifying half of a speculative round (docs/speculative.md, steps 6-7): the target's choice at every
tree node through the engine's own Sampler, and the tree walk. The engine applies the result itself
(replicas.speculation_api.VerifiedRound): it emits the tokens and moves the accepted nodes' K/V.

Node rows are sampled like plain decoding rows: the request's params and seed, position = the index of the
token the node's row samples (next position + depth), and a history extended by the node's path (penalties,
min_tokens). So with the same seed a speculative run samples what a plain run samples from the same logits.
"""
from __future__ import annotations

from typing import Sequence as Seq

import torch

from replicas.sampler import Sampler
from replicas.sampling_batch import SamplingBatch, SequenceTokens
from replicas.sequence import Sequence
from replicas.speculation_api import DraftProposal, VerifiedRound
from speculative.acceptance import walk_packed
from speculative.draft_tree import DraftTree


class _PathHistory:
    """Row r = (sequence b, slot s): b's prompt, or b's output followed by the tokens on the path to slot s. Only
    penalties and min_tokens read it (SamplingBatch.build): the trees' one host copy is made then, on first use."""

    def __init__(self, seqs: Seq[Sequence], tree: DraftTree, width: int, prompt: bool):
        self.seqs, self.tree, self.width, self.prompt = seqs, tree, width, prompt
        self._host = None

    def __len__(self) -> int:
        return len(self.seqs) * self.width

    def __getitem__(self, r: int) -> list[int]:
        b, slot = divmod(r, self.width)
        seq = self.seqs[b]
        if self.prompt:
            return seq.prompt_token_ids
        if self._host is None:
            self._host = torch.stack([self.tree.tokens, self.tree.parents]).cpu().numpy()
        tokens, parents = self._host
        path, node = [], slot - 1
        while node >= 0:
            path.append(int(tokens[b, node]))
            node = int(parents[b, node])
        return seq.output_token_ids + path[::-1]


class TreeVerifier:
    """Samples every tree node with the engine's sampler and walks each tree from its root."""

    def __init__(self, sampler: Sampler, eos_token_ids: tuple[int, ...], vocab_size: int):
        self.sampler, self.eos_token_ids, self.vocab_size = sampler, eos_token_ids, vocab_size

    def verify(self, seqs: Seq[Sequence], proposal: DraftProposal, logits: torch.Tensor) -> VerifiedRound:
        """One device-to-host copy: the walk's result (a second, of the trees, for rows with penalties or a
        min_tokens still ahead). Without those, the sampling parameters are built per sequence and repeated on the
        device for its tree's rows."""
        tree: DraftTree = proposal.trees
        width = proposal.rows.width
        if any(s.params.penalized or s.num_output_tokens < s.params.min_tokens for s in seqs):
            # histories that differ along each tree path: one row per node, its path's tokens included
            sb = SamplingBatch.build([s.params for s in seqs for _ in range(width)],
                                     [s.seed for s in seqs for _ in range(width)],
                                     [s.num_tokens for s in seqs for _ in range(width)],
                                     _PathHistory(seqs, tree, width, False), _PathHistory(seqs, tree, width, True),
                                     self.eos_token_ids, self.vocab_size, logits.device)
        else:                        # every node row samples with its sequence's params and seed
            sb = SamplingBatch.build([s.params for s in seqs], [s.seed for s in seqs], [s.num_tokens for s in seqs],
                                     SequenceTokens(seqs, False), SequenceTokens(seqs, True), self.eos_token_ids,
                                     self.vocab_size, logits.device).repeat_rows(width)
        if not sb.all_greedy:        # a random row samples the token at root + its slot's offset
            sb.positions = sb.positions + proposal.rows.offsets.reshape(-1).to(logits.device)[sb.random_rows]
        out = self.sampler(logits, sb)
        host = walk_packed(tree, out.token_ids.view(len(seqs), width).to(tree.tokens.device)).cpu().numpy()
        return VerifiedRound(num_emitted=host[:, 0], tokens=host[:, 2:2 + width], path_slots=host[:, 2 + width:],
                             sampled=out, width=width, num_draft_tokens=int(host[:, 1].sum()))
