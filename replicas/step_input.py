"""The per-step model input: built on rank 0 from the scheduled batch, sent as-is to the other ranks."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Optional

import numpy as np

from replicas.scheduler import ScheduledBatch


@dataclass
class StepInput:
    input_ids: np.ndarray          # [T] int64
    positions: np.ndarray          # [T] int64
    slot_mapping: np.ndarray       # [T] int64
    query_start_loc: np.ndarray    # [B+1] int32
    seq_lens: np.ndarray           # [B] int32
    block_tables: np.ndarray       # [B, max_blocks] int32
    sample_indices: np.ndarray     # [S] int64: token rows whose logits are needed (one per sampling sequence)
    tree_mask: Optional[np.ndarray] = None
    aux_layers: tuple[int, ...] = ()

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    @staticmethod
    def from_batch(batch: ScheduledBatch, block_size: int, trees: Optional[Mapping[int, "TreeRow"]] = None,
                   aux_layers: tuple[int, ...] = ()) -> "StepInput":
        """trees: batch index -> the draft tree that speculative row verifies ([root, nodes] in the scratch
        slots root .. root + N of its table, at positions root + depth + 1, every row's logits kept)."""
        # Decodes (one new token) are the common row: plain Python scalars, no per-row numpy.
        ids, pos, slots, qsl, lens, sample = [], [], [], [0], [], []
        tables = [seq.block_table for seq in batch.seqs]
        for i, (seq, n) in enumerate(zip(batch.seqs, batch.num_new_tokens)):
            start = seq.num_computed_tokens
            table = tables[i]
            if trees and i in trees:
                row = trees[i]
                ids.append(seq.token_ids[start])
                ids.extend(row.tokens)
                pos.extend(start + o for o in row.offsets)
                slots.extend(table[t // block_size] * block_size + t % block_size for t in range(start, start + n))
                qsl.append(qsl[-1] + n)
                lens.append(start + n)
                sample.extend(range(qsl[-2], qsl[-1]))
                continue
            if n == 1:
                ids.append(seq.token_ids[start])
                pos.append(start)
                slots.append(table[start // block_size] * block_size + start % block_size)
            else:
                ids.extend(seq.token_ids[start:start + n])
                p = range(start, start + n)
                pos.extend(p)
                slots.extend(table[t // block_size] * block_size + t % block_size for t in p)
            qsl.append(qsl[-1] + n)
            lens.append(start + n)
            if start + n == seq.num_tokens:          # reaches its last known token: samples
                sample.append(qsl[-1] - 1)
        width = max(map(len, tables))
        block_tables = np.zeros((len(tables), width), dtype=np.int32)
        for i, t in enumerate(tables):
            block_tables[i, : len(t)] = t
        return StepInput(
            input_ids=np.asarray(ids, dtype=np.int64), positions=np.asarray(pos, dtype=np.int64),
            slot_mapping=np.asarray(slots, dtype=np.int64), query_start_loc=np.asarray(qsl, dtype=np.int32),
            seq_lens=np.asarray(lens, dtype=np.int32), block_tables=block_tables,
            sample_indices=np.asarray(sample, dtype=np.int64),
            tree_mask=_tree_mask(batch, trees) if trees else None, aux_layers=tuple(aux_layers))


def probe_step(num_tokens: int, num_rows: int, block_size: int) -> StepInput:
    """A prefill-shaped step of `num_tokens` over `num_rows` sequences that writes no KV (slot -1) and reads only
    block 0 (always in the base region): what memory profiling runs."""
    rows = max(1, min(num_rows, num_tokens))
    lens = [num_tokens // rows + (1 if i < num_tokens % rows else 0) for i in range(rows)]
    qsl = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    width = -(-max(lens) // block_size)
    return StepInput(
        input_ids=np.zeros(num_tokens, np.int64),
        positions=np.concatenate([np.arange(n, dtype=np.int64) for n in lens]),
        slot_mapping=np.full(num_tokens, -1, np.int64), query_start_loc=qsl,
        seq_lens=np.asarray(lens, np.int32), block_tables=np.zeros((rows, width), np.int32),
        sample_indices=qsl[1:].astype(np.int64) - 1)


@dataclass
class TreeRow:
    tokens: list[int]          # N draft tokens (node order)
    offsets: list[int]         # 1+N positions relative to the root (root 0, node depth + 1)
    mask: np.ndarray           # [1+N, 1+N] bool: slot i sees slot j (itself and its ancestors)


def _tree_mask(batch: ScheduledBatch, trees: Mapping[int, TreeRow]) -> np.ndarray:
    """[B, Q, Q] over each row's new tokens: the tree rows' masks, causal for the other rows."""
    q = max(batch.num_new_tokens)
    mask = np.broadcast_to(np.tril(np.ones((q, q), dtype=bool)), (len(batch.seqs), q, q)).copy()
    for i, row in trees.items():
        m = row.mask.shape[0]
        mask[i, :m, :m] = row.mask
    return mask
