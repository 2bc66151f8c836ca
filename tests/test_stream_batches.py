"""The async engine's batched stream and the replica's merge: a consumer slower than the engine receives
fewer, larger items carrying exactly the tokens, text and finish reason of the per-step stream."""
import asyncio

from checkpoints import make_tiny_llama

from cluster.protocol import ChoiceDelta
from cluster.replica import _merge
from replicas import EngineConfig, SamplingParams
from replicas.async_engine import AsyncLLMEngine
from replicas.stream_coalescer import StreamCoalescer


def test_merge_joins_deltas_per_choice_in_order():
    a = ChoiceDelta(0, "he", [1], [{1: "x"}], None)
    b = ChoiceDelta(1, "yo", [7], None, None)
    c = ChoiceDelta(0, "llo", [2, 3], [{2: "y"}, {3: "z"}], "stop")
    merged = _merge([a, b, c])
    assert [(m.index, m.text, m.token_ids, m.finish_reason) for m in merged] == [
        (0, "hello", [1, 2, 3], "stop"), (1, "yo", [7], None)]
    assert merged[0].logprobs == [{1: "x"}, {2: "y"}, {3: "z"}] and merged[1].logprobs is None
    assert a.token_ids == [1], "the inputs are not modified"


def test_slow_consumer_gets_batches_with_the_same_tokens(tmp_path):
    engine = AsyncLLMEngine(EngineConfig(model=make_tiny_llama(str(tmp_path / "m")), device="cpu"))
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)

    async def run():
        per_step = [o async for o in engine.generate([5, 6, 7], params, "steps")]
        batches = []
        async for batch in engine.generate_batches([5, 6, 7], params, "batches"):
            batches.append(batch)
            await asyncio.sleep(0.05)                  # a consumer slower than the engine's steps
        return per_step, batches

    try:
        per_step, batches = asyncio.run(run())
    finally:
        engine.shutdown()
    flat = [o for b in batches for o in b]
    assert len(batches) < len(flat), "outputs that queued up while the consumer slept arrive together"
    assert [t for o in flat for t in o.outputs[0].delta_token_ids] == \
        [t for o in per_step for t in o.outputs[0].delta_token_ids]
    assert flat[-1].finished and len(flat[-1].outputs[0].token_ids) == 24


def test_core_interval_merges_outputs_without_delaying_the_first_or_last(tmp_path):
    """An interval far longer than the request: the first output goes out at once and everything after it
    arrives as one merged output when the request ends, with exactly the per-step deltas (n=2, logprobs)."""
    engine = AsyncLLMEngine(EngineConfig(model=make_tiny_llama(str(tmp_path / "m")), device="cpu"))
    params = SamplingParams(temperature=0.8, seed=3, n=2, max_tokens=24, ignore_eos=True, logprobs=2)

    async def run():
        per_step = [o async for o in engine.generate([5, 6, 7], params, "steps")]
        engine.set_stream_interval(600.0)
        merged = await asyncio.wait_for(_collect(engine.generate([5, 6, 7], params, "merged")), timeout=120)
        engine.set_stream_interval(0.0)
        again = [o async for o in engine.generate([5, 6, 7], params, "again")]
        return per_step, merged, again

    try:
        per_step, merged, again = asyncio.run(run())
    finally:
        engine.shutdown()
    assert len(merged) == 2 and merged[-1].finished and len(again) == len(per_step) > 2

    def deltas(outs, index):
        picked = [o for out in outs for o in out.outputs if o.index == index]
        logprobs = [lp for o in picked for lp in (o.logprobs[-len(o.delta_token_ids):] if o.delta_token_ids else [])]
        return [t for o in picked for t in o.delta_token_ids], "".join(o.delta_text for o in picked), logprobs

    for index in (0, 1):
        assert deltas(merged, index) == deltas(per_step, index)
        final = [o for o in merged[-1].outputs if o.index == index][0]
        want = [o for o in per_step[-1].outputs if o.index == index][0]
        assert (final.text, final.token_ids, final.finish_reason) == (want.text, want.token_ids, want.finish_reason)


async def _collect(stream) -> list:
    return [out async for out in stream]


class _Req:
    def __init__(self, rid: str, stream: bool = True):
        self.request_id, self.stream, self.finished = rid, stream, False


def test_coalescer_holds_by_request_and_flushes_when_the_interval_passes():
    c = StreamCoalescer(interval=0.05)
    a, b, quiet = _Req("a"), _Req("b"), _Req("q", stream=False)

    def ids(reqs):
        return [r.request_id for r in reqs]

    assert ids(c.due({"a": a, "b": b, "q": quiet}, 0.0)) == ["a", "b"]             # first outputs at once
    assert c.due({"a": a, "b": b}, 0.02) == []                                        # held
    assert c.due({"a": a}, 0.04) == []                                                # b was preempted
    assert ids(c.due({}, 0.06)) == ["a", "b"]                                         # interval passed
    c.due({"b": b}, 0.07)
    c.forget("b")                                                                     # aborted
    assert "b" not in c.held and "b" not in c.last_sent
    a.finished = quiet.finished = True
    assert ids(c.due({"a": a, "q": quiet}, 0.08)) == ["a", "q"]                       # last: at once
    assert c.held == {} and "a" not in c.last_sent
    c.interval = 0.0
    assert ids(c.due({"b": b, "q": _Req("q2", stream=False)}, 0.09)) == ["b"]         # interval 0: every step
