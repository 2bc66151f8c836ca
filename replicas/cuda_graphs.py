"""CUDA graphs for decode and verify steps, captured into one pool, largest first.

A graph is keyed by its aux layers (the drafter's target layers whose residual stream it also outputs; () for
plain decoding), its batch-size bucket and its query length q: q = 1 is a decode step (one graph per bucket),
q = 1 + n a speculative verify step where every request checks a draft tree of n nodes under a tree mask (only
the (bucket, n) pairs a budget policy picks are captured: replicas/spec_profile.py).

Each graph reads static input buffers; a step copies its inputs into the first `b` lanes and pads the rest with
slot -1 (their K/V is written nowhere) and a context of exactly their q new tokens read from block 0 (their
output is ignored). The KV tensors' addresses never change after start-up, so graphs are captured once. A
replay's outputs are overwritten by the next replay: `run` hands out views, the caller copies what it keeps."""
from __future__ import annotations

import bisect
from dataclasses import dataclass
from typing import Callable, Iterable

import numpy as np
import torch

from replicas.attention.context import ForwardContext, forward_context
from replicas.attention.spec import AttentionBatch
from replicas.step_input import StepInput


def graph_batch_sizes(max_num_seqs: int) -> list[int]:
    sizes = [1, 2, 4, 8] + list(range(16, 257, 16)) + list(range(288, 1025, 32))
    return [s for s in sizes if s <= max_num_seqs] or [1]


@dataclass
class GraphEntry:
    replay: Callable[[], None]
    hidden: torch.Tensor                 # [b * q, H] final hidden states (static)
    aux: list[torch.Tensor]              # [b * q, H] per aux layer (static)


class _TokenBuffers:
    """Static per-token inputs of the graphs with query length q, for every lane."""

    def __init__(self, lanes: int, q: int, device: torch.device):
        i64 = dict(dtype=torch.int64, device=device)
        self.input_ids = torch.zeros(lanes * q, **i64)
        self.positions = torch.zeros(lanes * q, **i64)
        self.slot_mapping = torch.full((lanes * q,), -1, **i64)
        self.query_start_loc = torch.arange(0, lanes * q + 1, q, dtype=torch.int32, device=device)
        self.tree_mask = torch.ones(lanes, q, q, dtype=torch.bool, device=device) if q > 1 else None


class DecodeGraphs:
    """The runner's step graphs: decode graphs per bucket (and aux-layer tuple), and a speculative engine's verify
    graphs per (bucket, nodes)."""

    def __init__(self, model, device: torch.device, max_num_seqs: int, max_blocks_per_seq: int,
                 max_model_len: int):
        self.model, self.device = model, device
        self.sizes = graph_batch_sizes(max_num_seqs)
        self.max_model_len = max_model_len
        n = self.sizes[-1]
        self.seq_lens = torch.ones(n, dtype=torch.int32, device=device)
        self.block_tables = torch.zeros(n, max_blocks_per_seq, dtype=torch.int32, device=device)
        self.tokens: dict[int, _TokenBuffers] = {1: _TokenBuffers(n, 1, device)}
        self.graphs: dict[tuple[int, ...], dict[tuple[int, int], GraphEntry]] = {}   # aux -> (bucket, q) -> graph
        self.pool = None

    def bucket(self, batch: int) -> int:
        return self.sizes[bisect.bisect_left(self.sizes, batch)]

    def _context(self, b: int, q: int = 1) -> ForwardContext:
        buf = self.tokens[q]
        tree = buf.tree_mask[:b] if q > 1 else None
        batch = AttentionBatch(buf.query_start_loc[: b + 1], self.seq_lens[:b], self.block_tables[:b], q,
                               self.max_model_len, tree)
        return ForwardContext(batch, buf.slot_mapping[: b * q], backend_state={"decode": q == 1})

    def _forward(self, b: int, aux_layers: tuple[int, ...], q: int = 1) -> tuple[torch.Tensor, list[torch.Tensor]]:
        buf = self.tokens[q]
        with forward_context(self._context(b, q)):
            return self.model(buf.input_ids[: b * q], buf.positions[: b * q], aux_layers)

    def _record(self, b: int, aux_layers: tuple[int, ...], q: int = 1) -> GraphEntry:
        self._forward(b, aux_layers, q)                                   # warm-up (Triton compiles here)
        torch.cuda.synchronize(self.device)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            hidden, aux = self._forward(b, aux_layers, q)
        return GraphEntry(graph.replay, hidden, list(aux))       # the bound replay keeps the graph alive

    def _capture(self, aux_layers: tuple[int, ...], shapes: Iterable[tuple[int, int]]) -> None:
        table = self.graphs.setdefault(tuple(aux_layers), {})
        todo = sorted((s for s in set(shapes) if s not in table), key=lambda s: s[0] * s[1], reverse=True)
        if not todo:
            return
        if self.pool is None and self.device.type == "cuda":
            self.pool = torch.cuda.graph_pool_handle()
        for b, q in todo:
            if q not in self.tokens:
                self.tokens[q] = _TokenBuffers(self.sizes[-1], q, self.device)
            self.tokens[q].slot_mapping.fill_(-1)          # capture on padded-lane inputs: writes nothing
            self.seq_lens[:b].fill_(q)
            self.block_tables[:b, :q] = 0
            table[(b, q)] = self._record(b, tuple(aux_layers), q)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    @torch.inference_mode()
    def capture(self, aux_layers: tuple[int, ...] = ()) -> None:
        """The decode graphs of every bucket for steps asking for `aux_layers` (() = plain decoding)."""
        self._capture(aux_layers, [(b, 1) for b in self.sizes])

    @torch.inference_mode()
    def capture_verify(self, aux_layers: tuple[int, ...], shapes: Iterable[tuple[int, int]]) -> None:
        """Verify graphs for (bucket, draft nodes per request) pairs; buckets are decode buckets."""
        self._capture(aux_layers, [(b, 1 + n) for b, n in shapes])

    def verify_shapes(self, aux_layers: tuple[int, ...]) -> set[tuple[int, int]]:
        return {(b, q - 1) for b, q in self.graphs.get(tuple(aux_layers), {}) if q > 1}

    def drop_verify(self, aux_layers: tuple[int, ...], keep: set[tuple[int, int]]) -> None:
        """Release the verify graphs not in `keep` ((bucket, nodes) pairs); their memory returns to the pool."""
        table = self.graphs.get(tuple(aux_layers), {})
        for b, q in [k for k in table if k[1] > 1 and (k[0], k[1] - 1) not in keep]:
            del table[(b, q)]

    def _shape(self, step: StepInput) -> tuple[int, int] | None:
        """(bucket, q) of a step these graphs can run: decodes only, or verifies of one tree size only."""
        b, t = len(step.seq_lens), step.num_tokens
        if b == 0 or b > self.sizes[-1] or step.block_tables.shape[1] > self.block_tables.shape[1]:
            return None
        if step.tree_mask is None:
            return (self.bucket(b), 1) if t == b else None
        q = t // b
        if q * b != t or step.tree_mask.shape != (b, q, q) or np.any(np.diff(step.query_start_loc) != q):
            return None
        return self.bucket(b), q

    def can_run(self, step: StepInput) -> bool:
        shape = self._shape(step)
        return shape is not None and shape in self.graphs.get(tuple(step.aux_layers), {})

    @torch.inference_mode()
    def run(self, step: StepInput) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """Replays the step's graph; returns views of the first b lanes' rows: final hidden states, aux layers."""
        size, q = self._shape(step)
        b, t = len(step.seq_lens), step.num_tokens
        buf = self.tokens[q]
        buf.input_ids[:t].copy_(torch.from_numpy(step.input_ids), non_blocking=True)
        buf.positions[:t].copy_(torch.from_numpy(step.positions), non_blocking=True)
        buf.slot_mapping[:t].copy_(torch.from_numpy(step.slot_mapping), non_blocking=True)
        buf.slot_mapping[t:size * q].fill_(-1)
        self.seq_lens[:b].copy_(torch.from_numpy(step.seq_lens), non_blocking=True)
        self.seq_lens[b:size].fill_(q)
        self.block_tables[b:size, :q] = 0    # padded lanes read block 0, never a stale (maybe unmapped) block
        width = step.block_tables.shape[1]
        self.block_tables[:b, :width].copy_(torch.from_numpy(np.ascontiguousarray(step.block_tables)),
                                            non_blocking=True)
        if q > 1:
            buf.tree_mask[:b].copy_(torch.from_numpy(np.ascontiguousarray(step.tree_mask)), non_blocking=True)
        entry = self.graphs[tuple(step.aux_layers)][(size, q)]
        entry.replay()
        return entry.hidden[:t], [a[:t] for a in entry.aux]
