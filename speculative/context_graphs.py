"""The drafter context update (`Speculator.flush`) at a few static shapes, replayed from CUDA graphs.

Eager, a flush is ~50 small kernels (the context projection: fc and its RMSNorm, then per draft layer the k/v
projections, k norm and RoPE; the pool write) and a few host->device copies, at a new row count every round.
Here the pending rows are padded to a power-of-two bucket (`min_rows` .. `max_rows`), and a bucket's projection
and pool write are captured once in a CUDA graph over static inputs: hidden rows [R, context_size], positions
[R] and slots [R]. Padded rows, and rows that a later row of the same flush overwrites (a recompute after
preemption), write the pool's scratch slot, which nothing reads. A flush is then one pinned copy (positions,
slots and the row indices of its recorded steps), one or two kernels per recorded step that place its hidden
rows in the static input, and one replay.

The graph writes the pool's memory: when the pool has moved (`PagedDraftContext.pool_id`), the bucket is captured
again. Buckets carve their hidden input from the start of one arena (flushes never overlap) and share a graph pool
(the drafter graphs'). Above `max_rows` (a long prefill's rows) a flush runs the unpadded eager pass, as on CPU
and with TIDAL_DRAFTER_GRAPHS=0. use_graphs=False runs the padded pass on the same static buffers eagerly, as the
graph would (CPU tests).

A padded flush writes the rows an unpadded one writes, to the same slots; the values agree to rounding, not
always bit for bit: a GEMM may sum a row in another order at another row count (small counts on CPU).
"""
from __future__ import annotations

from typing import Optional

import numpy as np
import torch
from torch import Tensor

from replicas.transfer import to_device
from speculative.context_cache import PagedDraftContext, PendingObservations, next_power_of_two
from speculative.drafter import BlockDrafter
from speculative.graph_buffers import Arena, HostStaging, capture_graph


def flush_eager(backbone: BlockDrafter, contexts: PagedDraftContext, hidden: Tensor, seq_ids: np.ndarray,
                positions: np.ndarray, dtype: torch.dtype) -> None:
    """The unpadded flush: rows `hidden` [R, context_size] hold seq_ids[i]'s token at positions[i]; their context
    K/V in one batched pass, stored in the sequences' slots."""
    slots, keep = contexts.reserve_rows(seq_ids, positions)
    if not keep.all():                                   # a recompute overwrote slots within this flush
        hidden, slots, positions = hidden[to_device(np.flatnonzero(keep), hidden.device)], slots[keep], \
            positions[keep]
    packed = to_device(np.stack([positions, slots]), contexts.device)
    ctx = backbone.context(hidden[None].to(dtype), packed[0][None])
    contexts.write(packed[1], ctx)


class FlushBucket:
    """One bucket's static inputs and its CUDA graph (None: `body` runs eagerly on them). source: the pool_id
    the graph writes to."""

    def __init__(self, rows: int, hidden: Tensor, contexts: PagedDraftContext):
        self.hidden = hidden                                          # [rows, context_size]
        self.index = torch.zeros(3 * rows, dtype=torch.long, device=hidden.device)
        self.positions, self.slots, self.rows = self.index.view(3, rows).unbind(0)   # rows: of recorded steps
        self.slots.fill_(contexts.scratch_slot)                       # a capture's warm-up writes nothing read
        self.source = contexts.pool_id
        self.graph: Optional[torch.cuda.CUDAGraph] = None
        self.replays = 0

    @property
    def size(self) -> int:
        return self.hidden.shape[0]

    def body(self, backbone: BlockDrafter, contexts: PagedDraftContext) -> None:
        contexts.write(self.slots, backbone.context(self.hidden[None], self.positions[None]))


def place_rows(dst: Tensor, aux: list[Tensor], rows: Optional[Tensor]) -> None:
    """dst [n, context_size] <- rows `rows` (None: all) of the aux layers side by side; one kernel for all rows,
    two for chosen rows (in dst's dtype: a copy more)."""
    if aux[0].dtype != dst.dtype:
        hidden = torch.cat(aux, -1)
        dst.copy_(hidden if rows is None else hidden[rows])
    elif rows is None:
        torch.cat(aux, -1, out=dst)
    else:
        torch.index_select(torch.cat(aux, -1), 0, rows, out=dst)


class FlushGraphs:
    def __init__(self, backbone: BlockDrafter, dtype: torch.dtype, device: torch.device, min_rows: int = 16,
                 max_rows: int = 1024, use_graphs: Optional[bool] = None, pool=None):
        """use_graphs: capture CUDA graphs (default: on CUDA); False runs the padded pass eagerly. pool: a graph
        memory pool to share (default: a new one)."""
        self.backbone, self.dtype, self.device = backbone, dtype, device
        self.min_rows, self.max_rows = min_rows, max_rows
        self.use_graphs = device.type == "cuda" if use_graphs is None else use_graphs
        self.pool = (pool or torch.cuda.graph_pool_handle()) if self.use_graphs else None
        self.context_size = backbone.fc.in_features
        self.arena = Arena(device)
        self.staging = HostStaging(device)
        self.buckets: dict[int, FlushBucket] = {}
        self.eager_flushes = 0

    def bucket(self, rows: int) -> Optional[int]:
        """The padded row count for `rows` rows, or None above `max_rows` (eager)."""
        return max(self.min_rows, next_power_of_two(rows)) if rows <= self.max_rows else None

    @torch.inference_mode()
    def flush(self, contexts: PagedDraftContext, pending: PendingObservations) -> None:
        """Project every pending row into context K/V and store it, as `flush_eager` does."""
        segments = pending.take_segments()
        n = sum(len(seg[2]) for seg in segments)
        if n == 0:
            return
        size = self.bucket(n)
        if size is None:
            self.eager_flushes += 1
            flush_eager(self.backbone, contexts, *PendingObservations.join(segments), self.dtype)
            return
        seq_ids = np.concatenate([seg[2] for seg in segments])
        positions = np.concatenate([seg[3] for seg in segments])
        slots, keep = contexts.reserve_rows(seq_ids, positions)        # may grow (move) the pool
        entry = self._entry(size, contexts)
        host = self.staging.take(3 * size).reshape(3, size)
        host[0, :n] = positions
        host[1] = contexts.scratch_slot
        host[1, :n][keep] = slots[keep]
        starts = np.cumsum([0] + [len(seg[2]) for seg in segments]).tolist()
        for (_, rows, _, _), start in zip(segments, starts):
            if rows is not None:
                host[2, start:start + len(rows)] = rows
        self.staging.upload(entry.index)
        for (aux, rows, _, _), start, end in zip(segments, starts, starts[1:]):
            place_rows(entry.hidden[start:end], aux, None if rows is None else entry.rows[start:end])
        if entry.graph is not None:
            entry.graph.replay()
        else:
            entry.body(self.backbone, contexts)
        entry.replays += 1

    def _entry(self, size: int, contexts: PagedDraftContext) -> FlushBucket:
        """The bucket's graph: captured on first use, and again when the pool has moved."""
        entry = self.buckets.get(size)
        if entry is not None and entry.source == contexts.pool_id:
            return entry
        hidden = self.arena.take([(size, self.context_size)], self.dtype)[0]
        entry = self.buckets[size] = FlushBucket(size, hidden, contexts)
        if not self.use_graphs:
            return entry
        entry.graph = capture_graph(lambda: entry.body(self.backbone, contexts), self.device, self.pool)
        return entry
