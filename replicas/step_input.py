"""The per-step model input: built on rank 0 from the scheduled batch and sent to the other ranks (its draft trees,
device tensors, apart: ModelRunner.execute)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch
from torch import Tensor

from replicas.scheduler import ScheduledBatch
from replicas.transfer import to_device


@dataclass
class StepInput:
    input_ids: np.ndarray          # [T] int64
    positions: np.ndarray          # [T] int64
    slot_mapping: np.ndarray       # [T] int64
    query_start_loc: np.ndarray    # [B+1] int32
    seq_lens: np.ndarray           # [B] int32
    block_tables: np.ndarray       # [B, max_blocks] int32
    sample_indices: np.ndarray     # [S] int64: token rows whose logits are needed (one per sampling sequence)
    trees: Optional["StepTrees"] = None     # the draft trees its speculative rows verify
    aux_layers: tuple[int, ...] = ()
    device_input_ids: Optional[Tensor] = None   # [K] int64 on the device: input ids 0..K-1, in place of the host's

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    @staticmethod
    def from_batch(batch: ScheduledBatch, block_size: int, trees: Optional["StepTrees"] = None,
                   aux_layers: tuple[int, ...] = (), ahead_tokens: Optional[Tensor] = None) -> "StepInput":
        """trees: the draft trees of the speculative rows (trees.index), [root, nodes] in the scratch slots
        root .. root + N of each table, every row's logits kept; the host arrays hold the root's token and
        position in each of a tree's slots (`StepTrees.write` puts the rest in on the device).
        ahead_tokens: the device tokens of the batch's first `batch.ahead` rows (async scheduling), each decoded at
        position `num_tokens` of its sequence (the token is not in its token_ids yet)."""
        # Decodes (one new token) are the common row: plain Python scalars, no per-row numpy.
        ids, pos, slots, qsl, lens, sample = [], [], [], [0], [], []
        tables = [seq.block_table for seq in batch.seqs]
        tree_rows = set(trees.index.tolist()) if trees is not None else ()
        for i, (seq, n) in enumerate(zip(batch.seqs, batch.num_new_tokens)):
            table = tables[i]
            if i < batch.ahead:
                p = seq.num_tokens
                ids.append(0)
                pos.append(p)
                slots.append(table[p // block_size] * block_size + p % block_size)
                qsl.append(qsl[-1] + 1)
                lens.append(p + 1)
                sample.append(i)
                continue
            start = seq.num_computed_tokens
            if i in tree_rows:
                ids.extend([seq.token_ids[start]] * n)
                pos.extend([start] * n)
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
            sample_indices=np.asarray(sample, dtype=np.int64), trees=trees, aux_layers=tuple(aux_layers),
            device_input_ids=ahead_tokens)


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
class DraftRows:
    """K draft trees of N nodes as a verify step reads them, on the device: slot 0 is the root, slot i node i - 1."""
    tokens: Tensor             # [K, N] long: the draft tokens, in node order
    offsets: Tensor            # [K, 1+N] long: each slot's position relative to the root (root 0, node depth + 1)
    mask: Tensor               # [K, 1+N, 1+N] bool: slot i sees slot j (j is i or an ancestor of i)

    @property
    def width(self) -> int:
        return self.offsets.shape[1]

    def packed(self) -> Tensor:
        """[K, N + (1+N) + (1+N)^2] long: all three in one tensor, for one collective to the other TP ranks."""
        k = self.tokens.shape[0]
        return torch.cat([self.tokens, self.offsets, self.mask.reshape(k, -1).long()], 1)

    @staticmethod
    def unpacked(packed: Tensor, width: int) -> "DraftRows":
        n = width - 1
        return DraftRows(packed[:, :n], packed[:, n:n + width],
                         packed[:, n + width:].reshape(-1, width, width).bool())

    @staticmethod
    def packed_size(width: int) -> int:
        return width - 1 + width + width * width


@dataclass
class StepTrees:
    """The draft trees a step verifies: batch row index[k] verifies tree k of `rows`. They stay on the device, so
    building and launching the verify step never waits for the drafter."""
    index: np.ndarray          # [K] int64: batch rows, ascending
    rows: Optional[DraftRows]  # None in the copy rank 0 pickles to the other ranks (they receive the tensors)

    def width(self, query_start_loc: np.ndarray) -> int:
        return int(query_start_loc[self.index[0] + 1] - query_start_loc[self.index[0]])

    def write(self, query_start_loc: np.ndarray, input_ids: Tensor, positions: Tensor, mask: Tensor) -> None:
        """Complete a step's device inputs: input_ids and positions [T] as copied from the host (a tree row holds
        its root's token and position in every slot), mask [B, Q, Q] (any content) becomes the tree masks on the
        tree rows and causal on the others."""
        rows, w = self.rows, self.rows.width
        b = len(query_start_loc) - 1
        if len(self.index) == b and mask.shape[1] == w and int(query_start_loc[-1]) == b * w:
            input_ids[:b * w].view(b, w)[:, 1:].copy_(rows.tokens)     # every row a tree: views, no index
            positions[:b * w].view(b, w).add_(rows.offsets)
            mask.copy_(rows.mask)
            return
        q = mask.shape[1]
        mask.copy_(torch.ones(q, q, dtype=torch.bool, device=mask.device).tril_().expand(b, q, q))
        first = query_start_loc[self.index].astype(np.int64)
        slots = to_device(first[:, None] + np.arange(w), input_ids.device)
        input_ids[slots[:, 1:]] = rows.tokens
        positions[slots] += rows.offsets
        mask[to_device(self.index, mask.device), :w, :w] = rows.mask
