"""The drafter pass (`DominoDrafter.draft`) replayed from CUDA graphs, one per (padded batch, context length) key.

Eager, the pass is ~100 small kernels: launch-bound at small batches, slower than the target's decode step it
is meant to save (bench.draft_round measures both). A key's graph is captured on its first use: the batch is
padded to the next power of two (at most `max_batch`) and the context length is already bucketed by
`PagedDraftContext.gather` (a power-of-two number of pages), so keys come from a small set.

Two ways to feed a key. `run_paged` (the speculator's): the host writes roots, root positions, context lengths and
page ids into one pinned table, copied once to the key's static table; the graph itself gathers the context from
the PagedDraftContext pool into the key's static keys/values (`PagedDraftContext.gather_into`) and drafts, so a
round is one copy and one replay. Such a graph reads the pool's memory: when the pool grows (`pool_id`), the key
is captured again. `run` takes an already gathered DraftContext and copies it into the static inputs.

Padded lanes get root 0, position 0 and an all-invalid context. The block's own tokens are always visible, so a
padded lane has no all-masked softmax row, and every op of the pass is row-independent: padded lanes never change
the real ones (`draft_padded` is the same computation, eager, so CPU tests can check it). `run` leaves the padded
lanes' context keys/values as they are; `run_paged` gathers page 0 into them.

Memory: every key carves its static context keys/values and its outputs from the start of two shared arenas
(`Arena`), so keys overlap in memory. That is safe because runs never overlap and each run rewrites everything it
reads (real rows) or masks it (padded lanes). Graph intermediates go to one shared graph pool, freed after each
capture for the next. So the memory held is about twice the largest key's inputs and outputs plus the largest
pass's intermediates, whatever the number of keys. A run's outputs are views of the output arena: valid until
the next `run` of any key (`Speculator.propose` consumes them before its next round).

Eager instead of a graph: a batch above `max_batch`, a key whose padded context (batch x length) needs more than
`max_input_bytes` of keys/values (a bound on the memory held, which the KV pool was sized without; such passes
are long enough that launches matter less), and new keys once `max_graphs` are captured (never evicted). A
capture synchronises the device and empties the allocator's cache, as `torch.cuda.graph` does.
"""
from __future__ import annotations

import logging
from typing import Optional

import numpy as np
import torch
from torch import Tensor

from replicas import envs
from replicas.transfer import to_device
from speculative.context_cache import PagedDraftContext, next_power_of_two
from speculative.drafter import DominoDrafter, DraftBlock, DraftContext
from speculative.graph_buffers import Arena, HostStaging, capture_graph

log = logging.getLogger(__name__)

def graphs_enabled() -> bool:
    """TIDAL_DRAFTER_GRAPHS=0: the drafter pass runs eagerly (replicas/envs.py)."""
    return envs.drafter_graphs()


def static_draft_enabled() -> bool:
    """The whole draft side on static shapes (run_paged + flush graphs): the default, since it halves a round
    against an eager context update (bench.draft_round compares the two)."""
    return envs.static_draft()


def padded_batch(batch: int, max_batch: int = 256) -> Optional[int]:
    """The next power of two >= batch, or None above `max_batch`."""
    lanes = next_power_of_two(batch)
    return lanes if 0 < batch and lanes <= max_batch else None


class PaddedInputs:
    """The static inputs of one key: a table [roots | positions | context lengths | page ids (lanes x pages)] of
    int64, filled with one copy; context keys/values, one [2 (keys, values), layers, lanes, length, kv_heads,
    head_dim] tensor (per-layer views in `context`); valid [lanes, length]. pages: 0 for inputs that `fill`
    copies a gathered context into, else the page width `gather` reads through the table."""

    def __init__(self, lanes: int, kv: Tensor, pages: int = 0):
        device, length = kv.device, kv.shape[3]
        self.table = torch.zeros(lanes * (3 + pages), dtype=torch.long, device=device)
        self.roots, self.positions, self.lengths = self.table[:3 * lanes].view(3, lanes).unbind(0)
        self.pages = self.table[3 * lanes:].view(lanes, pages)
        self.kv = kv
        self.valid = torch.zeros(lanes, length, dtype=torch.bool, device=device)
        self.slot_index = torch.arange(length, device=device)
        self.context = DraftContext(list(kv[0].unbind(0)), list(kv[1].unbind(0)), self.valid)

    @staticmethod
    def allocate(lanes: int, like: DraftContext, arena: Optional[Arena] = None) -> "PaddedInputs":
        """Inputs for `lanes` rows of contexts shaped like `like` (keys/values from `arena`: fresh by default)."""
        k = like.keys[0]
        kv = (arena or Arena(k.device)).take([(2, len(like.keys), lanes, like.length, *k.shape[2:])], k.dtype)
        return PaddedInputs(lanes, kv[0])

    @staticmethod
    def for_pages(lanes: int, pages: int, contexts: PagedDraftContext, arena: Arena) -> "PaddedInputs":
        """Inputs that gather `pages` pages per lane from `contexts`' pool."""
        pool = contexts.pool
        shape = (2, pool.shape[0], lanes, pages * contexts.page_size, *pool.shape[4:])
        return PaddedInputs(lanes, arena.take([shape], pool.dtype)[0], pages)

    @property
    def lanes(self) -> int:
        return self.roots.shape[0]

    def fill_table(self, contexts: PagedDraftContext, seq_ids: list[int], roots: np.ndarray,
                   root_pos: np.ndarray, staging: HostStaging) -> None:
        """The table for the batch (lanes B.. root 0, position 0, no context), with one copy."""
        lanes, b = self.lanes, len(seq_ids)
        host = staging.take(self.table.numel())
        host[:b], host[lanes:lanes + b] = roots, root_pos
        contexts.fill_table(seq_ids, host[2 * lanes:3 * lanes], host[3 * lanes:].reshape(lanes, -1))
        staging.upload(self.table)

    def gather(self, contexts: PagedDraftContext) -> None:
        contexts.gather_into(self.lengths, self.pages, self.kv, self.valid, self.slot_index)

    def fill(self, roots: Tensor, root_pos: Tensor, ctx: DraftContext) -> None:
        """Rows [:B] from the batch; lanes B.. get root 0, position 0 and no visible context."""
        b = roots.shape[0]
        self.roots[:b].copy_(roots)
        self.positions[:b].copy_(root_pos)
        self.valid[:b].copy_(ctx.valid)
        if b < self.lanes:
            self.roots[b:].zero_()
            self.positions[b:].zero_()
            self.valid[b:].zero_()
        for dst, src in zip(self.context.keys + self.context.values, ctx.keys + ctx.values):
            dst[:b].copy_(src)

    def draft(self, drafter: DominoDrafter, embed_weight: Tensor, lm_head_weight: Tensor) -> DraftBlock:
        """`drafter.draft` over every lane: what a key's graph captures."""
        return drafter.draft(self.roots, self.positions, self.context, embed_weight, lm_head_weight)


def draft_padded(drafter: DominoDrafter, roots: Tensor, root_pos: Tensor, ctx: DraftContext, embed_weight: Tensor,
                 lm_head_weight: Tensor, inputs: Optional[PaddedInputs] = None) -> DraftBlock:
    """Eager `drafter.draft` with the batch padded to `inputs`' lanes (default: fresh inputs of the next power of
    two), rows [:B]: the computation a key's graph replays."""
    b = roots.shape[0]
    if inputs is None:
        inputs = PaddedInputs.allocate(next_power_of_two(b), ctx)
    inputs.fill(roots, root_pos, ctx)
    block = inputs.draft(drafter, embed_weight, lm_head_weight)
    return DraftBlock(block.hidden[:b], block.base_logits[:b])


class KeyGraph:
    """One key's static inputs and outputs and its CUDA graph (None: `replay` reruns the pass eagerly on the
    static buffers, as the graph would; for CPU tests). source: the pool_id the key gathers from (None: `run`'s
    inputs, filled by copies)."""

    def __init__(self, inputs: PaddedInputs, hidden: Tensor, base_logits: Tensor, source: Optional[int] = None):
        self.inputs, self.hidden, self.base_logits, self.source = inputs, hidden, base_logits, source
        self.graph: Optional[torch.cuda.CUDAGraph] = None
        self.replays = 0

    def body(self, drafter: DominoDrafter, embed_weight: Tensor, lm_head_weight: Tensor,
             contexts: Optional[PagedDraftContext] = None) -> None:
        if contexts is not None:
            self.inputs.gather(contexts)
        block = self.inputs.draft(drafter, embed_weight, lm_head_weight)
        # checked while capturing (host only): copy_ would silently cast or broadcast
        assert block.hidden.dtype == self.hidden.dtype and block.hidden.shape == self.hidden.shape
        assert block.base_logits.dtype == self.base_logits.dtype and block.base_logits.shape == self.base_logits.shape
        self.hidden.copy_(block.hidden)
        self.base_logits.copy_(block.base_logits)


class DrafterGraphs:
    def __init__(self, drafter: DominoDrafter, embed_weight: Tensor, lm_head_weight: Tensor, max_graphs: int = 32,
                 max_batch: int = 256, max_input_bytes: int = 256 << 20, use_graphs: Optional[bool] = None):
        """use_graphs: capture CUDA graphs (default: on CUDA); False keeps the keys, buffers and limits but replays
        eagerly (CPU tests)."""
        self.drafter, self.embed_weight, self.lm_head_weight = drafter, embed_weight, lm_head_weight
        self.device = embed_weight.device
        self.use_graphs = self.device.type == "cuda" if use_graphs is None else use_graphs
        self.max_graphs, self.max_batch = max_graphs, max_batch
        cfg = drafter.cfg
        lane_bytes = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * embed_weight.element_size()
        self.max_lane_tokens = max_input_bytes // lane_bytes        # padded batch x context length
        self.inputs_arena, self.outputs_arena = Arena(self.device), Arena(self.device)
        self.pool = torch.cuda.graph_pool_handle() if self.use_graphs else None
        self.graphs: dict[tuple[int, int], KeyGraph] = {}
        self.staging = HostStaging(self.device)
        self.eager_runs = 0

    def key(self, batch: int, length: int) -> Optional[tuple[int, int]]:
        """(padded batch, context length), or None where the pass runs eagerly whatever is captured."""
        lanes = padded_batch(batch, self.max_batch)
        if lanes is None or lanes * length > self.max_lane_tokens:
            return None
        return lanes, length

    @torch.inference_mode()
    def run(self, roots: Tensor, root_pos: Tensor, ctx: DraftContext) -> DraftBlock:
        """`drafter.draft(roots, root_pos, ctx, ...)`. From a graph, the block is a view of static outputs that
        the next `run` overwrites."""
        b = roots.shape[0]
        key = self.key(b, ctx.length)
        entry = self._entry(key, None, lambda lanes: PaddedInputs.allocate(lanes, ctx, self.inputs_arena))
        if entry is None:
            self.eager_runs += 1
            return self.drafter.draft(roots, root_pos, ctx, self.embed_weight, self.lm_head_weight)
        entry.inputs.fill(roots, root_pos, ctx)
        return self._replay(entry, b)

    @torch.inference_mode()
    def run_paged(self, contexts: PagedDraftContext, seq_ids: list[int], roots: np.ndarray,
                  root_pos: np.ndarray) -> tuple[DraftBlock, Tensor]:
        """`drafter.draft` over `contexts.gather(seq_ids)`, gathered inside the key's graph from a table uploaded
        with one copy. Returns the block and the roots on the device; from a graph both are views of static
        buffers that the next run overwrites."""
        b = len(seq_ids)
        pages = contexts.page_bucket(seq_ids)
        key = self.key(b, pages * contexts.page_size)
        entry = self._entry(key, contexts, lambda lanes: PaddedInputs.for_pages(lanes, pages, contexts,
                                                                               self.inputs_arena))
        if entry is None:
            self.eager_runs += 1
            dev = to_device(np.stack([roots, root_pos]), self.device)
            ctx = contexts.gather(seq_ids)
            return self.drafter.draft(dev[0], dev[1], ctx, self.embed_weight, self.lm_head_weight), dev[0]
        entry.inputs.fill_table(contexts, seq_ids, roots, root_pos, self.staging)
        return self._replay(entry, b, contexts), entry.inputs.roots[:b]

    def _entry(self, key: Optional[tuple[int, int]], contexts: Optional[PagedDraftContext],
               inputs) -> Optional[KeyGraph]:
        """The key's graph, captured over inputs(lanes) on first use, and again when the pool it gathers from has
        moved; None: the pass runs eagerly."""
        entry = self.graphs.get(key) if key is not None else None
        source = contexts.pool_id if contexts is not None else None
        if entry is not None and entry.source == source:
            return entry
        if key is None or (entry is None and len(self.graphs) >= self.max_graphs):
            return None
        self.graphs[key] = self._capture(key, inputs(key[0]), contexts)
        if entry is None and len(self.graphs) == self.max_graphs:
            log.info("drafter graphs: %d keys captured; new keys run eagerly", self.max_graphs)
        return self.graphs[key]

    def _replay(self, entry: KeyGraph, b: int, contexts: Optional[PagedDraftContext] = None) -> DraftBlock:
        if entry.graph is not None:
            entry.graph.replay()
        else:
            entry.body(self.drafter, self.embed_weight, self.lm_head_weight, contexts)
        entry.replays += 1
        return DraftBlock(entry.hidden[:b], entry.base_logits[:b])

    def _capture(self, key: tuple[int, int], inputs: PaddedInputs,
                 contexts: Optional[PagedDraftContext] = None) -> KeyGraph:
        """A key's graph over `inputs` (all lanes padding until filled); contexts: the pool it gathers from."""
        lanes, _ = key
        s, vocab = self.drafter.cfg.block_size, self.lm_head_weight.shape[0]
        outputs = self.outputs_arena.take([(lanes, s, self.drafter.cfg.hidden_size), (lanes, s, vocab)],
                                          self.drafter.backbone.mask_embedding.dtype)
        entry = KeyGraph(inputs, *outputs, contexts.pool_id if contexts is not None else None)
        if not self.use_graphs:
            return entry
        entry.graph = capture_graph(lambda: entry.body(self.drafter, self.embed_weight, self.lm_head_weight, contexts),
                                    self.device, self.pool)
        return entry
