"""Async scheduling (`async_scheduling=True`): a decode step is scheduled and launched before the last step's
tokens are read back. On the CPU the same pipeline runs (with nothing to overlap), so these tests check what it
must not change: every request's tokens, text, finish reason and logprobs equal the synchronous engine's, with
requests ending by length, EOS and stop string while the next step is already launched, aborts between steps,
preemption, arrivals, n = 2, penalties and grammars; and where it must stand aside (speculation, elastic
lending) it does."""
from __future__ import annotations

import json
from contextlib import contextmanager

import jsonschema
import pytest

from replicas import LLM, SamplingParams
from replicas.structured.spec import GrammarSpec
from tests.support.checkpoints import make_tiny_llama

ENGINE = dict(device="cpu", block_size=16, max_num_seqs=8, max_num_batched_tokens=256, seed=0)
PROMPTS = [[5 + i, 6, 7, 8 + i, 9] for i in range(10)]
SCHEMA = {"type": "object", "properties": {"kind": {"enum": ["alpha", "beta"]},
                                           "n": {"type": "integer", "minimum": 0, "maximum": 99}},
          "required": ["kind", "n"]}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> str:
    return make_tiny_llama(str(tmp_path_factory.mktemp("async")))


def mixed_params() -> list[SamplingParams]:
    """Greedy and seeded random rows; ends by length at several lengths, by EOS, by stop token; penalties,
    logprobs and n = 2."""
    out = []
    for i in range(len(PROMPTS)):
        kw = dict(max_tokens=6 + 3 * i, seed=100 + i, temperature=0.0 if i % 2 else 0.9)
        if i % 3 == 0:
            kw.update(ignore_eos=True)
        if i == 4:
            kw.update(stop_token_ids=[PROMPTS[0][0] + 1, 40, 41, 42], repetition_penalty=1.3, frequency_penalty=0.5)
        if i == 5:
            kw.update(logprobs=2)
        if i == 7:
            kw.update(n=2)
        out.append(SamplingParams(**kw))
    return out


def run(model: str, params, prompts=PROMPTS, **engine):
    llm = LLM(model=model, **{**ENGINE, **engine})
    try:
        outs = llm.generate(prompts, params)
        return [[(c.token_ids, c.text, c.finish_reason, c.stop_reason, c.logprobs) for c in o.outputs]
                for o in outs], llm.engine.get_stats()
    finally:
        llm.shutdown()


@contextmanager
def async_engine(model: str, params: SamplingParams, num_requests: int):
    """An async-scheduling engine holding requests r0.. on PROMPTS[0..num_requests - 1] (not streamed)."""
    llm = LLM(model=model, async_scheduling=True, **ENGINE)
    try:
        for i in range(num_requests):
            llm.engine.add_request(f"r{i}", PROMPTS[i], params, stream=False)
        yield llm.engine
    finally:
        llm.shutdown()


def step_until_done(eng, between) -> dict[str, list[int]]:
    """Step `eng` until it is done (at most 200 steps), calling `between(step)` after each; the finished
    requests' token ids."""
    done = {}
    for step in range(200):
        for out in eng.step():
            if out.finished:
                done[out.request_id] = out.outputs[0].token_ids
        between(step)
        if not eng.has_unfinished:
            break
    return done


def test_outputs_equal_the_synchronous_engines(tiny):
    want, sync_stats = run(tiny, mixed_params())
    got, stats = run(tiny, mixed_params(), async_scheduling=True)
    assert got == want
    assert sync_stats.steps_ahead == 0 and stats.steps_ahead > stats.num_steps // 2
    assert {c[2] for o in got for c in o} >= {"length"}


def test_preemption_and_a_small_budget_equal_the_synchronous_engines(tiny):
    """KV for a few sequences only: the scheduler preempts (a step that knows its tokens), the next step goes ahead
    again; a budget of 4 tokens: steps ahead admit the waiting requests one chunk at a time."""
    params = [SamplingParams(temperature=0.0 if i % 2 else 0.8, seed=i, max_tokens=40, ignore_eos=True)
              for i in range(len(PROMPTS))]
    want, sync_stats = run(tiny, params, num_kv_blocks=12)
    got, stats = run(tiny, params, num_kv_blocks=12, async_scheduling=True)
    assert got == want and sync_stats.preemptions > 0 and stats.preemptions > 0 and stats.steps_ahead > 0
    got, stats = run(tiny, params, async_scheduling=True, max_num_batched_tokens=4)
    assert got == run(tiny, params, max_num_batched_tokens=4)[0] and stats.steps_ahead > 0


def test_a_sequence_ending_by_length_makes_room_in_the_step_ahead(tiny):
    """At the sequence limit, a request whose pending token ends it by length gives its place to a waiting one in
    the step launched ahead, so the async engine needs no more steps than the synchronous one."""
    params = [SamplingParams(temperature=0.0, max_tokens=5 + i % 3, ignore_eos=True) for i in range(len(PROMPTS))]
    for max_num_seqs in (2, 3):
        want, sync_stats = run(tiny, params, max_num_seqs=max_num_seqs)
        got, stats = run(tiny, params, max_num_seqs=max_num_seqs, async_scheduling=True)
        assert got == want and stats.steps_ahead > 0
        assert stats.num_steps <= sync_stats.num_steps


def test_aborts_and_arrivals_between_steps(tiny):
    """A request aborted while its next step is launched ends there; requests added between steps are admitted by
    a synchronous step; every other request gets the tokens it gets alone."""
    params = SamplingParams(temperature=0.7, seed=7, max_tokens=30, ignore_eos=True)
    alone, _ = run(tiny, [params] * 6, prompts=PROMPTS[:6])
    with async_engine(tiny, params, 4) as eng:
        def between(step):
            if step == 5:
                assert eng._pending is not None           # the abort lands between launch and read-back
                eng.abort("r1")
            if step in (8, 13):
                eng.add_request(f"r{4 + (step == 13)}", PROMPTS[4 + (step == 13)], params, stream=False)
        done = step_until_done(eng, between)
        assert eng.stats.steps_ahead > 0
    assert set(done) == {"r0", "r2", "r3", "r4", "r5"}
    for rid, tokens in done.items():
        assert tokens == alone[int(rid[1:])][0][0]


def test_grammars_follow_their_schema_and_equal_the_synchronous_engines(tiny):
    params = [SamplingParams(temperature=0.0 if i % 2 else 1.0, seed=i, max_tokens=120,
                             grammar=GrammarSpec.json_schema(SCHEMA) if i % 3 else None) for i in range(6)]
    want, _ = run(tiny, params, prompts=PROMPTS[:6])
    got, stats = run(tiny, params, prompts=PROMPTS[:6], async_scheduling=True)
    assert got == want and stats.steps_ahead > 0
    for i, out in enumerate(got):
        if i % 3 and out[0][2] == "stop":
            jsonschema.validate(json.loads(out[0][1]), SCHEMA)


def test_speculation_and_elastic_lending_run_synchronously(tiny):
    params = [SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)] * 3
    want, _ = run(tiny, params, prompts=PROMPTS[:3])
    got, stats = run(tiny, params, prompts=PROMPTS[:3], async_scheduling=True, speculative="dominotree",
                     allow_random_drafter=True, spec_budget=4, spec_policy="fixed")
    assert stats.steps_ahead == 0 and stats.spec_drafts > 0 and [o[0][0] for o in got] == [o[0][0] for o in want]
    got, stats = run(tiny, params, prompts=PROMPTS[:3], async_scheduling=True, elastic="elastic",
                     reserve_blocks=4)
    assert stats.steps_ahead == 0 and got == want


def test_a_reconfigure_between_steps_finishes_the_pending_one_and_its_outputs_go_out_with_the_next(tiny):
    """`reconfigure` may preempt (a budget grant taken back), so it finishes the pending step first: the tokens
    are the sequences' before anything moves, and that step's outputs, the last request's final one included,
    come from the next `step()` (the engine is unfinished until they have)."""
    params = SamplingParams(temperature=0.0, max_tokens=9, ignore_eos=True)
    alone, _ = run(tiny, [params] * 3, prompts=PROMPTS[:3])
    with async_engine(tiny, params, 3) as eng:
        changes = []

        def between(step):
            if eng._pending is not None:
                eng.reconfigure(max_num_batched_tokens=128 if len(changes) % 2 else 256)
                changes.append(step)
                assert eng._pending is None and eng.has_unfinished
        done = step_until_done(eng, between)
        assert changes and eng.stats.steps_ahead == 0
    assert done == {f"r{i}": alone[i][0][0] for i in range(3)}
