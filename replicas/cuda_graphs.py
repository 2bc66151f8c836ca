"""CUDA graphs for decode steps, one per batch-size bucket, captured largest first into one pool.

Each graph reads static input buffers; a step copies its inputs into the first `b` lanes and pads
the rest with slot -1 (their K/V is written nowhere) and a one-token context (their output is
ignored). The KV tensors' addresses never change after start-up, so graphs are captured once."""
from __future__ import annotations

import bisect

import numpy as np
import torch

from replicas.attention.context import ForwardContext, forward_context
from replicas.attention.spec import AttentionBatch
from replicas.step_input import StepInput


def graph_batch_sizes(max_num_seqs: int) -> list[int]:
    sizes = [1, 2, 4, 8] + list(range(16, 257, 16)) + list(range(288, 1025, 32))
    return [s for s in sizes if s <= max_num_seqs] or [1]


class DecodeGraphs:
    def __init__(self, model, backend, device: torch.device, max_num_seqs: int, max_blocks_per_seq: int,
                 max_model_len: int):
        self.model, self.backend, self.device = model, backend, device
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
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.hidden: dict[int, torch.Tensor] = {}

    def _context(self, b: int) -> ForwardContext:
        batch = AttentionBatch(self.query_start_loc[: b + 1], self.seq_lens[:b], self.block_tables[:b],
                               1, self.max_model_len, None)
        return ForwardContext(batch, self.slot_mapping[:b], backend_state={"decode": True})

    @torch.inference_mode()
    def capture(self) -> None:
        pool = torch.cuda.graph_pool_handle()
        for b in reversed(self.sizes):
            ctx = self._context(b)
            with forward_context(ctx):
                self.model(self.input_ids[:b], self.positions[:b])          # warm-up (Triton compiles here)
                torch.cuda.synchronize(self.device)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    hidden, _ = self.model(self.input_ids[:b], self.positions[:b])
            self.graphs[b], self.hidden[b] = graph, hidden
        torch.cuda.synchronize(self.device)

    def can_run(self, step: StepInput) -> bool:
        b = step.num_tokens
        return (step.tree_mask is None and not step.aux_layers and b <= self.sizes[-1]
                and len(step.seq_lens) == b and step.block_tables.shape[1] <= self.block_tables.shape[1])

    @torch.inference_mode()
    def run(self, step: StepInput) -> torch.Tensor:
        """Replays the bucket's graph; returns the final hidden states of the first b lanes."""
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
        self.graphs[size].replay()
        return self.hidden[size][:b]
