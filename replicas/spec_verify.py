"""The verifying half of a speculative round (docs/speculative.md, steps 6-7): the target's choice at every
tree node through the engine's own Sampler, the tree walk, the emitted tokens, and the KV of the accepted path.

Node rows are sampled like plain decoding rows: the request's params and seed, position = the index of the
token the node's row samples (next position + depth), and a history extended by the node's path (penalties,
min_tokens). So with the same seed a speculative run samples what a plain run samples from the same logits.
After the walk, the accepted nodes' K/V move from their scratch slots (root + 1 + node index) to the
contiguous slots root + 1 .. root + k, and the sequence has root + 1 + k computed tokens (the bonus token is
the next round's root).
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from replicas.sampler import SamplingBatch
from replicas.sequence import Sequence
from replicas.step_input import TreeRow
from speculative.acceptance import walk
from speculative.tree import DraftTree

if TYPE_CHECKING:
    from replicas.engine import LLMEngine


class _PathHistory:
    """Row r = (sequence b, slot s): b's prompt, or b's output followed by the tokens on the path to slot s."""

    def __init__(self, seqs: list[Sequence], rows: list[TreeRow], parents: list[list[int]], prompt: bool):
        self.seqs, self.rows, self.parents, self.prompt = seqs, rows, parents, prompt
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
            node = self.parents[b][node]
        return seq.output_token_ids + path[::-1]


def verify_round(engine: "LLMEngine", seqs: list[Sequence], tree: DraftTree, rows: list[TreeRow],
                 logits: torch.Tensor, aux: list[torch.Tensor], first_rows: list[int], now: float) -> None:
    """seqs: the speculative rows of this step; logits [len(seqs) * (1+N), V] request-major; aux: the step's
    target hidden states (runner.last_aux_hidden); first_rows: each sequence's first token row in the step."""
    width = len(rows[0].offsets)
    parents = tree.parents.tolist()
    params = [s.params for s in seqs for _ in range(width)]
    seeds = [s.seed for s in seqs for _ in range(width)]
    positions = [s.num_tokens + o for s, row in zip(seqs, rows) for o in row.offsets]
    sb = SamplingBatch.build(params, seeds, positions, _PathHistory(seqs, rows, parents, False),
                             _PathHistory(seqs, rows, parents, True), engine.eos_token_ids,
                             engine.model_config.vocab_size, logits.device)
    out = engine.sampler(logits, sb)
    acc = walk(tree, out.token_ids.view(len(seqs), width))
    stats = engine.stats
    stats.spec_drafts += len(seqs)
    stats.spec_draft_tokens += int(tree.valid.sum())
    stats.spec_accepted_tokens += int(acc.num_accepted.sum())
    per_depth = acc.accepted_per_depth.tolist()
    by_pos = stats.spec_accepted_by_position
    by_pos.extend([0] * (len(per_depth) - len(by_pos)))
    for d, c in enumerate(per_depth):
        by_pos[d] += c

    bs = engine.config.block_size
    src, dst = [], []
    kept: list[tuple[Sequence, int, int, list[int]]] = []
    for b, (seq, emitted, count, slots) in enumerate(zip(seqs, acc.tokens.tolist(), acc.num_emitted.tolist(),
                                                         acc.path_slots.tolist())):
        root = seq.num_computed_tokens
        for j in range(count):
            engine._append_token(seq, emitted[j], out, b * width + slots[j], now)
            if seq.is_finished:
                break
        if seq.is_finished:
            continue
        k = count - 1
        table = seq.block_table
        for j in range(1, k + 1):
            s, d = root + slots[j], root + j
            if s != d:
                src.append(table[s // bs] * bs + s % bs)
                dst.append(table[d // bs] * bs + d % bs)
        kept.append((seq, root, k, [first_rows[b] + s for s in slots[:k + 1]]))
    if src:
        engine.runner.call_all("compact_kv", src, dst)
    bm = engine.block_manager
    for seq, root, k, hidden_rows in kept:
        seq.num_computed_tokens = root + 1 + k
        bm.commit_full_blocks(seq, root)
        bm.truncate(seq, -(-seq.num_tokens // bs))
        spec = engine.speculator
        spec.observe(seq, spec.target_hidden(aux, torch.tensor(hidden_rows)), [root + j for j in range(k + 1)])
