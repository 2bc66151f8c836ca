"""Offline target features: the frozen target's hidden states at the drafter's layers, computed once per pair.

Online, every training step runs the target over its batch (`TargetModel.hidden`), so each epoch pays the
target's forward again, and in the small-drafter regime that forward costs more than the drafter's whole
step. `FeatureCache` runs the target once over every pair of the worker's shard, before the first step, and the
steps read their rows from it: one index_select per step.

Layout: one flat [total_tokens + 1, features] tensor, pair i's positions at offsets[i] .. offsets[i] + len(i),
the last row zero (what padding columns read). The target runs over pairs grouped by length (at most
`tokens_per_pass` padded tokens a pass); under causal attention a position's hidden state does not depend on the
padding after it, so a row equals what the online step computes for that pair (up to the kernels' rounding).
The cache lives on the training device when it fits in half of the device's free memory, else in host memory
(pinned on CUDA), and is rebuilt by every run, resumed ones included: it is derived data, not state.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np
import torch
from torch import Tensor

from speculative.train_data import Pair, TrainBatch


class FeatureCache:
    def __init__(self, hidden, pairs: Sequence[Pair], seq_len: int, device: torch.device,
                 tokens_per_pass: int = 16384):
        """`hidden`: ids [B, T] -> features [B, T, F], the target's (`TargetModel.hidden`, under the caller's
        autocast)."""
        self.lengths = np.array([min(len(p) + len(r), seq_len) for p, r in pairs], dtype=np.int64)
        self.offsets = np.concatenate([[0], np.cumsum(self.lengths)[:-1]]).astype(np.int64)
        self.total = int(self.lengths.sum())
        self.device = torch.device(device)
        self.flat: Tensor | None = None
        order = np.argsort(-self.lengths, kind="stable")
        start = 0
        while start < len(order):
            width = int(self.lengths[order[start]])
            count = max(1, tokens_per_pass // max(width, 1))
            group = order[start:start + count]
            ids = torch.zeros(len(group), width, dtype=torch.long)
            for row, i in enumerate(group):
                seq = (list(pairs[i][0]) + list(pairs[i][1]))[:seq_len]
                ids[row, :len(seq)] = torch.tensor(seq)
            out = hidden(ids.to(self.device))
            if self.flat is None:
                self.flat = self._allocate(out.shape[-1], out.dtype)
            for row, i in enumerate(group):
                n, off = int(self.lengths[i]), int(self.offsets[i])
                self.flat[off:off + n].copy_(out[row, :n], non_blocking=True)
            start += count
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _allocate(self, features: int, dtype: torch.dtype) -> Tensor:
        nbytes = (self.total + 1) * features * dtype.itemsize
        on_device = self.device.type != "cuda" or nbytes <= torch.cuda.mem_get_info(self.device)[0] // 2
        flat = torch.empty(self.total + 1, features, dtype=dtype,
                           device=self.device if on_device else "cpu",
                           pin_memory=not on_device and self.device.type == "cuda")
        flat[-1].zero_()
        return flat

    @property
    def nbytes(self) -> int:
        return self.flat.numel() * self.flat.element_size()

    @property
    def on_device(self) -> bool:
        return self.flat.device == self.device or self.device.type == "cpu"

    def gather(self, batch: TrainBatch) -> Tensor:
        """The features of `batch`'s rows [B, T, F], zero at padding columns, on the training device."""
        b, width = batch.input_ids.shape
        cols = np.arange(width)
        rows = list(batch.pair_ids)
        index = np.where(cols[None, :] < self.lengths[rows][:, None], self.offsets[rows][:, None] + cols, self.total)
        index = torch.from_numpy(index.reshape(-1))
        if self.flat.is_cuda:
            index = index.to(self.flat.device, non_blocking=True)
        return self.flat.index_select(0, index).view(b, width, -1).to(self.device, non_blocking=True)
