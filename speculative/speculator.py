"""The drafting half of a speculative round, the engine's `Proposer` (replicas.speculation_api): per-sequence
drafter context, the batch-aware budget, and the draft trees a step verifies (docs/speculative.md, steps 1-5
and 8). The verifying half is speculative/verifier.py.

Every computed token's target hidden states (the residual stream after the drafter's target layers) enter its
sequence's context once, in position order: a prefill chunk's rows, a plain decode's row, a verify round's
root and accepted nodes. A preempted sequence recomputes from scratch, so its context is cut back to the
position it restarts from. Positions the engine never computed (prefix-cache hits) are simply absent.

What a speculative engine pays when it does not draft: with a policy that never speculates (`enabled` False)
nothing at all, the engine runs as a plain one (plain decode graphs, no aux outputs, no context work). Otherwise
a step that does not draft records its rows (a few numpy calls) and the drafter's context projection runs once
per round, over every row observed since the last one (speculative/context_cache.py, PendingObservations).

On CUDA a round is a few copies and graph replays on static shapes: the context update padded to a row bucket
(speculative/context_graphs.py), then the gather and the drafter pass in one graph per (batch, context) bucket
(speculative/drafter_graphs.py, `run_paged`). TIDAL_STATIC_DRAFT=0 graphs only the drafter pass (`run`) and
runs the context update and gather eagerly; TIDAL_DRAFTER_GRAPHS=0, and CPU, run everything eagerly.
"""
from __future__ import annotations

from typing import Optional

import numpy as np
import torch
from torch import Tensor
from torch.profiler import record_function

from replicas.config import EngineConfig, ModelConfig
from replicas.sequence import Sequence
from replicas.speculation_api import DraftProposal
from speculative.baselines import METHODS, make_builder
from replicas.transfer import to_device
from speculative.context_cache import PagedDraftContext, PendingObservations
from speculative.context_graphs import FlushGraphs, flush_eager
from speculative.cost_model import FixedBudgetPolicy, KneeBudgetPolicy
from speculative.drafter import DominoDrafter, DrafterConfig
from speculative.drafters.loading import load_drafter
from speculative.drafter_graphs import DrafterGraphs, graphs_enabled, static_draft_enabled
from speculative.tree import gate_table, prepare_round
from speculative.tree_gpu import GraphTreeBuilder


class Speculator:
    def __init__(self, drafter: DominoDrafter, method: str, budget: int, embed_weight: Tensor,
                 lm_head_weight: Tensor, vocab_size: int, max_num_seqs: int, static_shapes: Optional[bool] = None):
        """static_shapes: the context update and the drafter pass on padded static buffers, replayed from CUDA
        graphs on CUDA (default on CUDA unless TIDAL_STATIC_DRAFT=0); True on CPU runs that path eagerly."""
        self.drafter = drafter.eval()
        self.cfg: DrafterConfig = drafter.cfg
        self.method = method
        self.max_budget = budget
        self.embed_weight, self.lm_head_weight = embed_weight, lm_head_weight
        self.vocab_size = vocab_size
        ids = self.cfg.target_layer_ids
        self.aux_layers = tuple(sorted(set(ids)))
        self._aux_order = [self.aux_layers.index(i) for i in ids]
        # Until a VerifyProfile is measured on the serving GPU: speculate only while the verify forward stays
        # below the memory-bound knee (speculative/cost_model.py).
        self.policy = KneeBudgetPolicy(budget) if budget > 0 else None
        self._builders: dict[int, object] = {}
        self._graph_builders: dict[int, GraphTreeBuilder] = {}
        self._tree_pool = None
        self._gates: Optional[Tensor] = None
        cfg = self.cfg
        self.contexts = PagedDraftContext(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, embed_weight.dtype,
                                          embed_weight.device, num_pages=max(64, 2 * max_num_seqs))
        self._pending = PendingObservations(self._aux_order)
        # CUDA: the drafter pass (with static shapes also the gather) replays a graph per (batch bucket, context
        # bucket), the context update one per row bucket with static shapes; captured on first use
        graphs = embed_weight.device.type == "cuda" and graphs_enabled()
        if static_shapes is None:
            static_shapes = graphs and static_draft_enabled()
        self.static_shapes = static_shapes
        self.drafter_graphs = DrafterGraphs(self.drafter, embed_weight, lm_head_weight) \
            if static_shapes or graphs else None
        self.flush_graphs = FlushGraphs(self.drafter.backbone, embed_weight.dtype, embed_weight.device,
                                        pool=self.drafter_graphs.pool) if static_shapes else None

    @staticmethod
    def create(config: EngineConfig, model_config: ModelConfig, runner) -> "Speculator":
        if config.speculative.method not in METHODS:
            raise ValueError(f"speculative={config.speculative.method!r}: choose one of {sorted(METHODS)}")
        from speculative.drafters import bundled_drafter
        path = config.speculative.drafter or bundled_drafter(model_config)
        if path is not None:
            drafter = load_drafter(path, runner.device, runner.dtype, target=model_config)
        elif config.speculative.allow_random_drafter:
            torch.manual_seed(config.seed)
            drafter = DominoDrafter(DrafterConfig.for_target(model_config)).to(runner.device, runner.dtype)
        else:
            raise ValueError("speculative decoding needs a trained drafter and none is bundled for this model: "
                             "pass drafter=<folder saved by DominoDrafter.save, or a published DFlash / Domino "
                             "checkpoint>")
        if drafter.cfg.vocab_size != model_config.vocab_size or drafter.cfg.hidden_size != model_config.hidden_size:
            raise ValueError("the drafter was trained for another target (vocab or hidden size differs)")
        # rank 0 drafts for the whole group: at TP > 1 it holds a full copy of the embedding and LM head
        embed, head = runner.call_all("full_vocab_weights")
        spec = Speculator(drafter, config.speculative.method, config.speculative.budget, embed, head,
                          model_config.vocab_size, config.scheduling.max_num_seqs)
        runner.call_all("capture_aux_graphs", spec.aux_layers)    # CUDA only: plain decode steps stay graphed
        if spec.max_budget > 0:
            spec.use_policy(budget_policy(config.speculative.policy, runner, spec), runner)
        return spec

    # ---- budget -----------------------------------------------------------------------------
    @property
    def enabled(self) -> bool:
        """False when the policy never speculates: the engine then runs exactly as a plain engine."""
        return self.policy is not None and self.policy.top_budget > 0

    def use_policy(self, policy, runner=None) -> None:
        """Serve with `policy` from now on; with the runner's CUDA graphs, the verify graphs it needs are captured
        (and those it never uses dropped), the tree graphs of its budgets too."""
        self.policy = policy
        if runner is not None and runner.graphs is not None:
            from speculative.profile import keep_verify_graphs
            keep_verify_graphs(runner, self)

    def budget(self, batch_size: int) -> int:
        """Draft nodes per decoding sequence for a batch of this size (0 = plain decoding)."""
        n = self.policy.budget(max(1, batch_size)) if self.policy is not None else 0
        return min(n, self.cfg.block_size) if self.method == "chain" else n      # a chain is one path

    def record_round(self, batch_size: int, nodes: int, seconds: float, tokens_per_seq: float) -> None:
        observe = getattr(self.policy, "observe", None)
        if observe is not None:
            observe(batch_size, nodes, seconds, tokens_per_seq)

    def builder(self, n: int):
        if n not in self._builders:
            opts = dict(max_depth=min(n, self.cfg.block_size)) if self.method == "chain" else \
                dict(budget=n, max_depth=self.cfg.block_size)
            self._builders[n] = make_builder(self.method, **opts)
        return self._builders[n]

    def gates(self, cfg) -> Optional[Tensor]:
        if cfg.corrected and self._gates is None:
            self._gates = gate_table(self.drafter.head, self.embed_weight)
        return self._gates if cfg.corrected else None

    def graph_builder(self, n: int) -> GraphTreeBuilder:
        """CUDA: the tree for n nodes built by replaying a graph per batch bucket (captured on first use)."""
        if n not in self._graph_builders:
            if self._tree_pool is None:
                self._tree_pool = torch.cuda.graph_pool_handle()     # one pool for every budget's graphs
            cfg = self.builder(n).cfg
            self._graph_builders[n] = GraphTreeBuilder(
                self.drafter.head, self.embed_weight, cfg, self.cfg.block_size, self.vocab_size,
                self.cfg.hidden_size, self.embed_weight.dtype, gates=self.gates(cfg), pool=self._tree_pool)
        return self._graph_builders[n]

    # ---- context ----------------------------------------------------------------------------
    def observe_step(self, batch, step, aux: list[Tensor]) -> None:
        """The step's plain rows (every sequence that verified no tree): their computed tokens' hidden states, in
        `aux` (the runner's `last_aux_hidden`), enter the drafter context when a round needs it."""
        counts = np.diff(step.query_start_loc)
        seq_ids = np.fromiter((s.seq_id for s in batch.seqs), np.int64, len(batch.seqs))
        if any(batch.drafts):
            rows = np.flatnonzero(np.repeat(np.asarray(batch.drafts) == 0, counts))
            self.observe(aux, rows, np.repeat(seq_ids, counts)[rows], step.positions[rows])
        else:                                                    # every row: decodes and prefill chunks
            ids = seq_ids if step.num_tokens == len(seq_ids) else np.repeat(seq_ids, counts)
            self.observe(aux, None, ids, step.positions)

    def observe(self, aux: list[Tensor], rows: Optional[np.ndarray], seq_ids: np.ndarray,
                positions: np.ndarray) -> None:
        """Rows `rows` of `aux` (None: all) hold sequence seq_ids[i]'s token at positions[i]. Deferred: projected
        into context K/V at the next `flush` (a round's `propose`, or when the held rows pass a bound)."""
        self._pending.add(aux, rows, seq_ids, positions)
        if self._pending.full:
            self.flush()

    def observe_rows(self, seq: Sequence, aux: list[Tensor], first_row: int, first_position: int, n: int) -> None:
        """One sequence's n computed tokens, from step row `first_row`, at first_position..+n-1."""
        self.observe_at(seq, aux, range(first_row, first_row + n), first_position)

    def observe_at(self, seq: Sequence, aux: list[Tensor], rows, first_position: int) -> None:
        """Step rows `rows` of `aux` hold seq's tokens at first_position, +1, ..."""
        rows = np.asarray(rows, dtype=np.int64)
        self.observe(aux, rows, np.full(len(rows), seq.seq_id, np.int64),
                     np.arange(first_position, first_position + len(rows), dtype=np.int64))

    @torch.inference_mode()
    def flush(self) -> None:
        """Project every pending row's hidden states into drafter context K/V (one batched pass) and store them."""
        if self.flush_graphs is not None:
            self.flush_graphs.flush(self.contexts, self._pending)
            return
        taken = self._pending.take()
        if taken is not None:
            flush_eager(self.drafter.backbone, self.contexts, *taken, self.embed_weight.dtype)

    @property
    def num_tracked(self) -> int:
        return len(self.contexts.lengths)

    def forget(self, seq: Sequence) -> None:
        self._pending.forget(seq.seq_id)
        self.contexts.forget(seq.seq_id)

    # ---- drafting ---------------------------------------------------------------------------
    @torch.inference_mode()
    def propose(self, seqs: list[Sequence], n: int) -> DraftProposal:
        """One draft tree of n nodes per sequence, rooted at its last (uncomputed) token."""
        # The labels name the round's parts for torch.profiler (bench/draft_round.py); nearly free when it is off.
        # With static shapes, the context gather is part of the drafter pass's graph.
        host = np.asarray([[s.last_token_id for s in seqs], [s.num_tokens - 1 for s in seqs]], dtype=np.int64)
        seq_ids = [s.seq_id for s in seqs]
        with record_function("draft:context"):
            self.flush()
            if not self.static_shapes:
                roots, root_pos = to_device(host, self.embed_weight.device)
                context = self.contexts.gather(seq_ids)
        with record_function("draft:drafter"):              # a graph's block (and roots) live until its next run
            if self.static_shapes:
                block, roots = self.drafter_graphs.run_paged(self.contexts, seq_ids, host[0], host[1])
            elif self.drafter_graphs is not None:
                block = self.drafter_graphs.run(roots, root_pos, context)
            else:
                block = self.drafter.draft(roots, root_pos, context, self.embed_weight, self.lm_head_weight)
            base = block.base_logits[..., :self.vocab_size]
        with record_function("draft:tree"):
            if self.embed_weight.device.type == "cuda":
                tree = self.graph_builder(n).build(block.hidden, base, roots)
            else:
                builder = self.builder(n)
                rnd = prepare_round(self.drafter.head, block.hidden, base, roots, self.embed_weight, builder.cfg,
                                    self.gates(builder.cfg))
                tree = builder.build(rnd)
        with record_function("draft:rows"):
            return DraftProposal(tree.verify_rows(), tree)


def budget_policy(kind: str, runner, spec: Speculator):
    """The configured policy ("measured" | "knee" | "fixed", EngineConfig.speculative.policy) for `spec`."""
    if kind == "fixed":
        return FixedBudgetPolicy(spec.max_budget)
    if kind == "knee":
        return KneeBudgetPolicy(spec.max_budget)
    from speculative.profile import measured_budget_policy
    return measured_budget_policy(runner, spec)        # captures the tree and verify graphs of its budgets
