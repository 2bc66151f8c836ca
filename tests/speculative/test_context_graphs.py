"""The draft side's context update on static shapes, on CPU (the padded code the CUDA graphs replay, run eagerly):
the gather into caller-owned buffers equals `PagedDraftContext.gather` on the real rows, for random page layouts
and batch orders; a padded flush writes what the unpadded flush writes, to the same slots, and nothing else in the
pool; a speculator on static shapes drafts the eager speculator's trees round after round."""
import random
from types import SimpleNamespace

import numpy as np
import torch

from speculative.speculator import Speculator
from speculative.context_cache import PagedDraftContext, PendingObservations
from speculative.context_graphs import FlushGraphs, flush_eager
from speculative.drafter import DominoDrafter, DrafterConfig

from tests.support.threads import one_thread  # noqa: F401  (autouse)

CFG = DrafterConfig(vocab_size=50, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4,
                    num_kv_heads=2, head_dim=8, target_layer_ids=(1, 3), block_size=4, gru_hidden=16,
                    correction_rank=8)
PAGE = 4


def make_cache(num_pages=2):
    return PagedDraftContext(CFG.num_layers, CFG.num_kv_heads, CFG.head_dim, torch.float32, torch.device("cpu"),
                             page_size=PAGE, num_pages=num_pages)


def test_gather_into_equals_gather_on_the_real_rows():
    cache = make_cache()
    rng = random.Random(0)
    live: list[int] = []
    for round_ in range(40):
        for seq_id in rng.sample(live, len(live) // 2) + [100 + round_]:       # grow some, start one
            n = cache.length(seq_id)
            start = n if rng.random() < 0.8 else rng.randint(0, n)              # or cut back (recompute)
            cache.reserve(seq_id, start, rng.randint(1, 9))
            live = sorted(set(live) | {seq_id})
        if len(live) > 3 and rng.random() < 0.5:          # freed pages go to other sequences: scattered tables
            gone = rng.choice(live)
            cache.forget(gone)
            live.remove(gone)
        cache.storage.normal_()
        batch = rng.sample(live, rng.randint(1, len(live))) + ([999] if round_ % 5 == 0 else [])   # 999: no context
        width = cache.page_bucket(batch)
        lanes = len(batch) + rng.randint(0, 3)
        lengths, pages = np.zeros(lanes, np.int64), np.zeros((lanes, width), np.int64)
        cache.fill_table(batch, lengths, pages)
        kv = torch.full((2, CFG.num_layers, lanes, width * PAGE, CFG.num_kv_heads, CFG.head_dim), float("nan"))
        valid = torch.ones(lanes, width * PAGE, dtype=torch.bool)
        kv_ptr, valid_ptr = kv.data_ptr(), valid.data_ptr()
        cache.gather_into(torch.from_numpy(lengths), torch.from_numpy(pages), kv, valid, torch.arange(width * PAGE))
        assert kv.data_ptr() == kv_ptr and valid.data_ptr() == valid_ptr        # written in place
        want = cache.gather(batch)
        b = len(batch)
        assert torch.equal(valid[:b], want.valid) and not valid[b:].any()
        for layer in range(CFG.num_layers):
            assert torch.equal(kv[0, layer, :b], want.keys[layer]) and torch.equal(kv[1, layer, :b], want.values[layer])
        assert not torch.isnan(kv).any()                  # padded lanes read page 0: real numbers, masked


def plan_steps(seed):
    """Steps to observe: full and row-indexed steps, a gap, a forgotten sequence's rows, and a recompute that
    rewrites positions (within one flush when the flush comes after all steps)."""
    g = torch.Generator().manual_seed(seed)
    plan = [(None, [(0, 0, 5), (1, 3, 4), (2, 0, 7)]),            # a prefill-like step: every row
            (np.array([0, 2, 5]), [(0, 5, 1), (1, 7, 1), (2, 7, 1)]),
            (np.array([1, 2, 3, 4, 6]), [(0, 6, 3), (3, 0, 2)]),
            (None, [(2, 2, 4), (1, 9, 2)]),                       # 2 recomputes from 2; 1 skips position 8
            (np.array([0, 1]), [(4, 0, 2)])]                       # 3 is forgotten first
    steps = []
    for rows, parts in plan:
        n = sum(c for _, _, c in parts)
        total = n if rows is None else n + 3
        aux = [torch.randn(total, CFG.hidden_size, generator=g) for _ in CFG.target_layer_ids]
        ids = np.concatenate([np.full(c, s, np.int64) for s, _, c in parts])
        positions = np.concatenate([np.arange(p, p + c) for _, p, c in parts])
        if rows is not None:
            rows = np.sort(np.random.default_rng(seed).choice(total, n, replace=False))
        steps.append((aux, rows, ids, positions))
    return steps


@torch.inference_mode()
def test_a_padded_flush_writes_what_the_unpadded_flush_writes_and_nothing_else():
    drafter = DominoDrafter(CFG).eval()
    for seed, every_step, max_rows in ((1, False, 64), (2, False, 64), (3, True, 8)):   # 8: the first step eager
        padded, plain = make_cache(), make_cache()
        graphs = FlushGraphs(drafter.backbone, torch.float32, torch.device("cpu"), min_rows=4, max_rows=max_rows)
        pendings = [PendingObservations([1, 0]), PendingObservations([1, 0])]
        flushes = 0
        for round_ in range(3):                               # later rounds rewrite earlier positions
            steps = plan_steps(seed * 10 + round_)
            for k, (aux, rows, ids, positions) in enumerate(steps):
                for pending in pendings:
                    if 4 in ids:
                        pending.forget(3)
                    pending.add(aux, rows, ids, positions)
                if not every_step and k < len(steps) - 1:
                    continue
                padded.storage.normal_()
                plain.storage.copy_(padded.storage)
                before = padded.pool.clone()
                graphs.flush(padded, pendings[0])
                taken = pendings[1].take()
                flush_eager(drafter.backbone, plain, *taken, torch.float32)
                flushes += 1
                assert not pendings[0] and (padded.pages, padded.lengths, padded.runs) == \
                    (plain.pages, plain.lengths, plain.runs)
                assert padded.pool.shape == plain.pool.shape
                grown = padded.pool.new_zeros(padded.pool.shape)   # pages added by this flush start at zero
                grown[:, :, :before.shape[2]] = before
                written = [(c.pool != grown).flatten(0, 1).flatten(-2).any(-1).any(0) for c in (padded, plain)]
                assert torch.equal(*written) and written[0].any()                       # [pages, page]
                same = ~written[0][None, None, :, :, None, None].expand_as(grown)
                assert torch.equal(padded.pool[same], grown[same])                      # nothing else written
                torch.testing.assert_close(padded.pool, plain.pool, rtol=1e-5, atol=1e-5)
                size = graphs.bucket(len(taken[1]))
                if size is not None:
                    assert graphs.buckets[size].source == padded.pool_id
        assert graphs.eager_flushes == (3 if every_step else 0) and flushes == (15 if every_step else 3)
        assert sorted(graphs.buckets) == ([4, 8] if every_step else [32])


def test_a_slot_gets_its_last_writer_and_padded_rows_write_the_scratch_slot():
    drafter = DominoDrafter(CFG).eval()
    cache = make_cache(num_pages=4)
    graphs = FlushGraphs(drafter.backbone, torch.float32, torch.device("cpu"), min_rows=16)
    pending = PendingObservations([0, 1])
    g = torch.Generator().manual_seed(4)
    aux = [torch.randn(6, CFG.hidden_size, generator=g) for _ in CFG.target_layer_ids]
    pending.add(aux, None, np.full(6, 7, np.int64), np.array([0, 1, 2, 0, 1, 2]))    # rows 3..5 recompute 0..2
    cache.storage.zero_()
    graphs.flush(cache, pending)
    want = drafter.backbone.context(torch.cat(aux, -1)[None, 3:], torch.arange(3)[None])
    got = cache.gather([7])
    assert cache.positions(7) == [0, 1, 2]
    torch.testing.assert_close(got.keys[1][0, :3], want.keys[1][0], rtol=1e-5, atol=1e-5)
    scratch = cache.scratch_slot
    assert graphs.buckets[16].slots.tolist() == [scratch] * 3 + [0, 1, 2] + [scratch] * 10   # page 0 is 7's
    assert cache.pool[:, :, 1:].abs().sum() == 0 and cache.pool[:, :, 0, 3:].abs().sum() == 0


def make_speculator(static_shapes: bool) -> Speculator:
    torch.manual_seed(0)
    drafter = DominoDrafter(CFG)
    embed = torch.randn(CFG.vocab_size, CFG.hidden_size)
    spec = Speculator(drafter, "dominotree", 8, embed, embed, CFG.vocab_size, max_num_seqs=4,
                      static_shapes=static_shapes)
    spec.contexts = make_cache()                                           # grows several times
    return spec


@torch.inference_mode()
def test_a_speculator_on_static_shapes_drafts_the_eager_trees():
    static, eager = make_speculator(True), make_speculator(False)
    assert static.flush_graphs is not None and eager.flush_graphs is None and eager.drafter_graphs is None
    g = torch.Generator().manual_seed(1)
    rng = random.Random(2)
    seqs = {i: SimpleNamespace(seq_id=i, last_token_id=i, num_tokens=1) for i in range(6)}
    pool_ids = set()
    for round_ in range(40):
        batch = [seqs[i] for i in rng.sample(sorted(seqs), rng.randint(1, len(seqs)))]
        aux = [torch.randn(64, CFG.hidden_size, generator=g) for _ in CFG.target_layer_ids]
        row = 0
        for s in batch:                                   # a prefill chunk, or the root and accepted tokens
            n = rng.randint(8, 20) if s.num_tokens == 1 else rng.randint(1, 4)
            for spec in (static, eager):
                spec.observe_rows(s, aux, row, s.num_tokens - 1, n)
            row, s.num_tokens, s.last_token_id = row + n, s.num_tokens + n, rng.randrange(CFG.vocab_size)
        trees = [spec.propose(batch, 8).trees for spec in (static, eager)]
        for a, b in zip((trees[0].tokens, trees[0].parents, trees[0].valid),
                        (trees[1].tokens, trees[1].parents, trees[1].valid)):
            assert torch.equal(a, b), round_
        pool_ids.add(static.contexts.pool_id)
        if round_ % 6 == 5:                               # a sequence finishes, a new one arrives
            done = batch[0]
            for spec in (static, eager):
                spec.forget(done)
            del seqs[done.seq_id]
            seqs[100 + round_] = SimpleNamespace(seq_id=100 + round_, last_token_id=3, num_tokens=1)
    torch.testing.assert_close(static.contexts.pool, eager.contexts.pool, rtol=1e-5, atol=1e-5)
    graphs, contexts = static.drafter_graphs, static.contexts
    assert len(pool_ids) >= 3 and graphs.eager_runs == 0 and len(graphs.graphs) >= 4
    last = graphs.graphs[graphs.key(len(batch), contexts.page_bucket([s.seq_id for s in batch]) * PAGE)]
    assert last.source == contexts.pool_id and len(static.flush_graphs.buckets) >= 2
