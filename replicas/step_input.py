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
        ids, pos, slots, qsl, lens, tables, sample = [], [], [], [0], [], [], []
        for i, (seq, n) in enumerate(zip(batch.seqs, batch.num_new_tokens)):
            start, end = seq.num_computed_tokens, seq.num_computed_tokens + n
            ids.append(np.asarray(seq.token_ids[start:end], dtype=np.int64))
            p = np.arange(start, end, dtype=np.int64)
            pos.append(p)
            table = np.asarray(seq.block_table, dtype=np.int64)
            slots.append(table[p // block_size] * block_size + p % block_size)
            qsl.append(qsl[-1] + n)
            lens.append(end)
            tables.append(seq.block_table)
            if batch.samples(i):
                sample.append(qsl[-1] - 1)
        width = max(len(t) for t in tables)
        block_tables = np.zeros((len(tables), width), dtype=np.int32)
        for i, t in enumerate(tables):
            block_tables[i, : len(t)] = t
        return StepInput(
            input_ids=np.concatenate(ids), positions=np.concatenate(pos), slot_mapping=np.concatenate(slots),
            query_start_loc=np.asarray(qsl, dtype=np.int32), seq_lens=np.asarray(lens, dtype=np.int32),
            block_tables=block_tables, sample_indices=np.asarray(sample, dtype=np.int64))
