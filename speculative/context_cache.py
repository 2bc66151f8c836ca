"""The drafter's target context for every running sequence, kept across rounds in pages of one pool.

Each computed token's context keys/values (the drafter's `BlockDrafter.context` of its target hidden states,
RoPE applied at its absolute position) are computed once, when the token is computed, and written to its
sequence's next free context slot. A round gathers the batch's contexts with one indexing op over the pool
(page tables uploaded once), so its cost does not grow with per-sequence work, and nothing is recomputed.

Bookkeeping is on the host: per sequence its pages, its length and its runs of consecutive positions (a
prefix-cache hit leaves a gap: those positions were never computed here). Writing from position p keeps only
the entries below p (a preempted sequence recomputes from its start). The pool doubles when it runs out of
pages; page ids stay valid across growth, but the pool's memory moves (`pool_id` changes: a CUDA graph that
reads or writes the pool must be captured again). One scratch page past the pool's pages (`scratch_slot`)
takes the writes of padded rows, so a padded write never touches a sequence's entry.

Static-shape paths (speculative/context_graphs.py, speculative/drafter_graphs.py) split a gather in two: the
host fills a page table (`fill_table`), and `gather_into` copies those pages into caller-owned buffers with one
index op, nothing allocated, so it can be captured in a graph.

Observations are deferred (`PendingObservations`): a step only records which rows of its target hidden states
belong to which sequence and position; the projection into context K/V runs once for many steps' rows, when a
drafting round needs the contexts or the held rows pass a bound. A step that does not draft pays no drafter work.
"""
from __future__ import annotations

import itertools
from typing import Optional

import numpy as np
import torch
from torch import Tensor

from replicas.transfer import to_device
from speculative.drafter import DraftContext

_POOL_IDS = itertools.count()


def next_power_of_two(n: int) -> int:
    """The smallest power of two >= n (1 for n <= 1): the buckets that keep the draft side's shapes few."""
    return 1 << max(0, n - 1).bit_length()


class PagedDraftContext:
    def __init__(self, num_layers: int, kv_heads: int, head_dim: int, dtype: torch.dtype, device: torch.device,
                 page_size: int = 32, num_pages: int = 64):
        self.page_size = page_size
        self._allocate(torch.zeros(num_layers, 2, num_pages + 1, page_size, kv_heads, head_dim, dtype=dtype,
                                   device=device))
        self.free: list[int] = list(range(num_pages - 1, -1, -1))
        self.pages: dict[int, list[int]] = {}
        self.lengths: dict[int, int] = {}
        self.runs: dict[int, list[tuple[int, int]]] = {}      # (first position, first entry) per run

    def _allocate(self, storage: Tensor) -> None:
        """storage: [layers, 2, pages + 1, page_size, kv_heads, head_dim]; its last page is the scratch page."""
        self.storage = storage
        self.pool = storage[:, :, :-1]                       # the sequences' pages
        self.flat = storage.view(*storage.shape[:2], -1, *storage.shape[4:])      # slot-indexed, scratch included
        self.scratch_slot = self.pool.shape[2] * self.page_size
        self.pool_id = next(_POOL_IDS)                       # new memory: graphs over the old pool are stale

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

    def reserve_rows(self, seq_ids: np.ndarray, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """`reserve` for rows in time order (row i: seq_ids[i]'s token at positions[i]), one call per run of
        consecutive positions of a sequence. Returns (slots, keep): a later row of the same sequence at or below
        an earlier one's position (a recompute after preemption) takes its slot, so only the last writer of each
        slot is kept."""
        order = np.argsort(seq_ids, kind="stable")
        s, p = seq_ids[order], positions[order]
        cuts = np.flatnonzero((s[1:] != s[:-1]) | (p[1:] != p[:-1] + 1)) + 1
        bounds = np.concatenate([[0], cuts, [len(s)]]).tolist()
        slots = np.empty(len(s), np.int64)
        for a, e in zip(bounds[:-1], bounds[1:]):
            slots[a:e] = self.reserve(int(s[a]), int(p[a]), e - a)
        out = np.empty_like(slots)
        out[order] = slots
        if len(cuts) == 0 or len(np.unique(out)) == len(out):
            return out, np.ones(len(out), dtype=bool)
        last = len(out) - 1 - np.unique(out[::-1], return_index=True)[1]
        keep = np.zeros(len(out), dtype=bool)
        keep[last] = True
        return out, keep

    def _grow(self, at_least: int) -> None:
        old = self.pool.shape[2]
        new = max(2 * old, old + at_least)
        storage = self.storage.new_zeros(*self.storage.shape[:2], new + 1, *self.storage.shape[3:])
        storage[:, :, :old] = self.pool
        self._allocate(storage)
        self.free = list(range(new - 1, old - 1, -1)) + self.free

    def write(self, slots: Tensor, ctx: DraftContext) -> None:
        """Store the entries of a flat context (keys/values [1, R, kv_heads, head_dim] per layer) at `slots` [R]
        (`scratch_slot`: nowhere that is read)."""
        self.flat[:, :, slots] = torch.stack([torch.stack([k[0], v[0]]) for k, v in zip(ctx.keys, ctx.values)])

    def page_bucket(self, seq_ids: list[int]) -> int:
        """Pages per sequence of the batch's gather: the longest context's, rounded up to a power of two. The bucket
        matters on CUDA: every new attention shape costs a fresh kernel plan, and the exact longest length would be
        a new shape every round; buckets keep the shapes to a handful."""
        longest = max((self.length(s) for s in seq_ids), default=0)
        return next_power_of_two(-(-longest // self.page_size))

    def fill_table(self, seq_ids: list[int], lengths: np.ndarray, pages: np.ndarray) -> None:
        """Host half of a gather: rows [:B] of `lengths` [lanes] and `pages` [lanes, width] get each sequence's
        length and page ids (the caller zeroes the rest: rows past a context read page 0, masked)."""
        width = pages.shape[1]
        for b, s in enumerate(seq_ids):
            lengths[b] = self.length(s)
            own = self.pages.get(s, [])[:width]
            pages[b, :len(own)] = own

    def gather_into(self, lengths: Tensor, pages: Tensor, kv_out: Tensor, valid_out: Tensor,
                    slot_index: Tensor) -> None:
        """Device half of a gather, into caller-owned buffers, nothing allocated: kv_out [2 (keys, values),
        layers, lanes, width * page_size, kv_heads, head_dim] gets the pages `pages` [lanes, width] name,
        valid_out [lanes, width * page_size] is slot_index (arange(width * page_size)) < lengths [lanes]."""
        two, layers, lanes = kv_out.shape[:3]
        out = kv_out.view(two, layers, pages.numel(), *self.pool.shape[3:])
        torch.index_select(self.pool.transpose(0, 1), 2, pages.view(-1), out=out)
        torch.lt(slot_index, lengths[:, None], out=valid_out)

    def gather(self, seq_ids: list[int]) -> DraftContext:
        """The batch's contexts as the drafter's attention reads them, right-padded to `page_bucket` pages."""
        width = self.page_bucket(seq_ids)
        table = np.zeros((len(seq_ids), 1 + width), dtype=np.int64)      # one upload: lengths, then page tables
        self.fill_table(seq_ids, table[:, 0], table[:, 1:])
        packed = to_device(table, self.device)
        g = self.pool[:, :, packed[:, 1:]].flatten(3, 4)              # [L, 2, B, T, kv_heads, head_dim]
        valid = torch.arange(width * self.page_size, device=self.device)[None] < packed[:, :1]
        return DraftContext(list(g[:, 0].unbind(0)), list(g[:, 1].unbind(0)), valid)

    def forget(self, seq_id: int) -> None:
        self.free.extend(reversed(self.pages.pop(seq_id, [])))
        self.lengths.pop(seq_id, None)
        self.runs.pop(seq_id, None)


class PendingObservations:
    """Computed tokens whose drafter context is not written yet: per recorded step, its target hidden states
    (one [T, hidden] tensor per aux layer, kept alive here) and, per used row, the sequence and position.

    Recording is a few numpy calls per step, whatever the batch. `take` gathers every held row, in record order,
    as [R, layers * hidden] in the drafter's layer order. Rows of a sequence recorded before it was forgotten are
    dropped (a finished sequence's id is never observed again; the profile's stand-in ids may be)."""

    def __init__(self, layer_order: list[int], max_held_rows: int = 2048):
        self.layer_order = layer_order
        self.max_held_rows = max_held_rows
        self.segments: list[list] = []        # [aux, rows (None: all), seq_ids, positions]
        self.held_rows = 0
        self.recorded = 0                     # rows recorded so far (the forgotten marks count in these)
        self.forgotten: dict[int, int] = {}   # seq_id -> rows recorded before it was forgotten

    def __bool__(self) -> bool:
        return bool(self.segments)

    @property
    def full(self) -> bool:
        return self.held_rows >= self.max_held_rows

    def add(self, aux: list[Tensor], rows: Optional[np.ndarray], seq_ids: np.ndarray, positions: np.ndarray) -> None:
        """rows: rows of `aux` (None: all of them, in order) holding seq_ids[i]'s token at positions[i]."""
        if len(seq_ids) == 0:
            return
        last = self.segments[-1] if self.segments else None
        if last is not None and last[0] is aux:               # a step's plain rows, then its verified ones
            n = aux[0].shape[0]
            last[1] = np.concatenate([np.arange(n) if last[1] is None else last[1],
                                      np.arange(n) if rows is None else rows])
            last[2], last[3] = np.concatenate([last[2], seq_ids]), np.concatenate([last[3], positions])
        else:
            self.segments.append([aux, rows, seq_ids, positions])
            self.held_rows += aux[0].shape[0]
        self.recorded += len(seq_ids)

    def forget(self, seq_id: int) -> None:
        if self.segments:
            self.forgotten[seq_id] = self.recorded

    def take(self) -> Optional[tuple[Tensor, np.ndarray, np.ndarray]]:
        """(hidden [R, layers * hidden], seq_ids [R], positions [R]) of every live held row; empties the log."""
        return self.join(self.take_segments())

    @staticmethod
    def join(segments: list) -> Optional[tuple[Tensor, np.ndarray, np.ndarray]]:
        """`take`'s answer from `take_segments`' (None for no rows)."""
        parts, ids, positions = [], [], []
        for aux, rows, sid, pos in segments:
            hidden = torch.cat(aux, -1)
            parts.append(hidden if rows is None else hidden[to_device(rows, hidden.device)])
            ids.append(sid)
            positions.append(pos)
        if not parts:
            return None
        return torch.cat(parts) if len(parts) > 1 else parts[0], np.concatenate(ids), np.concatenate(positions)

    def take_segments(self) -> list[tuple[list[Tensor], Optional[np.ndarray], np.ndarray, np.ndarray]]:
        """The live held rows per recorded step, in record order: (aux in the drafter's layer order, rows of it
        (None: all), seq_ids, positions), no segment empty; empties the log."""
        segments, forgotten = self.segments, self.forgotten
        self.segments, self.forgotten, self.held_rows = [], {}, 0
        start = self.recorded - sum(len(seg[2]) for seg in segments)
        live_segments = []
        for aux, rows, sid, pos in segments:
            first, start = start, start + len(sid)
            if forgotten:
                index = first + np.arange(len(sid))
                live = np.ones(len(sid), dtype=bool)
                for s, mark in forgotten.items():
                    live &= ~((sid == s) & (index < mark))
                if not live.all():
                    rows = np.flatnonzero(live) if rows is None else rows[live]
                    sid, pos = sid[live], pos[live]
            if len(sid):
                live_segments.append(([aux[j] for j in self.layer_order], rows, sid, pos))
        return live_segments
