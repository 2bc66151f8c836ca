"""CUDA graphs for engine steps, captured into one pool, largest first.

Decode and verify graphs are keyed by their aux layers (the drafter's target layers whose residual stream they
also output; () for plain decoding), their batch-size bucket and their query length q: q = 1 is a decode step
(one graph per bucket), q = 1 + n a speculative verify step where every request checks a draft tree of n nodes
under a tree mask (only the (bucket, n) pairs a budget policy picks are captured: speculative/profile.py).
Each reads static input buffers; a step copies its inputs into the first `b` lanes and pads the rest with slot
-1 (their K/V is written nowhere) and a context of exactly their q new tokens read from block 0 (their output
is ignored).

Mixed graphs run any other step without a tree (prefill chunks, alone or beside decodes) of up to
`max_mixed_tokens` tokens: one graph per token bucket T, with min(T, max_num_seqs) lanes. Padded lanes have no
new tokens (the extend kernel's packed tile grid never visits them) and padded token rows write nowhere and
are sliced off; rows are independent in every other op. Eagerly such a step is launch-bound on a small model:
its hundreds of launches from Python take longer than the device work they issue (docs/engine.md has figures).

The KV tensors' addresses never change after start-up, so graphs are captured once. A replay's outputs are
overwritten by the next replay: `run` hands out views, the caller copies what it keeps."""
from __future__ import annotations

import bisect
from dataclasses import dataclass
from typing import Callable, Iterable, Optional

import numpy as np
import torch

from replicas.attention.context import ForwardContext, forward_context
from replicas.attention.spec import AttentionBatch
from replicas.step_input import StepInput


def graph_batch_sizes(max_num_seqs: int) -> list[int]:
    sizes = [1, 2, 4, 8] + list(range(16, 257, 16)) + list(range(288, 1025, 32))
    return [s for s in sizes if s <= max_num_seqs] or [1]


# The mixed graphs' bound for a model whose full step is not small (below): past it a step's device work
# outweighs the launches an eager step spends, and the elastic reserve holds the activations of larger steps.
MIXED_GRAPH_TOKENS = 1024
# A model whose full `max_num_batched_tokens` step needs at most this fraction of the device's memory for its
# activations gets graphs for every step size: its eager steps are launch-bound at any size (the device work of a
# full step is shorter than issuing its kernels from Python), and their memory is not worth lending.
SMALL_STEP_FRACTION = 0.01


def mixed_token_sizes(max_tokens: int) -> list[int]:
    """Token buckets of the mixed graphs, up to the first that holds `max_tokens` (0: none): 16 to 1,024 as below,
    then four per doubling (1,280, 1,536, 1,792, 2,048, 2,560, ...), so padding adds at most a quarter."""
    sizes = [16, 32, 64, 128, 192, 256, 384, 512, 640, 768, 896, 1024]
    while sizes[-1] < max_tokens:
        sizes.append(sizes[-1] + (1 << (sizes[-1].bit_length() - 1)) // 4)
    return [s for i, s in enumerate(sizes) if max_tokens > 0 and (i == 0 or sizes[i - 1] < max_tokens)]


def mixed_graph_limit(config, step_activation_bytes: Optional[int], device_bytes: Optional[int]) -> int:
    """The largest step with prefill chunks that replays a graph: `GraphsConfig.mixed_graph_tokens` when set;
    otherwise every step (`max_num_batched_tokens`) when a full step's measured activations are a small fraction of
    the device (SMALL_STEP_FRACTION) and elastic KV is off (with it on, larger steps run in the reserve), else
    MIXED_GRAPH_TOKENS."""
    budget = config.scheduling.max_num_batched_tokens
    limit = config.graphs.mixed_graph_tokens
    if limit is None:
        small = (step_activation_bytes is not None and device_bytes
                 and step_activation_bytes <= SMALL_STEP_FRACTION * device_bytes)
        limit = budget if small and config.elastic.mode == "off" else MIXED_GRAPH_TOKENS
    return min(limit, budget)


@dataclass
class GraphEntry:
    replay: Callable[[], None]
    hidden: torch.Tensor                 # [tokens, H] final hidden states (static)
    aux: list[torch.Tensor]              # [tokens, H] per aux layer (static)


class _TokenBuffers:
    """Static per-token inputs of the graphs with query length q, for every lane; q = 0: the mixed graphs',
    `tokens` rows and a query_start_loc each step writes."""

    def __init__(self, lanes: int, q: int, device: torch.device, tokens: int = 0):
        i64 = dict(dtype=torch.int64, device=device)
        tokens = tokens or lanes * q
        self.input_ids = torch.zeros(tokens, **i64)
        self.positions = torch.zeros(tokens, **i64)
        self.slot_mapping = torch.full((tokens,), -1, **i64)
        self.query_start_loc = torch.arange(0, lanes * q + 1, q, dtype=torch.int32, device=device) if q else \
            torch.zeros(lanes + 1, dtype=torch.int32, device=device)
        self.tree_mask = torch.ones(lanes, q, q, dtype=torch.bool, device=device) if q > 1 else None


class StepGraphs:
    """The runner's step graphs: decode graphs per bucket (and aux-layer tuple), a speculative engine's verify
    graphs per (bucket, nodes), and mixed graphs per token bucket (and aux-layer tuple)."""

    def __init__(self, model, device: torch.device, max_num_seqs: int, max_blocks_per_seq: int,
                 max_model_len: int, max_mixed_tokens: int = 0):
        self.model, self.device = model, device
        self.sizes = graph_batch_sizes(max_num_seqs)
        self.max_model_len = max_model_len
        self.mixed_sizes = mixed_token_sizes(max_mixed_tokens)
        n = self.sizes[-1]
        self.seq_lens = torch.ones(n, dtype=torch.int32, device=device)
        self.block_tables = torch.zeros(n, max_blocks_per_seq, dtype=torch.int32, device=device)
        self.tokens: dict[int, _TokenBuffers] = {1: _TokenBuffers(n, 1, device)}
        if self.mixed_sizes:
            self.tokens[0] = _TokenBuffers(n, 0, device, tokens=self.mixed_sizes[-1])
        self.graphs: dict[tuple[int, ...], dict[tuple[int, int], GraphEntry]] = {}   # aux -> (bucket, q) -> graph
        self.mixed: dict[tuple[int, ...], dict[int, GraphEntry]] = {}                  # aux -> tokens -> graph
        self.pool = None

    def bucket(self, batch: int) -> int:
        return self.sizes[bisect.bisect_left(self.sizes, batch)]

    def _lanes(self, tokens: int) -> int:
        """Lanes of the mixed graph of `tokens` tokens: a step has at most one request per token."""
        return self.bucket(min(tokens, self.sizes[-1]))

    def _context(self, b: int, q: int = 1) -> ForwardContext:
        buf = self.tokens[q]
        tree = buf.tree_mask[:b] if q > 1 else None
        batch = AttentionBatch(buf.query_start_loc[: b + 1], self.seq_lens[:b], self.block_tables[:b], q,
                               self.max_model_len, tree)
        return ForwardContext(batch, buf.slot_mapping[: b * q], backend_state={"decode": q == 1})

    def _mixed_context(self, tokens: int) -> ForwardContext:
        lanes, buf = self._lanes(tokens), self.tokens[0]
        batch = AttentionBatch(buf.query_start_loc[: lanes + 1], self.seq_lens[:lanes], self.block_tables[:lanes],
                               tokens, self.max_model_len, None)
        return ForwardContext(batch, buf.slot_mapping[:tokens], backend_state={"decode": False})

    def _forward(self, b: int, aux_layers: tuple[int, ...], q: int = 1) -> tuple[torch.Tensor, list[torch.Tensor]]:
        buf = self.tokens[q]
        with forward_context(self._context(b, q)):
            return self.model(buf.input_ids[: b * q], buf.positions[: b * q], aux_layers)

    def _forward_mixed(self, tokens: int, aux_layers: tuple[int, ...]) -> tuple[torch.Tensor, list[torch.Tensor]]:
        buf = self.tokens[0]
        with forward_context(self._mixed_context(tokens)):
            return self.model(buf.input_ids[:tokens], buf.positions[:tokens], aux_layers)

    def _record(self, forward: Callable[[], tuple[torch.Tensor, list[torch.Tensor]]], label) -> GraphEntry:
        """label: the graph's query length (decode, verify) or ("mixed", tokens)."""
        forward()                                                         # warm-up (Triton compiles here)
        torch.cuda.synchronize(self.device)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            hidden, aux = forward()
        return GraphEntry(graph.replay, hidden, list(aux))       # the bound replay keeps the graph alive

    def _capture(self, aux_layers: tuple[int, ...], shapes: Iterable[tuple[int, int]], mixed: bool = False) -> None:
        aux = tuple(aux_layers)
        table = self.graphs.setdefault(aux, {})
        mixed_table = self.mixed.setdefault(aux, {})
        todo = [(b * q, b, q) for b, q in set(shapes) if (b, q) not in table]
        if mixed:
            todo += [(t, 0, t) for t in self.mixed_sizes if t not in mixed_table]
        if not todo:
            return
        if self.pool is None and self.device.type == "cuda":
            self.pool = torch.cuda.graph_pool_handle()
        for _, b, q in sorted(todo, reverse=True):                       # largest first: one pool serves all
            if b == 0:                                                   # a mixed graph of q tokens
                buf = self.tokens[0]
                buf.slot_mapping.fill_(-1)
                buf.query_start_loc.zero_()                              # every lane empty: attends to nothing
                mixed_table[q] = self._record(lambda t=q: self._forward_mixed(t, aux), ("mixed", q))
                continue
            if q not in self.tokens:
                self.tokens[q] = _TokenBuffers(self.sizes[-1], q, self.device)
            self.tokens[q].slot_mapping.fill_(-1)          # capture on padded-lane inputs: writes nothing
            self.seq_lens[:b].fill_(q)
            self.block_tables[:b, :q] = 0
            table[(b, q)] = self._record(lambda b=b, q=q: self._forward(b, aux, q), q)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    @torch.inference_mode()
    def capture(self, aux_layers: tuple[int, ...] = ()) -> None:
        """The decode graphs of every bucket and the mixed graphs of every token bucket for steps asking for
        `aux_layers` (() = plain decoding)."""
        self._capture(aux_layers, [(b, 1) for b in self.sizes], mixed=True)

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
        """(bucket, q) of a decode or verify step, (0, token bucket) of a mixed step, None if no graph fits."""
        b, t = len(step.seq_lens), step.num_tokens
        if b == 0 or b > self.sizes[-1] or step.block_tables.shape[1] > self.block_tables.shape[1]:
            return None
        if step.trees is None:
            if t == b:
                return self.bucket(b), 1
            if self.mixed_sizes and t <= self.mixed_sizes[-1]:
                return 0, self.mixed_sizes[bisect.bisect_left(self.mixed_sizes, t)]
            return None
        q = t // b
        if q * b != t or np.any(np.diff(step.query_start_loc) != q):
            return None
        return self.bucket(b), q

    def _entry(self, shape: tuple[int, int] | None, aux_layers: tuple[int, ...]) -> GraphEntry | None:
        if shape is None:
            return None
        if shape[0] == 0:
            return self.mixed.get(tuple(aux_layers), {}).get(shape[1])
        return self.graphs.get(tuple(aux_layers), {}).get(shape)

    def can_run(self, step: StepInput) -> bool:
        return self._entry(self._shape(step), step.aux_layers) is not None

    @torch.inference_mode()
    def run(self, step: StepInput) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """Replays the step's graph; returns views of the step's rows: final hidden states, aux layers."""
        size, q = shape = self._shape(step)
        entry = self._entry(shape, step.aux_layers)
        b, t = len(step.seq_lens), step.num_tokens
        buf = self.tokens[0 if size == 0 else q]
        if size == 0:
            lanes = self._lanes(q)
            buf.query_start_loc[: b + 1].copy_(torch.from_numpy(step.query_start_loc), non_blocking=True)
            buf.query_start_loc[b + 1: lanes + 1].fill_(t)               # padded lanes: no new tokens
            pad_to = q
        else:
            self.seq_lens[b:size].fill_(q)
            self.block_tables[b:size, :q] = 0  # padded lanes read block 0, never a stale (maybe unmapped) block
            pad_to = size * q
        buf.input_ids[:t].copy_(torch.from_numpy(step.input_ids), non_blocking=True)
        if step.device_input_ids is not None:
            buf.input_ids[:step.device_input_ids.shape[0]].copy_(step.device_input_ids)
        buf.positions[:t].copy_(torch.from_numpy(step.positions), non_blocking=True)
        if step.trees is not None:
            step.trees.write(step.query_start_loc, buf.input_ids[:t], buf.positions[:t], buf.tree_mask[:b])
        buf.slot_mapping[:t].copy_(torch.from_numpy(step.slot_mapping), non_blocking=True)
        buf.slot_mapping[t:pad_to].fill_(-1)
        self.seq_lens[:b].copy_(torch.from_numpy(step.seq_lens), non_blocking=True)
        self.block_tables[:b, :step.block_tables.shape[1]].copy_(
            torch.from_numpy(np.ascontiguousarray(step.block_tables)), non_blocking=True)
        entry.replay()
        return entry.hidden[:t], [a[:t] for a in entry.aux]
