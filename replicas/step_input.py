"""The per-step model input: built on rank 0 from the scheduled batch, sent as-is to the other ranks."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

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
    def from_batch(batch: ScheduledBatch, block_size: int) -> "StepInput":
        # Decodes (one new token) are the common row: plain Python scalars, no per-row numpy.
        ids, pos, slots, qsl, lens, sample = [], [], [], [0], [], []
        tables = [seq.block_table for seq in batch.seqs]
        for i, (seq, n) in enumerate(zip(batch.seqs, batch.num_new_tokens)):
            start = seq.num_computed_tokens
            table = tables[i]
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
            sample_indices=np.asarray(sample, dtype=np.int64))
