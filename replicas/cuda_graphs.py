"""CUDA graphs for decode steps, one per batch-size bucket, captured largest first into one pool.

Each graph reads static input buffers; a step copies its inputs into the first `b` lanes and pads
the rest with slot -1 (their K/V is written nowhere) and a one-token context (their output is
ignored). The KV tensors' addresses never change after start-up, so graphs are captured once.

A speculative engine's steps also ask for the residual stream after the drafter's target layers (aux layers):
a variant per aux-layer tuple, captured into the same pool, writes them to static outputs too, so a plain
decode step of a speculative engine replays a graph and still feeds the drafter's context. A replay's outputs
are overwritten by the next replay: `run` hands out views, the caller copies what it keeps."""
from __future__ import annotations

import bisect
from dataclasses import dataclass
from typing import Callable

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
    hidden: torch.Tensor                 # [b, H] final hidden states (static)
    aux: list[torch.Tensor]              # [b, H] per aux layer (static)


class DecodeGraphs:
    def __init__(self, model, device: torch.device, max_num_seqs: int, max_blocks_per_seq: int,
                 max_model_len: int):
        self.model, self.device = model, device
        self.sizes = graph_batch_sizes(max_num_seqs)
        self.max_model_len = max_model_len
        n = self.sizes[-1]
        i32, i64 = dict(dtype=torch.int32, device=device), dict(dtype=torch.int64, device=device)
        self.input_ids = torch.zeros(n, **i64)
        self.positions = torch.zeros(n, **i64)
        self.slot_mapping = torch.full((n,), -1, **i64)
        self.seq_lens = torch.ones(n, **i32)
        self.block_tables = torch.zeros(n, max_blocks_per_seq, **i32)
        self.query_start_loc = torch.arange(n + 1, **i32)
        self.graphs: dict[tuple[int, ...], dict[int, GraphEntry]] = {}    # aux layers -> batch size -> entry
        self.pool = None

    def _context(self, b: int) -> ForwardContext:
        batch = AttentionBatch(self.query_start_loc[: b + 1], self.seq_lens[:b], self.block_tables[:b],
                               1, self.max_model_len, None)
        return ForwardContext(batch, self.slot_mapping[:b], backend_state={"decode": True})

    def _forward(self, b: int, aux_layers: tuple[int, ...]) -> tuple[torch.Tensor, list[torch.Tensor]]:
        with forward_context(self._context(b)):
            return self.model(self.input_ids[:b], self.positions[:b], aux_layers)

    def _record(self, b: int, aux_layers: tuple[int, ...]) -> GraphEntry:
        self._forward(b, aux_layers)                                      # warm-up (Triton compiles here)
        torch.cuda.synchronize(self.device)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            hidden, aux = self._forward(b, aux_layers)
        return GraphEntry(graph.replay, hidden, list(aux))       # the bound replay keeps the graph alive

    @torch.inference_mode()
    def capture(self, aux_layers: tuple[int, ...] = ()) -> None:
        """The graphs of every bucket for steps asking for `aux_layers` (() = plain decoding)."""
        aux_layers = tuple(aux_layers)
        if aux_layers in self.graphs:
            return
        if self.pool is None and self.device.type == "cuda":
            self.pool = torch.cuda.graph_pool_handle()
        self.graphs[aux_layers] = {b: self._record(b, aux_layers) for b in reversed(self.sizes)}
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def can_run(self, step: StepInput) -> bool:
        b = step.num_tokens
        return (step.tree_mask is None and tuple(step.aux_layers) in self.graphs and b <= self.sizes[-1]
                and len(step.seq_lens) == b and step.block_tables.shape[1] <= self.block_tables.shape[1])

    @torch.inference_mode()
    def run(self, step: StepInput) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """Replays the bucket's graph; returns views of the first b lanes: final hidden states and aux layers."""
        b = step.num_tokens
        size = self.sizes[bisect.bisect_left(self.sizes, b)]
        self.input_ids[:b].copy_(torch.from_numpy(step.input_ids), non_blocking=True)
        self.positions[:b].copy_(torch.from_numpy(step.positions), non_blocking=True)
        self.slot_mapping[:b].copy_(torch.from_numpy(step.slot_mapping), non_blocking=True)
        self.slot_mapping[b:size].fill_(-1)
        self.seq_lens[:b].copy_(torch.from_numpy(step.seq_lens), non_blocking=True)
        self.seq_lens[b:size].fill_(1)
        self.block_tables[b:size, 0] = 0    # padded lanes read block 0, never a stale (maybe unmapped) block
        width = step.block_tables.shape[1]
        self.block_tables[:b, :width].copy_(torch.from_numpy(np.ascontiguousarray(step.block_tables)),
                                            non_blocking=True)
        entry = self.graphs[tuple(step.aux_layers)][size]
        entry.replay()
        return entry.hidden[:b], [a[:b] for a in entry.aux]
