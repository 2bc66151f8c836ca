"""The drafting half of a speculative round: per-sequence drafter context, the batch-aware budget, and the
draft trees a step verifies (docs/speculative.md, steps 1-5 and 8). The verifying half is replicas/spec_verify.py.

Every computed token's target hidden states (the residual stream after the drafter's target layers) enter its
sequence's context once, in position order: a prefill chunk's rows, a plain decode's row, a verify round's
root and accepted nodes. A preempted sequence recomputes from scratch, so its context is cut back to the
position it restarts from. Positions the engine never computed (prefix-cache hits) are simply absent.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from replicas.config import EngineConfig, ModelConfig
from replicas.sequence import Sequence
from replicas.step_input import TreeRow
from speculative.baselines import make_builder
from speculative.cost_model import AcceptanceProfile, BudgetPolicy, VerifyProfile
from speculative.drafter import DominoDrafter, DraftContext, DrafterConfig
from speculative.tree import DraftTree, gate_table, prepare_round


def default_budget_policy(budget: int, max_num_seqs: int) -> BudgetPolicy:
    """A stand-in profile until one is measured on the serving GPU: a step costs 1 + tokens/512 (memory-bound
    below ~512 tokens), drafting 0.1 of a plain step, 2 tokens accepted per round. Small batches get `budget`,
    large ones 0."""
    sizes = sorted({1 << i for i in range(max(1, max_num_seqs).bit_length() + 1)} | {max_num_seqs})
    step = {b: {n: 1.0 + b * (1 + n) / 512 for n in (0, budget)} for b in sizes}
    return BudgetPolicy(VerifyProfile(step, {b: 0.1 for b in sizes}), AcceptanceProfile({budget: 2.0}))


class Speculator:
    def __init__(self, drafter: DominoDrafter, method: str, budget: int, embed_weight: Tensor,
                 lm_head_weight: Tensor, vocab_size: int, max_num_seqs: int):
        self.drafter = drafter.eval()
        self.cfg: DrafterConfig = drafter.cfg
        self.method = method
        self.max_budget = budget
        self.embed_weight, self.lm_head_weight = embed_weight, lm_head_weight
        self.vocab_size = vocab_size
        ids = self.cfg.target_layer_ids
        self.aux_layers = tuple(sorted(set(ids)))
        self._aux_order = [self.aux_layers.index(i) for i in ids]
        self.policy = default_budget_policy(budget, max_num_seqs) if budget > 0 else None
        self._builders: dict[int, object] = {}
        self._gates: Optional[Tensor] = None
        self._contexts: dict[int, tuple[DraftContext, Tensor]] = {}   # seq_id -> (context, its positions [T])

    @staticmethod
    def create(config: EngineConfig, model_config: ModelConfig, runner) -> "Speculator":
        if config.speculative not in ("dominotree", "chain", "ddtree"):
            raise ValueError(f"speculative={config.speculative!r}: choose dominotree, chain or ddtree")
        if runner.world_size > 1:
            raise ValueError("speculative decoding needs tensor_parallel_size=1 (the drafter reads the full "
                             "embedding and LM head on rank 0)")
        from speculative.drafters import bundled_drafter
        path = config.drafter or bundled_drafter(model_config)
        if path is not None:
            drafter = DominoDrafter.load(path, runner.device, runner.dtype)
        elif config.allow_random_drafter:
            torch.manual_seed(config.seed)
            drafter = DominoDrafter(DrafterConfig.for_target(model_config)).to(runner.device, runner.dtype)
        else:
            raise ValueError("speculative decoding needs a trained drafter and none is bundled for this model: "
                             "pass drafter=<folder saved by DominoDrafter.save>")
        if drafter.cfg.vocab_size != model_config.vocab_size or drafter.cfg.hidden_size != model_config.hidden_size:
            raise ValueError("the drafter was trained for another target (vocab or hidden size differs)")
        model = runner.model
        return Speculator(drafter, config.speculative, config.spec_budget, model.model.embed_tokens.weight,
                          model.lm_head.weight, model_config.vocab_size, config.max_num_seqs)

    # ---- budget -----------------------------------------------------------------------------
    def budget(self, batch_size: int) -> int:
        """Draft nodes per decoding sequence for a batch of this size (0 = plain decoding)."""
        n = self.policy.budget(max(1, batch_size)) if self.policy is not None else 0
        return min(n, self.cfg.block_size) if self.method == "chain" else n      # a chain is one path

    def builder(self, n: int):
        if n not in self._builders:
            opts = dict(max_depth=min(n, self.cfg.block_size)) if self.method == "chain" else \
                dict(budget=n, max_depth=self.cfg.block_size)
            self._builders[n] = make_builder(self.method, **opts)
        return self._builders[n]

    # ---- context ----------------------------------------------------------------------------
    def target_hidden(self, aux: list[Tensor], rows: Tensor) -> Tensor:
        """[len(rows), layers * hidden] in the drafter's layer order, from the runner's `last_aux_hidden`."""
        return torch.cat([aux[j][rows] for j in self._aux_order], -1)

    def observe_rows(self, seq: Sequence, aux: list[Tensor], first_row: int, first_position: int, n: int) -> None:
        """A plain row of the step: its n computed tokens, from step row `first_row`, at first_position..+n-1."""
        rows = torch.arange(first_row, first_row + n)
        self.observe(seq, self.target_hidden(aux, rows), list(range(first_position, first_position + n)))

    @torch.inference_mode()
    def observe(self, seq: Sequence, hidden: Tensor, positions: list[int]) -> None:
        """Append computed tokens' hidden states [T, C] at absolute `positions` (ascending) to seq's context."""
        if not positions:
            return
        pos = torch.tensor(positions, dtype=torch.long, device=hidden.device)
        new = self.drafter.backbone.context(hidden[None].to(self.embed_weight.dtype), pos[None])
        found = self._contexts.get(seq.seq_id)
        if found is not None:
            ctx, old = found
            keep = int((old < positions[0]).sum())            # a recompute after preemption cuts back
            if keep:
                new, pos = _slice(ctx, keep).concat(new), torch.cat([old[:keep], pos])
        self._contexts[seq.seq_id] = (new, pos)

    def forget(self, seq: Sequence) -> None:
        self._contexts.pop(seq.seq_id, None)

    def _context(self, seq: Sequence) -> DraftContext:
        found = self._contexts.get(seq.seq_id)
        if found is not None:
            return found[0]
        dev = self.embed_weight.device
        return self.drafter.backbone.context(torch.zeros(1, 0, self.cfg.context_size, device=dev,
                                                         dtype=self.embed_weight.dtype),
                                             torch.zeros(1, 0, dtype=torch.long, device=dev))

    # ---- drafting ---------------------------------------------------------------------------
    @torch.inference_mode()
    def propose(self, seqs: list[Sequence], n: int) -> tuple[DraftTree, list[TreeRow]]:
        """One draft tree of n nodes per sequence, rooted at its last (uncomputed) token."""
        dev = self.embed_weight.device
        roots = torch.tensor([s.last_token_id for s in seqs], dtype=torch.long, device=dev)
        root_pos = torch.tensor([s.num_tokens - 1 for s in seqs], dtype=torch.long, device=dev)
        block = self.drafter.draft(roots, root_pos, DraftContext.stack([self._context(s) for s in seqs]),
                                   self.embed_weight, self.lm_head_weight)
        builder = self.builder(n)
        if builder.cfg.corrected and self._gates is None:
            self._gates = gate_table(self.drafter.head, self.embed_weight)
        rnd = prepare_round(self.drafter.head, block.hidden, block.base_logits[..., :self.vocab_size], roots,
                            self.embed_weight, builder.cfg, self._gates)
        tree = builder.build(rnd)
        return tree, tree_rows(tree)


def tree_rows(tree: DraftTree) -> list[TreeRow]:
    """Host copies of each request's tree for the step input."""
    tokens, offsets = tree.tokens.tolist(), tree.position_offsets().tolist()
    masks = tree.tree_attention_mask().cpu().numpy()
    return [TreeRow(tokens[b], offsets[b], masks[b]) for b in range(len(tokens))]


def _slice(ctx: DraftContext, keep: int) -> DraftContext:
    return DraftContext([k[:, :keep] for k in ctx.keys], [v[:, :keep] for v in ctx.values], ctx.valid[:, :keep])
