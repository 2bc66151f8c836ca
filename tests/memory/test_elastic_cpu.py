"""Elastic KV on CPU with a logical reserve (no VMM): the lend/reclaim protocol against a live scheduler.

The logical reserve scribbles over its blocks whenever it is mapped or unmapped, so any read of stale
reserve KV (a missed migration, a prefix hit that survived a reclaim) changes the greedy tokens."""
import random

import numpy as np
import pytest
import torch

from tests.support.checkpoints import make_tiny_llama
from memory.block_manager import BlockManager
from memory.elastic import ElasticPolicy, LendGate
from memory.rank_kv import KVAction
from replicas.step_input import probe_step
from memory.vmm import VmmLayout
from replicas import SamplingParams
from replicas.config import EngineConfig
from replicas.engine import LLMEngine
from replicas.sequence import Sequence
from tests.support.greedy import compare_greedy

transformers = pytest.importorskip("transformers")
BS = 16


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    folder = make_tiny_llama(str(tmp_path_factory.mktemp("elastic")))
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()

    @torch.no_grad()
    def last_logits(ids):
        return hf(torch.tensor([ids])).logits[0, -1]
    return folder, hf.config.vocab_size, last_logits


def elastic_engine(folder, base, reserve, lend_step_tokens, max_num_seqs=8, async_scheduling=False):
    """An engine whose config asks for elastic KV with a logical reserve (CPU) and an eager lending policy."""
    return LLMEngine(EngineConfig.from_flat(model=folder, num_kv_blocks=base + reserve, block_size=BS,
                                            max_model_len=base * BS, max_num_seqs=max_num_seqs,
                                            max_num_batched_tokens=256, elastic="elastic", reserve_blocks=reserve,
                                            elastic_lend_step_tokens=lend_step_tokens, elastic_lend_after_steps=1,
                                            elastic_min_lend_steps=0, async_scheduling=async_scheduling))


class Guard:
    """Wraps the runner: every executed step must respect the reserve's state."""

    def __init__(self, engine):
        self.engine, self.steps, self.large_steps = engine, 0, 0
        self._execute = engine.runner.execute
        engine.runner.execute = self

    def __call__(self, step):
        e = self.engine
        mapped = e.runner.kv.memory.mapped
        assert mapped == e.block_manager.reserve_mapped
        if step.num_tokens > e.elastic.policy.lend_step_tokens:
            assert not mapped, f"a {step.num_tokens}-token step ran with the reserve lent"
            self.large_steps += 1
        if not mapped:
            assert int(step.block_tables.max()) < e.block_manager.num_base, "reserve block used while unmapped"
        self.steps += 1
        return self._execute(step)


def drive(engine, arrivals: dict[int, list], elastic=True) -> dict[str, list[int]]:
    """arrivals: step index -> [(request id, prompt, params)]. Returns request id -> greedy tokens."""
    done, step, last = {}, 0, max(arrivals) if arrivals else 0
    while step <= last or engine.has_unfinished:
        for rid, prompt, params in arrivals.get(step, []):
            engine.add_request(rid, prompt, params)
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.outputs[0].token_ids
        step += 1
        assert step < 20000
    return done


def reference(folder, requests) -> dict[str, list[int]]:
    engine = LLMEngine(EngineConfig.from_flat(model=folder, num_kv_blocks=512, block_size=BS, max_num_seqs=64))
    return drive(engine, {0: requests}, elastic=False)


def check_same(tiny, requests, got, want):
    _, _, last_logits = tiny
    prompts = [p for _, p, _ in requests]
    flips = compare_greedy(prompts, [got[r] for r, _, _ in requests], [want[r] for r, _, _ in requests],
                           last_logits)
    assert len(flips) <= 1, flips


def test_layout_rounds_to_whole_granules():
    g = 2 << 20
    lay = VmmLayout.fit(64 << 10, g, 1000, 333)          # Llama-3-8B: 64 KiB per block per layer
    assert lay.num_base_blocks == 992 and lay.base_bytes % g == 0
    assert lay.reserve_handle_bytes == 320 * (64 << 10) and lay.num_reserve_blocks == 320
    odd = VmmLayout.fit(48 << 10, g, 1000, 100)          # 48 KiB blocks: boundary every 128 blocks
    assert odd.num_base_blocks == 896 and odd.base_bytes % g == 0
    assert odd.reserve_handle_bytes == 2 * g and odd.num_reserve_blocks == 2 * g // (48 << 10)
    assert odd.num_reserve_blocks * odd.block_bytes <= odd.reserve_handle_bytes
    with pytest.raises(ValueError):
        VmmLayout.fit(64 << 10, g, 31, 10)


def test_gate_hysteresis_and_backoff():
    gate = LendGate(ElasticPolicy(100, lend_after_steps=2, min_lend_steps=3, max_lend_after_steps=8))
    assert [gate.decide(False, n) for n in (False, True, False, False)] == [None, None, None, "lend"]
    assert gate.decide(True, True) == "reclaim" and gate.wait == 4          # short lend: wait doubles
    assert [gate.decide(False, False) for _ in range(4)] == [None, None, None, "lend"]
    for _ in range(3):
        assert gate.decide(True, False) is None
    assert gate.decide(True, True) == "reclaim" and gate.wait == 2          # a long lend resets the wait
    gate.refused()
    assert gate.wait == 4


def test_block_manager_never_hands_out_unmapped_reserve():
    bm = BlockManager(2, 2, 4, reserve_mapped=False)
    with pytest.raises(AssertionError, match="not mapped"):
        bm.lend_reserve()
    bm.set_reserve_mapped(True)
    bm.lend_reserve()
    with pytest.raises(AssertionError, match="still lent"):
        bm.set_reserve_mapped(False)
    bm.reserve_mapped = False                              # simulate a protocol bug: lent but unmapped
    s = Sequence("a", 0, list(range(12)), SamplingParams(), 0, 0.0)
    with pytest.raises(AssertionError, match="unmapped"):
        bm.allocate(s, 12)
    bm.reserve_mapped = True
    bm.allocate(s, 12)
    bm.begin_reclaim()                                     # draining: the reserve hands out nothing more
    assert bm.num_free_blocks == 0 and bm.num_usable_blocks == 2


def test_probe_step_reads_only_block_zero():
    step = probe_step(100, 7, BS)
    assert step.num_tokens == 100 and len(step.seq_lens) == 7 and step.seq_lens.sum() == 100
    assert (step.slot_mapping == -1).all() and not step.block_tables.any()
    assert step.block_tables.shape[1] * BS >= step.seq_lens.max()


def test_reclaim_migrates_or_preempts_live_reserve_blocks(tiny):
    folder, vocab, _ = tiny
    rng = random.Random(0)
    prefixes = [[rng.randrange(3, vocab) for _ in range(32)] for _ in range(3)]
    requests, arrivals = [], {}
    for i in range(28):
        prompt = (prefixes[i % 3] if i % 2 else []) + [rng.randrange(3, vocab) for _ in range(rng.randint(4, 30))]
        params = SamplingParams(temperature=0.0, max_tokens=rng.randint(20, 60), ignore_eos=True)
        requests.append((f"r{i}", prompt, params))
        arrivals.setdefault(i * 7 + rng.randint(0, 3), []).append(requests[-1])
    engine = elastic_engine(folder, base=24, reserve=16, lend_step_tokens=12)
    guard = Guard(engine)
    got = drive(engine, arrivals)
    stats = engine.get_stats()
    assert stats.lend_total >= 10 and stats.reclaim_total >= 10
    assert stats.blocks_migrated > 0, "no live reserve block was ever migrated"
    assert stats.elastic_preemptions > 0, "no sequence was ever preempted by a reclaim"
    assert guard.large_steps > 0 and len(stats.reclaim_latencies) == stats.reclaim_total
    engine.get_stats()                               # reading again does not consume the samples
    assert len(engine.get_stats().lend_latencies) == stats.lend_total
    check_same(tiny, requests, got, reference(folder, requests))


def test_prefix_hits_in_the_reserve_are_evicted_at_reclaim(tiny):
    folder, vocab, _ = tiny
    rng = random.Random(1)
    long_prompt = [rng.randrange(3, vocab) for _ in range(100)]
    short = [rng.randrange(3, vocab) for _ in range(40)]                  # 2 cacheable full blocks

    def p(n):
        return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
    engine = elastic_engine(folder, base=8, reserve=8, lend_step_tokens=48, max_num_seqs=4)
    Guard(engine)
    bm, elastic = engine.block_manager, engine.elastic
    requests = [("fill", long_prompt, p(24)), ("a", short, p(3)), ("b", short, p(3)),
                ("c", long_prompt[::-1], p(3)), ("d", short, p(3))]
    got = {}

    def run_until(cond):
        for _ in range(500):
            if cond():
                return
            got.update({o.request_id: o.outputs[0].token_ids for o in engine.step() if o.finished})
        raise AssertionError("condition never met")

    engine.add_request(*requests[0])
    run_until(lambda: bm.reserve_lent and engine.scheduler.running)      # fill prefilled into base, lent now
    engine.add_request(*requests[1])
    run_until(lambda: "a" in got)
    assert any(bm.is_reserve(b) for b in bm.hash_to_block.values()), "a's prompt blocks should sit in the reserve"
    hits = bm.hits
    engine.add_request(*requests[2])                                      # hits a's cached reserve block
    run_until(lambda: "b" in got)
    assert bm.hits >= hits + 2 * BS
    engine.add_request(*requests[3])                                      # a large prefill: reclaim
    run_until(lambda: "c" in got)
    assert elastic.cache_evictions > 0 and not any(bm.is_reserve(b) for b in bm.hash_to_block.values())
    run_until(lambda: bm.reserve_lent)
    engine.add_request(*requests[4])                                      # same prompt again, after eviction
    run_until(lambda: "d" in got and "fill" in got)
    check_same(tiny, requests, got, reference(folder, requests))


def test_lend_refused_leaves_the_reserve_unlent(tiny):
    folder, vocab, _ = tiny
    engine = elastic_engine(folder, base=8, reserve=8, lend_step_tokens=48)
    elastic = engine.elastic
    real = elastic.dispatch
    elastic.dispatch = lambda action: False if action.kind == "lend" else real(action)
    elastic.before_schedule()
    assert not engine.block_manager.reserve_lent and elastic.lend_refused == 1 and elastic.gate.wait == 2
    elastic.dispatch = real
    elastic.before_schedule()
    elastic.before_schedule()
    assert engine.block_manager.reserve_lent and engine.runner.kv.memory.mapped
    elastic.set_mode("off")
    assert not engine.block_manager.reserve_lent and not engine.runner.kv.memory.mapped
    elastic.before_schedule()
    assert not engine.block_manager.reserve_lent
    with pytest.raises(ValueError):
        elastic.set_mode("static")


def test_reclaim_action_copies_blocks_on_every_layer(tiny):
    folder, _, _ = tiny
    engine = elastic_engine(folder, base=8, reserve=8, lend_step_tokens=48)
    rank = engine.runner.kv
    assert rank.apply(KVAction("lend"))
    for c in rank.caches:
        c[9].fill_(3.0)
        c[12].fill_(5.0)
    rank.apply(KVAction("reclaim", np.array([9, 12]), np.array([1, 2])))
    assert not rank.memory.mapped
    for c in rank.caches:
        assert (c[1] == 3.0).all() and (c[2] == 5.0).all()
        assert not (c[9] == 3.0).all()                                    # scribbled: unmapped memory is garbage


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_a_lower_budget_gives_reserve_blocks_to_the_kv_pool_and_a_higher_one_takes_them_back(tiny, async_scheduling):
    """The chunk knob at run time: lowering max_num_batched_tokens grants the reserve blocks its smaller steps do
    not need (usable KV grows), raising it gives them back with their live K/V moved below (or the newest
    sequences preempted); the greedy tokens match a plain engine's, which a missed copy would change. With async
    scheduling the change lands while a step is still pending: a sequence it preempts must not keep that step's
    progress (it recomputes from its tokens when readmitted)."""
    folder, vocab, _ = tiny
    rng = random.Random(2)
    requests = [(f"r{i}", [rng.randrange(3, vocab) for _ in range(rng.randint(20, 90))],
                 SamplingParams(temperature=0.0, max_tokens=rng.randint(30, 70), ignore_eos=True))
                for i in range(24)]
    engine = elastic_engine(folder, base=24, reserve=16, lend_step_tokens=12, async_scheduling=async_scheduling)
    guard = Guard(engine)
    bm, kv = engine.block_manager, engine.runner.kv
    usable = bm.num_usable_blocks
    pending_at_change = []
    if async_scheduling:
        engine.reconfigure(elastic="off")          # a step may stay pending only while nothing is lent
    budgets = {0: 64, 40: 256, 70: 16, 110: 64, 150: 256, 190: 32}
    got, granted, grown, step = {}, [], [], 0
    while step < 200 or engine.has_unfinished:
        if step in budgets:
            pending_at_change.append(engine._pending is not None)
            engine.reconfigure(max_num_batched_tokens=budgets[step])
            granted.append(engine.get_stats().reserve_granted_blocks)
            assert kv.num_base == bm.num_base == kv.memory.num_base and sum(kv.grants) == granted[-1]
        if step % 6 == 0 and step // 6 < len(requests):
            engine.add_request(*requests[step // 6])
        grown.append(engine.get_stats().kv_blocks_total - usable)
        got.update({o.request_id: o.outputs[0].token_ids for o in engine.step() if o.finished})
        step += 1
        assert step < 5000
    assert granted == [kv.grant_target(b, 256) for b in budgets.values()]
    assert granted[0] > 0 and granted[1] == 0 and granted[2] > granted[0]
    assert max(grown) >= granted[2], "the granted blocks never showed as usable KV"
    stats = engine.get_stats()
    assert stats.blocks_migrated > 0 and (stats.lend_total > 0) != async_scheduling
    engine.reconfigure(max_num_batched_tokens=256)
    assert bm.num_base == 24 and bm.num_reserve == 16 and not kv.grants
    assert guard.steps > 0
    assert any(pending_at_change) == async_scheduling
    check_same(tiny, requests, got, reference(folder, requests))


def test_ungrant_moves_live_blocks_below_the_region():
    bm = BlockManager(8, 8, BS, enable_prefix_caching=True)
    bm.grant(4)
    assert bm.num_base == 12 and bm.num_reserve == 4 and bm.num_free_blocks == 12

    class Seq:
        def __init__(self, n):
            self.block_table, self.num_computed_tokens, self.token_ids = [], 0, list(range(n))

        @property
        def num_tokens(self):
            return len(self.token_ids)

    a, b = Seq(6 * BS), Seq(4 * BS)
    bm.allocate(a, 6 * BS)
    bm.allocate(b, 4 * BS)
    assert b.block_table == [6, 7, 8, 9]
    bm.free(a)
    plan = bm.begin_ungrant(4)
    assert sorted(plan) == [8, 9] and all(d < 8 for d in plan.values())
    bm.end_ungrant(4, plan, [b])
    assert bm.num_base == 8 and bm.num_reserve == 8 and all(x < 8 for x in b.block_table)
    assert list(bm.free_reserve)[:4] == [8, 9, 10, 11] and bm.num_free_blocks == 4
