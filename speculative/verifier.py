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

import numpy as np
import torch

from replicas.sampler import SamplingBatch
from replicas.sequence import Sequence
from speculative.acceptance import walk
from speculative.tree import DraftTree

if TYPE_CHECKING:
    from replicas.engine import LLMEngine
    from speculative.speculator import TreeRows


class _PathHistory:
    """Row r = (sequence b, slot s): b's prompt, or b's output followed by the tokens on the path to slot s."""

    def __init__(self, seqs: list[Sequence], rows: "TreeRows", prompt: bool):
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


def verify_round(engine: "LLMEngine", seqs: list[Sequence], tree: DraftTree, rows: "TreeRows",
                 logits: torch.Tensor, aux: list[torch.Tensor], first_rows: list[int], now: float) -> None:
    """seqs: the speculative rows of this step; rows: speculation.tree_rows(tree); logits [len(seqs) * (1+N), V]
    request-major; aux: the step's target hidden states (runner.last_aux_hidden); first_rows: each sequence's
    first token row in the step. One device-to-host copy: the walk's result."""
    width = len(rows[0].offsets)
    params = [s.params for s in seqs for _ in range(width)]
    seeds = [s.seed for s in seqs for _ in range(width)]
    offsets = np.asarray([row.offsets for row in rows], dtype=np.int64)
    positions = (np.asarray([s.num_tokens for s in seqs], dtype=np.int64)[:, None] + offsets).ravel().tolist()
    sb = SamplingBatch.build(params, seeds, positions, _PathHistory(seqs, rows, False),
                             _PathHistory(seqs, rows, True), engine.eos_token_ids,
                             engine.model_config.vocab_size, logits.device)
    out = engine.sampler(logits, sb)
    acc = walk(tree, out.token_ids.view(len(seqs), width).to(tree.tokens.device))
    host = torch.cat([acc.num_emitted[:, None], acc.tokens, acc.path_slots], 1).cpu().numpy()
    num_emitted, emitted, slots = host[:, 0], host[:, 1:1 + width], host[:, 1 + width:]
    stats = engine.stats
    stats.spec_drafts += len(seqs)
    stats.spec_draft_tokens += int(rows.valid.sum())
    stats.spec_accepted_tokens += int(num_emitted.sum()) - len(seqs)
    per_depth = (slots[:, 1:] >= 0).sum(0).tolist()
    by_pos = stats.spec_accepted_by_position
    by_pos.extend([0] * (len(per_depth) - len(by_pos)))
    for d, c in enumerate(per_depth):
        by_pos[d] += c

    bs = engine.config.block_size
    src, dst = [], []
    kept: list[tuple[Sequence, int, int, np.ndarray]] = []
    for b, seq in enumerate(seqs):
        root, count = seq.num_computed_tokens, int(num_emitted[b])
        for j, token in enumerate(emitted[b, :count].tolist()):
            engine._append_token(seq, token, out, b * width + int(slots[b, j]), now)
            if seq.is_finished:
                break
        if seq.is_finished:
            continue
        k = count - 1
        moved = np.flatnonzero(slots[b, 1:k + 1] != np.arange(1, k + 1)) + 1     # accepted nodes off their slot
        if len(moved):
            table = np.asarray(seq.block_table, dtype=np.int64)
            s, d = root + slots[b, moved], root + moved
            src.append(table[s // bs] * bs + s % bs)
            dst.append(table[d // bs] * bs + d % bs)
        kept.append((seq, root, k, first_rows[b] + slots[b, :k + 1]))
    if src:
        engine.runner.call_all("compact_kv", np.concatenate(src), np.concatenate(dst))
    bm = engine.block_manager
    for seq, root, k, _ in kept:
        seq.num_computed_tokens = root + 1 + k
        bm.commit_full_blocks(seq, root)
        bm.truncate(seq, -(-seq.num_tokens // bs))
    if kept:                                     # the root's and the accepted nodes' hidden states
        engine.speculator.observe(aux, np.concatenate([rows for *_, rows in kept]),
                                  np.concatenate([np.full(len(rows), seq.seq_id) for seq, _, _, rows in kept]),
                                  np.concatenate([root + np.arange(len(rows)) for _, root, _, rows in kept]))
