"""Drafter graphs on CPU: the padded pass (`draft_padded`, what a key's graph replays) equals the drafter's own
pass on the real rows, over contexts gathered by the real PagedDraftContext; garbage in the padded lanes of the
static buffers never reaches a real row; keys, limits and the shared arenas, with a replay that reruns the pass
eagerly on the static buffers as a CUDA graph would."""
import random

import torch

from speculative.speculator import Speculator
from speculative.context_cache import PagedDraftContext
from speculative.drafter import DominoDrafter, DrafterConfig
from speculative.drafter_graphs import DrafterGraphs, PaddedInputs, draft_padded, padded_batch

from tests.support.threads import one_thread  # noqa: F401  (autouse)

CFG = DrafterConfig(vocab_size=50, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4,
                    num_kv_heads=2, head_dim=8, target_layer_ids=(1, 3), block_size=4, gru_hidden=16,
                    correction_rank=8)
PAGE = 4


def make_drafter(seed=0):
    torch.manual_seed(seed)
    drafter = DominoDrafter(CFG).eval()
    return drafter, torch.randn(CFG.vocab_size, CFG.hidden_size), torch.randn(CFG.vocab_size, CFG.hidden_size)


class Contexts:
    """Sequences whose drafter contexts live in a real PagedDraftContext (random target hidden states)."""

    def __init__(self, drafter, seed=0):
        self.drafter = drafter
        self.cache = PagedDraftContext(CFG.num_layers, CFG.num_kv_heads, CFG.head_dim, torch.float32,
                                       torch.device("cpu"), page_size=PAGE, num_pages=4)
        self.gen = torch.Generator().manual_seed(seed)

    def grow(self, seq_id: int, count: int) -> None:
        start = self.cache.length(seq_id)
        slots = torch.tensor(self.cache.reserve(seq_id, start, count))
        hidden = torch.randn(1, count, CFG.context_size, generator=self.gen)
        self.cache.write(slots, self.drafter.backbone.context(hidden, torch.arange(start, start + count)[None]))

    def round(self, seq_ids: list[int]):
        """(roots, root positions, gathered context) of a round over these sequences."""
        roots = torch.randint(0, CFG.vocab_size, (len(seq_ids),), generator=self.gen)
        return roots, torch.tensor([self.cache.length(s) for s in seq_ids]), self.cache.gather(seq_ids)


def close(got, want):
    torch.testing.assert_close(got.hidden, want.hidden, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got.base_logits, want.base_logits, rtol=1e-5, atol=1e-5)


@torch.no_grad()
def test_padded_pass_equals_the_drafter_on_the_real_rows():
    drafter, embed, head = make_drafter()
    contexts = Contexts(drafter)
    rng = random.Random(1)
    lengths = set()
    for seq_id in range(9):
        contexts.grow(seq_id, rng.randint(1, 40))
    for _ in range(12):
        batch = rng.sample(range(9), rng.randint(1, 9))
        for s in batch:
            contexts.grow(s, rng.randint(1, 6))
        roots, pos, ctx = contexts.round(batch)
        pages = ctx.length // PAGE
        assert ctx.length % PAGE == 0 and pages & (pages - 1) == 0       # the gather's power-of-two bucket
        lengths.add(ctx.length)
        got = draft_padded(drafter, roots, pos, ctx, embed, head)
        assert got.hidden.shape == (len(batch), CFG.block_size, CFG.hidden_size)
        close(got, drafter.draft(roots, pos, ctx, embed, head))
    assert len(lengths) >= 2


@torch.no_grad()
def test_garbage_in_padded_lanes_does_not_reach_the_real_rows():
    drafter, embed, head = make_drafter(seed=2)
    contexts = Contexts(drafter, seed=3)
    for s, n in enumerate((5, 17, 9)):
        contexts.grow(s, n)
    roots, pos, ctx = contexts.round([0, 1, 2])
    clean = draft_padded(drafter, roots, pos, ctx, embed, head, PaddedInputs.allocate(8, ctx))
    dirty = PaddedInputs.allocate(8, ctx)
    for t in dirty.context.keys + dirty.context.values:
        t.fill_(float("nan"))
        t[:, ::2] = 1e30
    dirty.roots.fill_(CFG.vocab_size - 1)
    dirty.positions.fill_(10 ** 6)
    dirty.valid.fill_(True)
    got = draft_padded(drafter, roots, pos, ctx, embed, head, dirty)
    assert torch.equal(got.hidden, clean.hidden) and torch.equal(got.base_logits, clean.base_logits)
    assert not dirty.roots[3:].any() and not dirty.positions[3:].any() and not dirty.valid[3:].any()
    assert torch.isnan(dirty.context.keys[0][3:]).any()          # the padded lanes' context is left as it was


def test_keys_and_limits():
    assert [padded_batch(b) for b in (1, 2, 3, 4, 5, 17, 256)] == [1, 2, 4, 4, 8, 32, 256]
    assert padded_batch(257) is None and padded_batch(0) is None and padded_batch(9, max_batch=8) is None
    drafter, embed, head = make_drafter()
    lane_bytes = 2 * CFG.num_layers * CFG.num_kv_heads * CFG.head_dim * 4
    graphs = DrafterGraphs(drafter, embed, head, max_batch=64, max_input_bytes=512 * lane_bytes, use_graphs=False)
    assert graphs.key(3, 32) == (4, 32) and graphs.key(1, 512) == (1, 512) and graphs.key(16, 32) == (16, 32)
    assert graphs.key(2, 512) is None and graphs.key(65, 4) is None      # above the input bytes / the batch cap


@torch.no_grad()
def test_keys_replay_on_shared_buffers_and_new_keys_past_the_limit_run_eagerly():
    drafter, embed, head = make_drafter(seed=4)
    contexts = Contexts(drafter, seed=5)
    graphs = DrafterGraphs(drafter, embed, head, max_graphs=3, use_graphs=False)
    rng = random.Random(6)
    for s in range(8):
        contexts.grow(s, rng.randint(1, 12))
    seen = []
    for step in range(30):
        batch = rng.sample(range(8), rng.choice((1, 2, 3, 5, 8)))
        for s in batch:
            contexts.grow(s, rng.randint(0, 3) or 1)
        roots, pos, ctx = contexts.round(batch)
        key = graphs.key(len(batch), ctx.length)
        before = graphs.eager_runs
        got = graphs.run(roots, pos, ctx)
        close(got, drafter.draft(roots, pos, ctx, embed, head))
        if key not in seen:
            seen.append(key)
        assert (graphs.eager_runs > before) == (key not in seen[:3])
    assert list(graphs.graphs) == seen[:3] and len(seen) > 3
    assert sum(e.replays for e in graphs.graphs.values()) + graphs.eager_runs == 30


@torch.no_grad()
def test_an_output_is_a_view_the_next_run_overwrites():
    drafter, embed, head = make_drafter(seed=7)
    contexts = Contexts(drafter, seed=8)
    for s in range(2):
        contexts.grow(s, 6)
    graphs = DrafterGraphs(drafter, embed, head, use_graphs=False)
    first = graphs.run(*contexts.round([0, 1]))
    kept = first.base_logits.clone()
    roots, pos, ctx = contexts.round([1])
    second = graphs.run(roots, pos, ctx)
    assert second.base_logits.shape[0] == 1
    assert not torch.equal(first.base_logits, kept)          # same output arena: the first block was overwritten
    close(second, drafter.draft(roots, pos, ctx, embed, head))


def test_the_cpu_speculator_drafts_eagerly(monkeypatch):
    monkeypatch.delenv("TIDAL_DRAFTER_GRAPHS", raising=False)
    drafter, embed, _ = make_drafter()
    spec = Speculator(drafter, "dominotree", 8, embed, embed, CFG.vocab_size, max_num_seqs=4)
    assert spec.drafter_graphs is None


@torch.no_grad()
def test_keys_carve_their_context_buffers_from_the_start_of_one_arena():
    drafter, embed, head = make_drafter()
    contexts = Contexts(drafter)
    contexts.grow(0, 3)
    ctx = contexts.round([0])[2]
    graphs = DrafterGraphs(drafter, embed, head, use_graphs=False)
    a = PaddedInputs.allocate(4, ctx, graphs.inputs_arena)
    b = PaddedInputs.allocate(2, ctx, graphs.inputs_arena)
    assert a.context.keys[0].data_ptr() == b.context.keys[0].data_ptr()      # b fits: no new buffer
    c = PaddedInputs.allocate(16, ctx, graphs.inputs_arena)                   # grows; a and b keep the old one
    assert graphs.inputs_arena.buffers[torch.float32].data_ptr() == c.context.keys[0].data_ptr()
    per_lane = ctx.length * CFG.num_kv_heads * CFG.head_dim * 2 * CFG.num_layers
    assert graphs.inputs_arena.buffers[torch.float32].numel() == 16 * per_lane        # at least twice 4 lanes
    tensors = a.context.keys + a.context.values
    ends = [t.data_ptr() + t.numel() * t.element_size() for t in tensors]
    assert all(t.data_ptr() == end for t, end in zip(tensors[1:], ends))  # back to back, no overlap
