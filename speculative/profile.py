"""Measures a VerifyProfile on the serving device at start-up, for the cost-model budget policy
(speculative/cost_model.py).

For each batch size b and draft-node count n it times the step a speculative round really runs: the target's
forward over b requests x (1+n) tokens with a tree mask (a chain, same cost as any tree of n nodes), the
drafter's aux layers and the logits of every row; n = 0 is the plain decode step (graphed when the runner has
decode graphs). Each request reads a `context_len`-token prefix from block 0 and writes no K/V (slot -1), so
the cache is untouched. The drafter's cost per batch size is one round's drafting for b sequences: the context
update of the previous round's root and accepted token, the draft block, the tree build and the verify rows
(tokens, position offsets, mask) on the device. Times are medians of host wall-clock with the device
synchronised before and after, i.e. what a round costs the engine loop.

With the runner's CUDA graphs, verify steps of (bucket, n) up to VERIFY_GRAPH_TOKENS tokens are captured before
they are timed, so the policy weighs what the engine will replay; once the policy is chosen, only the verify
graphs it can use are kept (`keep_verify_graphs`).
"""
from __future__ import annotations

import statistics
import time
from types import SimpleNamespace
from typing import Callable, Optional, Sequence

import numpy as np
import torch

from replicas.step_input import StepInput, StepTrees
from speculative.cost_model import AcceptanceProfile, BudgetPolicy, VerifyProfile
from speculative.draft_tree import DraftTree

# Accepted draft tokens per round assumed at every budget until acceptance is measured (tau = 2): below what
# trained block drafters reach, so the policy stays conservative. Flat in n, so the policy picks the cheapest
# budget that beats plain decoding.
PRIOR_ACCEPTED = 1.0
# Verify graphs are captured for steps of at most this many tokens (batch bucket x (1 + nodes)), the mixed-step
# graphs' bound for a model that is not small (cuda_graphs.MIXED_GRAPH_TOKENS): a small model's eager step stays
# launch-bound far past it, so the graph removes most of the step, and the graphs' memory stays bounded.
VERIFY_GRAPH_TOKENS = 1024
# The largest batch profiled on a CPU (larger batches then never speculate): there a forward's cost grows with its
# tokens from the first one, so a verify step of b x (1 + n) tokens only pays at small b, and profiling larger
# batches would only lengthen start-up.
CPU_LARGEST_BATCH = 8


def verify_step(runner, batch: int, nodes: int, context_len: int, aux_layers: tuple[int, ...]) -> StepInput:
    q = 1 + nodes if nodes else 1
    lens = np.full(batch, context_len + q, dtype=np.int32)
    qsl = np.arange(0, batch * q + 1, q, dtype=np.int32)
    width = -(-(context_len + q) // runner.block_size)
    trees = None
    if nodes:
        depths = torch.arange(nodes, device=runner.device).expand(batch, nodes)
        chain = DraftTree(torch.zeros_like(depths), depths - 1, depths, torch.zeros(depths.shape, device=depths.device),
                          torch.ones_like(depths, dtype=torch.bool))
        trees = StepTrees(np.arange(batch, dtype=np.int64), chain.verify_rows())
    return StepInput(
        input_ids=np.zeros(batch * q, np.int64),
        positions=np.full(batch * q, context_len, np.int64) if nodes else np.full(batch, context_len, np.int64),
        slot_mapping=np.full(batch * q, -1, np.int64), query_start_loc=qsl, seq_lens=lens,
        block_tables=np.zeros((batch, width), np.int32),
        sample_indices=np.arange(batch * q, dtype=np.int64) if nodes else qsl[1:].astype(np.int64) - 1,
        trees=trees, aux_layers=aux_layers)


def median_seconds(fn: Callable[[], object], device: torch.device, warmup: int, iters: int) -> float:
    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


@torch.inference_mode()
def measure_verify_profile(runner, speculator, batch_sizes: Sequence[int], node_counts: Sequence[int],
                           context_len: int = 256, warmup: int = 2, iters: int = 5) -> VerifyProfile:
    """Timed verify forwards (through a CUDA graph where the runner has one) and draft rounds; a (batch, nodes)
    whose step exceeds the scheduler's token budget (it never runs) is left out."""
    cfg = runner.config.scheduling
    context_len = min(context_len, runner.max_model_len - 1 - max(node_counts, default=0))
    hidden = runner.model_config.hidden_size
    aux = [torch.zeros(context_len, hidden, dtype=runner.dtype, device=runner.device) for _ in speculator.aux_layers]
    step_seconds: dict[int, dict[int, float]] = {}
    draft_seconds: dict[int, float] = {}
    graphed = set()
    for b in sorted(set(batch_sizes)):
        row = {}
        for n in sorted({0, *node_counts}):
            if b * (1 + n) > cfg.max_num_batched_tokens or b > cfg.max_num_seqs:
                continue
            step = verify_step(runner, b, n, context_len, speculator.aux_layers)
            if runner.graphs is not None and runner.graphs.can_run(step):
                graphed.add((b, n))
            row[n] = median_seconds(lambda: runner.execute(step).argmax(-1), runner.device, warmup, iters)
        if 0 not in row:
            continue
        step_seconds[b] = row
        if runner.device.type == "cuda":
            for n in row:
                if n:
                    speculator.graph_builder(n)      # tree graphs captured at start-up, not while serving
        if len(row) > 1:
            draft_seconds[b] = _draft_seconds(speculator, b, max(row), aux, context_len, runner.device, warmup,
                                              iters)
    return VerifyProfile(step_seconds, draft_seconds, frozenset(graphed))


def _draft_seconds(speculator, batch: int, nodes: int, aux, context_len: int, device, warmup: int,
                   iters: int) -> float:
    round_, done = draft_round(speculator, batch, nodes, aux, context_len)
    try:
        return median_seconds(round_, device, warmup, iters)
    finally:
        done()


def draft_round(speculator, batch: int, nodes: int, aux, context_len: int):
    """(round, cleanup): a round's drafting for `batch` stand-in sequences with a context_len-token context each:
    the context update of the previous round (root + PRIOR_ACCEPTED tokens), the draft block, the tree and its
    verify rows; cleanup forgets the stand-ins."""
    seqs = [SimpleNamespace(seq_id=-1 - i, last_token_id=0, num_tokens=context_len + 1) for i in range(batch)]
    ids = np.repeat(np.asarray([s.seq_id for s in seqs], np.int64), context_len)
    speculator.observe(aux, np.tile(np.arange(context_len), batch), ids, np.tile(np.arange(context_len), batch))
    speculator.flush()
    per_round = 1 + int(PRIOR_ACCEPTED)
    rows = np.arange(per_round)

    def round_():
        start = seqs[0].num_tokens
        speculator.observe(aux, np.tile(rows, batch), np.repeat(ids[::context_len], per_round),
                           np.tile(start + rows, batch))
        for s in seqs:
            s.num_tokens += per_round
        speculator.propose(seqs, nodes)

    def done():
        for s in seqs:
            speculator.forget(s)
    return round_, done


def _candidate_shapes(runner, budgets: Sequence[int], largest_batch: Optional[int] = None) -> set[tuple[int, int]]:
    """(bucket, nodes) verify graphs worth having for these budgets: within VERIFY_GRAPH_TOKENS and the token budget,
    for buckets up to the one holding `largest_batch` if given (the policy never drafts above its largest measured
    batch)."""
    cfg, graphs = runner.config.scheduling, runner.graphs
    limit = min(VERIFY_GRAPH_TOKENS, cfg.max_num_batched_tokens)
    top = graphs.sizes[-1] if largest_batch is None else \
        next((b for b in graphs.sizes if b >= largest_batch), graphs.sizes[-1])
    return {(b, n) for b in graphs.sizes for n in budgets if n > 0 and b <= top and b * (1 + n) <= limit}


def keep_verify_graphs(runner, speculator) -> None:
    """Capture the verify graphs the speculator's policy can use and release the others (CUDA graphs only)."""
    graphs, policy = runner.graphs, speculator.policy
    if graphs is None:
        return
    want = set()
    for b in range(1, min(runner.config.scheduling.max_num_seqs, graphs.sizes[-1]) + 1):
        n = speculator.budget(b) if policy is not None else 0
        if n:
            want.add((graphs.bucket(b), n))
    want &= _candidate_shapes(runner, sorted({n for _, n in want}))
    runner.call_all("keep_verify_graphs", want)
    if runner.device.type == "cuda":
        for n in {n for _, n in want}:
            speculator.graph_builder(n)


def measured_budget_policy(runner, speculator) -> BudgetPolicy:
    """The cost-model policy over a profile measured now, at the batch sizes the engine can run and budgets of
    the configured maximum, its half and its quarter (verify steps graphed where they will be)."""
    top = speculator.max_budget
    budgets = sorted({n for n in (top, top // 2, top // 4) if n > 0})
    most = runner.config.scheduling.max_num_seqs
    largest = 64 if runner.device.type == "cuda" else CPU_LARGEST_BATCH
    sizes = [b for b in (1, 2, 4, 8, 16, 32, 64) if b <= min(most, largest)] + ([most] if most < largest else [])
    if runner.graphs is not None:
        runner.call_all("add_verify_graphs", _candidate_shapes(runner, budgets, max(sizes)))
    on_gpu = runner.device.type == "cuda"
    profile = measure_verify_profile(runner, speculator, sorted(set(sizes)), budgets, warmup=2 if on_gpu else 1,
                                     iters=5 if on_gpu else 3)
    return BudgetPolicy(profile, AcceptanceProfile({n: PRIOR_ACCEPTED for n in budgets if n > 0}))
