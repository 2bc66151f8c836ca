"""The draft side's context update on CUDA graphs: a speculator whose flush and gather+drafter pass replay graphs
drafts, round after round, what the same padded code drafts eagerly (the pool bit for bit, the trees token for
token), and the eager speculator's trees, over rounds with growing contexts, prefill chunks, forgotten
sequences, changing batches, pool growth (graphs captured again) and a flush above `max_rows` (eager); the gather
inside a drafter graph copies exactly what `PagedDraftContext.gather` gives; the switches (TIDAL_DRAFTER_GRAPHS,
TIDAL_STATIC_DRAFT)."""
import random
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from speculative.speculator import Speculator
from speculative.context_cache import PagedDraftContext
from speculative.context_graphs import FlushGraphs
from speculative.drafter import DominoDrafter, DrafterConfig
from speculative.drafter_graphs import DrafterGraphs

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
CFG = DrafterConfig(vocab_size=512, hidden_size=128, intermediate_size=256, num_layers=2, num_heads=4,
                    num_kv_heads=2, head_dim=32, target_layer_ids=(1, 3), block_size=16, gru_hidden=32,
                    correction_rank=16)
DEV = torch.device("cuda")
PAGE = 16
MAX_FLUSH_ROWS = 64


def make_speculator(mode: str, dtype: torch.dtype) -> Speculator:
    """mode: "graphs" (CUDA graphs), "padded" (the same static-shape code, eager) or "eager" (no static shapes)."""
    torch.manual_seed(0)
    drafter = DominoDrafter(CFG).to(DEV, dtype)
    embed = torch.randn(CFG.vocab_size, CFG.hidden_size, device=DEV, dtype=dtype)
    spec = Speculator(drafter, "dominotree", 8, embed, embed, CFG.vocab_size, max_num_seqs=4,
                      static_shapes=mode == "graphs")
    if mode == "padded":
        spec.drafter_graphs = DrafterGraphs(spec.drafter, embed, embed, use_graphs=False)
        spec.flush_graphs = FlushGraphs(spec.drafter.backbone, dtype, DEV, use_graphs=False)
    if spec.flush_graphs is not None:
        spec.flush_graphs.max_rows = MAX_FLUSH_ROWS
    spec.contexts = PagedDraftContext(CFG.num_layers, CFG.num_kv_heads, CFG.head_dim, dtype, DEV, page_size=PAGE,
                                      num_pages=4)                      # grows: graphs are captured again
    return spec


class Traffic:
    """Rounds of a speculative engine's draft side: prefill chunks (every row of a step), verify rows (the root
    and accepted nodes, rows picked from a step), sequences that finish and new ones."""

    def __init__(self, specs, dtype, seed=0):
        self.specs, self.dtype = specs, dtype
        self.rng = random.Random(seed)
        self.gen = torch.Generator(DEV).manual_seed(seed)
        self.seqs = {i: SimpleNamespace(seq_id=i, last_token_id=i, num_tokens=1) for i in range(6)}
        self.next_id = 100

    def aux(self, rows: int):
        return [torch.randn(rows, CFG.hidden_size, generator=self.gen, device=DEV).to(self.dtype)
                for _ in CFG.target_layer_ids]

    def round(self, index: int):
        rng = self.rng
        if index % 6 == 5:                               # a sequence finishes, another arrives
            done = self.seqs.pop(rng.choice(sorted(self.seqs)))
            for spec in self.specs:
                spec.forget(done)
            self.seqs[self.next_id] = SimpleNamespace(seq_id=self.next_id, last_token_id=1, num_tokens=1)
            self.next_id += 1
        batch = [self.seqs[i] for i in rng.sample(sorted(self.seqs), rng.randint(1, len(self.seqs)))]
        new = [s for s in batch if s.num_tokens == 1]
        if new:                                         # one prefill step: every row (100 rows: an eager flush)
            sizes = [100 if index == 7 else rng.randint(5, 40) for _ in new]
            aux = self.aux(sum(sizes))
            ids = np.repeat([s.seq_id for s in new], sizes)
            positions = np.concatenate([np.arange(n) for n in sizes])
            for spec in self.specs:
                spec.observe(aux, None, ids, positions)
            for s, n in zip(new, sizes):
                s.num_tokens += n
        old = [s for s in batch if s not in new]
        aux, row = self.aux(9 * len(old) + 1), 1
        for s in old:                                   # a verify step: root + accepted nodes of a 9-row tree
            picked = [row] + sorted(rng.sample(range(row + 1, row + 9), rng.randint(0, 4)))
            for spec in self.specs:
                spec.observe_at(s, aux, picked, s.num_tokens - 1)
            s.num_tokens += len(picked)
            row += 9
        for s in batch:
            s.last_token_id = rng.randrange(CFG.vocab_size)
        return batch, [spec.propose(batch, 8).trees for spec in self.specs]


def same_tree(a, b) -> bool:
    return all(torch.equal(x, y) for x, y in zip((a.tokens, a.parents, a.valid), (b.tokens, b.parents, b.valid)))


@pytest.mark.parametrize("dtype,rounds", [(torch.float32, 60), (torch.bfloat16, 30)])
@torch.inference_mode()
def test_graph_rounds_equal_the_padded_code_eagerly_and_the_eager_speculator(dtype, rounds):
    graphed, padded, eager = (make_speculator(m, dtype) for m in ("graphs", "padded", "eager"))
    traffic = Traffic((graphed, padded, eager), dtype)
    pool_ids = set()
    for index in range(rounds):
        batch, (g, p, e) = traffic.round(index)
        assert same_tree(g, p), f"round {index}: graph replay and the same code eagerly drafted different trees"
        assert torch.equal(graphed.contexts.pool, padded.contexts.pool), f"round {index}: pools differ"
        if dtype == torch.float32:
            assert same_tree(g, e), f"round {index}: the eager speculator drafted another tree"
        pool_ids.add(graphed.contexts.pool_id)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(graphed.contexts.pool, eager.contexts.pool, rtol=tol, atol=tol)
    drafts, flushes = graphed.drafter_graphs, graphed.flush_graphs
    assert len(pool_ids) >= 2                          # grew after the first round: its keys captured again
    assert drafts.eager_runs == 0 and len(drafts.graphs) >= 4
    assert all(e.graph is not None for e in drafts.graphs.values())
    assert flushes.eager_flushes >= 1 and len(flushes.buckets) >= 2
    assert all(b.graph is not None for b in flushes.buckets.values())
    assert max(b.replays for b in flushes.buckets.values()) >= 5


@torch.inference_mode()
def test_the_gather_inside_a_drafter_graph_copies_what_gather_gives():
    spec = make_speculator("graphs", torch.float32)
    traffic = Traffic((spec,), torch.float32, seed=3)
    for index in range(12):
        batch, _ = traffic.round(index)
        ids = [s.seq_id for s in batch]
        key = spec.drafter_graphs.key(len(ids), spec.contexts.page_bucket(ids) * PAGE)
        inputs = spec.drafter_graphs.graphs[key].inputs
        want = spec.contexts.gather(ids)
        b = len(ids)
        assert torch.equal(inputs.valid[:b], want.valid) and not inputs.valid[b:].any()
        for layer in range(CFG.num_layers):
            assert torch.equal(inputs.context.keys[layer][:b], want.keys[layer])
            assert torch.equal(inputs.context.values[layer][:b], want.values[layer])
        assert inputs.roots[:b].tolist() == [s.last_token_id for s in batch]


def test_the_switches(monkeypatch):
    """TIDAL_DRAFTER_GRAPHS=0: all eager; TIDAL_STATIC_DRAFT=0: the drafter pass graphed; default: both."""
    drafter = DominoDrafter(CFG).to(DEV)
    embed = torch.randn(CFG.vocab_size, CFG.hidden_size, device=DEV)
    monkeypatch.delenv("TIDAL_STATIC_DRAFT", raising=False)
    monkeypatch.setenv("TIDAL_DRAFTER_GRAPHS", "0")
    spec = Speculator(drafter, "dominotree", 8, embed, embed, CFG.vocab_size, max_num_seqs=4)
    assert spec.flush_graphs is None and spec.drafter_graphs is None
    monkeypatch.delenv("TIDAL_DRAFTER_GRAPHS")
    monkeypatch.setenv("TIDAL_STATIC_DRAFT", "0")
    spec = Speculator(drafter, "dominotree", 8, embed, embed, CFG.vocab_size, max_num_seqs=4)
    assert spec.flush_graphs is None and spec.drafter_graphs.use_graphs and not spec.static_shapes
    monkeypatch.delenv("TIDAL_STATIC_DRAFT")
    spec = Speculator(drafter, "dominotree", 8, embed, embed, CFG.vocab_size, max_num_seqs=4)
    assert spec.flush_graphs.use_graphs and spec.drafter_graphs.use_graphs
    assert spec.flush_graphs.pool is spec.drafter_graphs.pool                  # one graph memory pool
