"""Scheduler: one token budget, chunked prefill, preemption newest first, lookahead."""
from memory.block_manager import BlockManager
from replicas.sampling_params import SamplingParams
from replicas.scheduler import ScheduledBatch, Scheduler
from replicas.sequence import Sequence, SequenceStatus


def make(n_tokens, rid, first=1):
    return Sequence(rid, 0, list(range(first, first + n_tokens)), SamplingParams(), 0, 0.0)


def advance(sched, batch, sampled_token=7):
    sampling = set(batch.sampling_rows())
    for i, (s, n) in enumerate(zip(batch.seqs, batch.num_new_tokens)):
        sample = i in sampling
        before = s.num_computed_tokens
        s.num_computed_tokens += n
        sched.block_manager.commit_full_blocks(s, before)
        if sample:
            s.token_ids.append(sampled_token)


def test_budget_shared_by_decodes_and_prefill_chunks():
    bm = BlockManager(64, 0, 4)
    sched = Scheduler(bm, max_num_batched_tokens=16, max_num_seqs=8, max_model_len=256)
    a, b = make(10, "a"), make(40, "b")
    sched.add(a)
    sched.add(b)
    batch = sched.schedule()
    assert batch.num_new_tokens == [10, 6] and batch.sampling_rows() == [0]
    advance(sched, batch)
    batch = sched.schedule()
    assert [s.request_id for s in batch.seqs] == ["a", "b"] and batch.num_new_tokens == [1, 15]
    assert sched.lookahead().prefill_tokens == 16 - 1    # capped by the budget left after one decode
    sched.set_budget(100)
    assert sched.lookahead().prefill_tokens == 40 - 6


def test_preempts_newest_and_admits_nobody_that_step():
    bm = BlockManager(6, 0, 4)
    sched = Scheduler(bm, max_num_batched_tokens=64, max_num_seqs=8, max_model_len=256)
    a, b = make(8, "a"), make(8, "b")
    for s in (a, b):
        sched.add(s)
    advance(sched, sched.schedule())        # 2 + 2 blocks used, each sequence now at 9 tokens
    sched.add(make(4, "c"))
    batch = sched.schedule()                # a and b need a 3rd block each: 2 free, c waits
    assert [s.request_id for s in batch.seqs] == ["a", "b"] and not batch.preempted
    advance(sched, batch)
    for _ in range(3):
        advance(sched, sched.schedule())
    batch = sched.schedule()                # at 13 tokens both need a 4th block; only b can be preempted
    assert [s.request_id for s in batch.preempted] == ["b"]
    assert b.status == SequenceStatus.WAITING and b.num_computed_tokens == 0 and not b.block_table
    assert [s.request_id for s in batch.seqs] == ["a"]
    assert sched.waiting[0] is b            # recompute first, before c


def test_budget_change_takes_effect_next_step():
    bm = BlockManager(64, 0, 4)
    sched = Scheduler(bm, max_num_batched_tokens=8, max_num_seqs=8, max_model_len=256)
    sched.add(make(30, "a"))
    assert sched.schedule().num_tokens == 8
    sched.set_budget(20)
    assert sched.schedule().num_tokens == 20


def test_batch_has_prefill_only_when_a_row_takes_more_than_decode_or_verify_tokens():
    assert not ScheduledBatch([object(), object()], [1, 1]).has_prefill                  # two decodes
    assert not ScheduledBatch([object(), object()], [1, 5], drafts=[0, 4]).has_prefill   # decode + verify of 4 nodes
    assert ScheduledBatch([object(), object()], [1, 128]).has_prefill                    # decode + prompt chunk
    assert ScheduledBatch([object(), object()], [3, 5], drafts=[0, 4]).has_prefill


def run_to_end(sched, seqs_and_limits, arrivals, max_steps=500):
    """Steps until every sequence has its output tokens; `arrivals`: step -> sequences added then. Returns the
    preemptions as (step, request id, tokens computed before the step)."""
    limits = dict(seqs_and_limits)
    computed, preemptions = {}, []
    for step in range(max_steps):
        for seq in arrivals.get(step, ()):
            sched.add(seq)
        if not sched.has_work:
            return preemptions
        computed = {s.request_id: s.num_computed_tokens for s in list(sched.running) + list(sched.waiting)}
        batch = sched.schedule()
        preemptions += [(step, s.request_id, computed[s.request_id]) for s in batch.preempted]
        advance(sched, batch)
        for s in batch.seqs:
            if s.num_output_tokens >= limits[s.request_id]:
                sched.finish(s, "length")
    raise AssertionError(f"not finished after {max_steps} steps; preemptions {preemptions}")


def test_a_chunked_long_prompt_under_kv_pressure_is_not_restarted_by_growing_decodes():
    """Two decodes grow while a long prompt prefills in chunks and the blocks run out. The prompt takes its
    whole prompt's blocks at admission and the decodes' growth preempts a decode, not the prefill: the prompt
    is never thrown away part-done (before, a growing decode preempted it, the newest, and it restarted)."""
    bm = BlockManager(24, 0, 4)
    sched = Scheduler(bm, max_num_batched_tokens=8, max_num_seqs=8, max_model_len=96)
    a, b, long = make(8, "a", 1), make(8, "b", 100), make(40, "long", 200)
    preemptions = run_to_end(sched, [("a", 60), ("b", 60), ("long", 4)], {0: [a, b], 30: [long]})
    assert not [p for p in preemptions if p[1] == "long" and 0 < p[2] < 40], preemptions     # mid-prefill
    assert preemptions and all(done > 0 for _, _, done in preemptions)      # the pressure was real
    assert all(s.is_finished for s in (a, b, long))


def test_admission_waits_for_the_whole_prompt_and_takes_its_blocks():
    bm = BlockManager(10, 0, 4)
    sched = Scheduler(bm, max_num_batched_tokens=8, max_num_seqs=8, max_model_len=40)
    a = make(16, "a")                       # 4 blocks
    sched.add(a)
    advance(sched, sched.schedule())
    advance(sched, sched.schedule())
    big = make(28, "big", first=100)        # 7 blocks: 6 are free
    sched.add(big)
    batch = sched.schedule()
    assert [s.request_id for s in batch.seqs] == ["a"] and sched.waiting[0] is big
    sched.finish(a, "abort")
    batch = sched.schedule()
    assert batch.seqs == [big] and batch.num_new_tokens == [8] and len(big.block_table) == 7
