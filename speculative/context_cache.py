"""The drafter's target context for every running sequence, kept across rounds in pages of one pool.

Each computed token's context keys/values (the drafter's `BlockDrafter.context` of its target hidden states,
RoPE applied at its absolute position) are computed once, when the token is computed, and written to its
sequence's next free context slot. A round gathers the batch's contexts with one indexing op over the pool
(page tables uploaded once), so its cost does not grow with per-sequence work, and nothing is recomputed.

Bookkeeping is on the host: per sequence its pages, its length and its runs of consecutive positions (a
prefix-cache hit leaves a gap: those positions were never computed here). Writing from position p keeps only
the entries below p (a preempted sequence recomputes from its start). The pool doubles when it runs out of
pages; page ids stay valid across growth.
"""
from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

from replicas.transfer import to_device
from speculative.drafter import DraftContext


class PagedDraftContext:
    def __init__(self, num_layers: int, kv_heads: int, head_dim: int, dtype: torch.dtype, device: torch.device,
                 page_size: int = 32, num_pages: int = 64):
        self.page_size = page_size
        self.pool = torch.zeros(num_layers, 2, num_pages, page_size, kv_heads, head_dim, dtype=dtype,
                                device=device)
        self.free: list[int] = list(range(num_pages - 1, -1, -1))
        self.pages: dict[int, list[int]] = {}
        self.lengths: dict[int, int] = {}
        self.runs: dict[int, list[tuple[int, int]]] = {}      # (first position, first entry) per run

    @property
    def device(self) -> torch.device:
        return self.pool.device

    def length(self, seq_id: int) -> int:
        return self.lengths.get(seq_id, 0)

    def positions(self, seq_id: int) -> list[int]:
        """Absolute positions of the sequence's entries, in order (for tests and checks)."""
        runs, n = self.runs.get(seq_id, []), self.length(seq_id)
        ends = [e for _, e in runs[1:]] + [n]
        return [p + i for (p, e), end in zip(runs, ends) for i in range(end - e)]

    def _kept(self, seq_id: int, position: int) -> int:
        """Entries at positions below `position`; drops the runs at or above it."""
        runs = self.runs.setdefault(seq_id, [])
        n = self.length(seq_id)
        while runs:
            p, e = runs[-1]
            if p < position:
                return min(n, e + position - p)
            runs.pop()
            n = e
        return 0

    def reserve(self, seq_id: int, position: int, count: int) -> list[int]:
        """Room for `count` entries at positions position .. +count-1 (after cutting back to below
        `position`); returns their flat pool slots (page * page_size + offset). A decode's single entry takes
        the scalar path: this runs once per sequence per step."""
        start = self._kept(seq_id, position)
        runs = self.runs[seq_id]
        if not runs or runs[-1][0] + start - runs[-1][1] != position:
            runs.append((position, start))
        end = start + count
        pages = self.pages.setdefault(seq_id, [])
        need = -(-end // self.page_size) - len(pages)
        if need > 0:
            if need > len(self.free):
                self._grow(need - len(self.free))
            pages.extend(self.free.pop() for _ in range(need))
        self.lengths[seq_id] = end
        size = self.page_size
        if count == 1:
            return [pages[start // size] * size + start % size]
        idx = np.arange(start, end)
        return (np.asarray(pages, dtype=np.int64)[idx // size] * size + idx % size).tolist()

    def _grow(self, at_least: int) -> None:
        old = self.pool.shape[2]
        new = max(2 * old, old + at_least)
        pool = self.pool.new_zeros(*self.pool.shape[:2], new, *self.pool.shape[3:])
        pool[:, :, :old] = self.pool
        self.pool = pool
        self.free = list(range(new - 1, old - 1, -1)) + self.free

    def write(self, slots: Tensor, ctx: DraftContext) -> None:
        """Store the entries of a flat context (keys/values [1, R, kv_heads, head_dim] per layer) at `slots` [R]."""
        flat = self.pool.view(*self.pool.shape[:2], -1, *self.pool.shape[4:])
        flat[:, :, slots] = torch.stack([torch.stack([k[0], v[0]]) for k, v in zip(ctx.keys, ctx.values)])

    def gather(self, seq_ids: list[int]) -> DraftContext:
        """The batch's contexts, right-padded to the longest, as the drafter's attention reads them."""
        lengths = [self.length(s) for s in seq_ids]
        t = max(lengths, default=0)
        table = np.zeros((len(seq_ids), 1 + max(1, -(-t // self.page_size))), dtype=np.int64)
        table[:, 0] = lengths                                   # one upload: lengths, then page tables
        width = table.shape[1] - 1
        for b, s in enumerate(seq_ids):
            pages = self.pages.get(s, [])[:width]
            table[b, 1:1 + len(pages)] = pages
        packed = to_device(table, self.device)
        g = self.pool[:, :, packed[:, 1:]].flatten(3, 4)[:, :, :, :t]    # [L, 2, B, T, kv_heads, head_dim]
        valid = torch.arange(t, device=self.device)[None] < packed[:, :1]
        return DraftContext(list(g[:, 0].unbind(0)), list(g[:, 1].unbind(0)), valid)

    def forget(self, seq_id: int) -> None:
        self.free.extend(reversed(self.pages.pop(seq_id, [])))
        self.lengths.pop(seq_id, None)
        self.runs.pop(seq_id, None)
