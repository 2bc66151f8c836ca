"""Drafter graphs on CUDA: replaying a key's graph gives the eager drafter pass (the same padded pass, and the
drafter's own unpadded one) over rounds with growing contexts and changing batches, a key replays with new
inputs, keys past `max_graphs` run eagerly, and the speculator drafts from the graphs unless
TIDAL_DRAFTER_GRAPHS=0."""
import random
from types import SimpleNamespace

import pytest
import torch

from speculative.speculator import Speculator
from speculative.context_cache import PagedDraftContext
from speculative.drafter import DominoDrafter, DrafterConfig
from speculative.drafter_graphs import DrafterGraphs, draft_padded

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
CFG = DrafterConfig(vocab_size=512, hidden_size=128, intermediate_size=256, num_layers=2, num_heads=4,
                    num_kv_heads=2, head_dim=32, target_layer_ids=(1, 3), block_size=16, gru_hidden=32,
                    correction_rank=16)
DEV = torch.device("cuda")


def make_drafter(dtype=torch.float32, seed=0):
    torch.manual_seed(seed)
    drafter = DominoDrafter(CFG).to(DEV, dtype).eval()
    embed = torch.randn(CFG.vocab_size, CFG.hidden_size, device=DEV, dtype=dtype)
    return drafter, embed, torch.randn(CFG.vocab_size, CFG.hidden_size, device=DEV, dtype=dtype)


class Contexts:
    """Sequences whose drafter contexts live in a real PagedDraftContext on the GPU."""

    def __init__(self, drafter, dtype, seed=0, page_size=16):
        self.drafter, self.dtype = drafter, dtype
        self.cache = PagedDraftContext(CFG.num_layers, CFG.num_kv_heads, CFG.head_dim, dtype, DEV,
                                       page_size=page_size, num_pages=8)
        self.gen = torch.Generator(DEV).manual_seed(seed)

    @torch.inference_mode()
    def grow(self, seq_id: int, count: int) -> None:
        start = self.cache.length(seq_id)
        slots = torch.tensor(self.cache.reserve(seq_id, start, count), device=DEV)
        hidden = torch.randn(1, count, CFG.context_size, generator=self.gen, device=DEV).to(self.dtype)
        positions = torch.arange(start, start + count, device=DEV)[None]
        self.cache.write(slots, self.drafter.backbone.context(hidden, positions))

    def round(self, seq_ids):
        roots = torch.randint(0, CFG.vocab_size, (len(seq_ids),), generator=self.gen, device=DEV)
        pos = torch.tensor([self.cache.length(s) for s in seq_ids], device=DEV)
        return roots, pos, self.cache.gather(seq_ids)


def check(graphs, roots, pos, ctx, tol):
    """A graphed run against the same padded pass eagerly (tight) and the drafter's own pass."""
    d, embed, head = graphs.drafter, graphs.embed_weight, graphs.lm_head_weight
    with torch.inference_mode():
        got = graphs.run(roots, pos, ctx)
        got = (got.hidden.clone(), got.base_logits.clone())
        padded = draft_padded(d, roots, pos, ctx, embed, head)
        plain = d.draft(roots, pos, ctx, embed, head)
    for g, p, e in zip(got, (padded.hidden, padded.base_logits), (plain.hidden, plain.base_logits)):
        assert g.shape == e.shape
        torch.testing.assert_close(g, p, rtol=tol, atol=tol)
        torch.testing.assert_close(g, e, rtol=10 * tol, atol=10 * tol)
    return got


@pytest.mark.parametrize("dtype,rounds,tol", [(torch.float32, 60, 1e-5), (torch.bfloat16, 20, 2e-2)])
def test_replays_equal_the_eager_pass_as_contexts_grow_and_batches_change(dtype, rounds, tol):
    drafter, embed, head = make_drafter(dtype)
    contexts = Contexts(drafter, dtype)
    graphs = DrafterGraphs(drafter, embed, head, max_graphs=64)
    rng = random.Random(1)
    for s in range(12):
        contexts.grow(s, rng.randint(1, 20))
    keys = []
    for _ in range(rounds):
        batch = rng.sample(range(12), rng.randint(1, 12))
        for s in batch:
            contexts.grow(s, rng.randint(1, 5))         # the previous round's root and accepted tokens
        roots, pos, ctx = contexts.round(batch)
        keys.append(graphs.key(len(batch), ctx.length))
        check(graphs, roots, pos, ctx, tol)
    assert graphs.eager_runs == 0 and set(graphs.graphs) == set(keys) and len(set(keys)) >= 4
    assert all(e.graph is not None for e in graphs.graphs.values())
    assert max(e.replays for e in graphs.graphs.values()) >= 2


def test_a_key_replays_with_new_inputs():
    drafter, embed, head = make_drafter(seed=2)
    contexts = Contexts(drafter, torch.float32, seed=3)
    for s in range(4):
        contexts.grow(s, 10 + s)
    graphs = DrafterGraphs(drafter, embed, head)
    first = check(graphs, *contexts.round([0, 1, 2]), 1e-5)       # padded to 4 lanes
    contexts.grow(3, 2)
    second = check(graphs, *contexts.round([3, 2, 1, 0]), 1e-5)   # the same key, other rows and roots
    assert len(graphs.graphs) == 1 and next(iter(graphs.graphs.values())).replays == 2
    assert not torch.equal(first[1][:3], second[1][:3])


def test_keys_past_max_graphs_run_eagerly():
    drafter, embed, head = make_drafter(seed=4)
    contexts = Contexts(drafter, torch.float32, seed=5)
    for s in range(8):
        contexts.grow(s, 20)
    graphs = DrafterGraphs(drafter, embed, head, max_graphs=2)
    batches = [[0], [0, 1], [0, 1, 2, 3], list(range(8))]      # four keys at one context length
    for batch in batches:
        check(graphs, *contexts.round(batch), 1e-5)
    assert [k for k, _ in graphs.graphs] == [1, 2] and graphs.eager_runs == 2
    roots, pos, ctx = contexts.round([5])
    check(graphs, roots, pos, ctx, 1e-5)                        # a captured key still replays afterwards
    check(graphs, *contexts.round(batches[3]), 1e-5)
    assert graphs.graphs[(1, ctx.length)].replays == 2 and graphs.eager_runs == 3


def speculator(monkeypatch, switch):
    monkeypatch.setenv("TIDAL_STATIC_DRAFT", "0")          # the drafter pass alone (`run`); static shapes have their own tests
    if switch is None:
        monkeypatch.delenv("TIDAL_DRAFTER_GRAPHS", raising=False)
    else:
        monkeypatch.setenv("TIDAL_DRAFTER_GRAPHS", switch)
    drafter, embed, _ = make_drafter(seed=6)
    return Speculator(drafter, "dominotree", 8, embed, embed, CFG.vocab_size, max_num_seqs=4)


@torch.inference_mode()
def test_the_speculator_drafts_from_the_graphs_unless_switched_off(monkeypatch):
    graphed, eager = speculator(monkeypatch, None), speculator(monkeypatch, "0")
    assert graphed.drafter_graphs is not None and eager.drafter_graphs is None
    gen = torch.Generator(DEV).manual_seed(7)
    aux = [torch.randn(40, CFG.hidden_size, generator=gen, device=DEV) for _ in graphed.aux_layers]
    seqs = [SimpleNamespace(seq_id=i, last_token_id=3 + i, num_tokens=1 + 10 * (i + 1)) for i in range(3)]
    for spec in (graphed, eager):
        for s in seqs:
            spec.observe_rows(s, aux, 0, 0, s.num_tokens - 1)
    for batch in (seqs[:1], seqs):
        trees = [spec.propose(batch, 8).trees for spec in (graphed, eager)]
        assert torch.equal(trees[0].tokens, trees[1].tokens) and torch.equal(trees[0].parents, trees[1].parents)
    assert len(graphed.drafter_graphs.graphs) == 2 and graphed.drafter_graphs.eager_runs == 0
