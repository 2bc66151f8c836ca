"""The verifying half of a speculative round (docs/speculative.md, steps 6-7): the target's choice at every
tree node through the engine's own Sampler, and the tree walk. The engine applies the result itself
(replicas.speculation_api.VerifiedRound): it emits the tokens and moves the accepted nodes' K/V.

Node rows are sampled like plain decoding rows: the request's params and seed, position = the index of the
token the node's row samples (next position + depth), and a history extended by the node's path (penalties,
min_tokens). So with the same seed a speculative run samples what a plain run samples from the same logits.
"""
from __future__ import annotations

from typing import Sequence as Seq

import numpy as np
import torch

from replicas.sampler import Sampler
from replicas.sampling_batch import SamplingBatch
from replicas.sequence import Sequence
from replicas.speculation_api import DraftProposal, VerifiedRound
from speculative.acceptance import walk
from speculative.speculator import TreeRows


class _PathHistory:
    """Row r = (sequence b, slot s): b's prompt, or b's output followed by the tokens on the path to slot s."""

    def __init__(self, seqs: Seq[Sequence], rows: TreeRows, prompt: bool):
        self.seqs, self.rows, self.parents, self.prompt = seqs, rows, rows.parents, prompt
        self.width = len(rows[0].offsets)

    def __len__(self) -> int:
        return len(self.seqs) * self.width

    def __getitem__(self, r: int) -> list[int]:
        b, slot = divmod(r, self.width)
        seq = self.seqs[b]
        if self.prompt:
            return seq.prompt_token_ids
        path, node = [], slot - 1
        while node >= 0:
            path.append(self.rows[b].tokens[node])
            node = int(self.parents[b, node])
        return seq.output_token_ids + path[::-1]


class TreeVerifier:
    """Samples every tree node with the engine's sampler and walks each tree from its root."""

    def __init__(self, sampler: Sampler, eos_token_ids: tuple[int, ...], vocab_size: int):
        self.sampler, self.eos_token_ids, self.vocab_size = sampler, eos_token_ids, vocab_size

    def verify(self, seqs: Seq[Sequence], proposal: DraftProposal, logits: torch.Tensor) -> VerifiedRound:
        """One device-to-host copy: the walk's result."""
        rows, tree = proposal.rows, proposal.trees
        width = len(rows[0].offsets)
        params = [s.params for s in seqs for _ in range(width)]
        seeds = [s.seed for s in seqs for _ in range(width)]
        offsets = np.asarray([row.offsets for row in rows], dtype=np.int64)
        positions = (np.asarray([s.num_tokens for s in seqs], dtype=np.int64)[:, None] + offsets).ravel().tolist()
        sb = SamplingBatch.build(params, seeds, positions, _PathHistory(seqs, rows, False),
                                 _PathHistory(seqs, rows, True), self.eos_token_ids, self.vocab_size, logits.device)
        out = self.sampler(logits, sb)
        acc = walk(tree, out.token_ids.view(len(seqs), width).to(tree.tokens.device))
        host = torch.cat([acc.num_emitted[:, None], acc.tokens, acc.path_slots], 1).cpu().numpy()
        return VerifiedRound(num_emitted=host[:, 0], tokens=host[:, 1:1 + width], path_slots=host[:, 1 + width:],
                             sampled=out, width=width, num_draft_tokens=int(rows.valid.sum()))
