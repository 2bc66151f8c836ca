"""The async engine's batched stream, the engine's stream-item budget, the replica's merge and the SSE writes: a
consumer slower than the engine receives fewer, larger items carrying exactly the tokens, text and finish reason
of the per-step stream."""
import asyncio
import json

import pytest

from tests.support.checkpoints import make_tiny_llama

from cluster.ingress import OpenAIRoutes
from cluster.protocol import ChoiceDelta, StreamStart
from cluster.frontend import _merge
from cluster.responses import (ChatChoice, ChatCompletionResponse, ChatDelta, CompletionChoice, CompletionResponse,
                               ResponseBuilder)
from replicas import EngineConfig, SamplingParams
from replicas.async_engine import AsyncLLMEngine
from replicas.outputs import Logprob
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


def test_item_budget_merges_outputs_without_delaying_the_first_or_last(tmp_path):
    """Two streams beside a longer one and an item budget far longer than the requests: each request's first
    output goes out at once and everything after it arrives merged at its end, with exactly the per-step deltas
    (n=2, logprobs)."""
    model = make_tiny_llama(str(tmp_path / "m"))
    params = SamplingParams(temperature=0.8, seed=3, n=2, max_tokens=24, ignore_eos=True, logprobs=2)

    async def run(engine, streams):
        # the holder runs through every step of the others, however late the engine admits each of them
        holder = engine.generate([5, 6, 7], SamplingParams(temperature=0, max_tokens=400, ignore_eos=True), "hold")
        await anext(holder)
        try:
            return await asyncio.wait_for(asyncio.gather(*(_collect(engine.generate([5, 6, 7], params, f"r{i}"))
                                                           for i in range(streams))), timeout=120)
        finally:
            await holder.aclose()

    async def lone(engine):
        return await asyncio.wait_for(_collect(engine.generate([5, 6, 7], params, "lone")), timeout=120)

    engine = AsyncLLMEngine(EngineConfig(model=model, device="cpu"))
    try:
        per_step_pair = asyncio.run(run(engine, 2))        # the same batches, an output per step
    finally:
        engine.shutdown()
    engine = AsyncLLMEngine(EngineConfig.from_flat(model=model, device="cpu", stream_item_ms=600_000.0))
    try:
        merged_pair = asyncio.run(run(engine, 2))
        alone = asyncio.run(lone(engine))                  # a lone stream: every step, whatever the budget
    finally:
        engine.shutdown()
    per_step = per_step_pair[0]
    assert len(per_step) > 3 and len(alone) == len(per_step)

    def deltas(outs, index):
        picked = [o for out in outs for o in out.outputs if o.index == index]
        logprobs = [lp for o in picked for lp in (o.logprobs[-len(o.delta_token_ids):] if o.delta_token_ids else [])]
        return [t for o in picked for t in o.delta_token_ids], "".join(o.delta_text for o in picked), logprobs

    for merged, per_step in zip(merged_pair, per_step_pair):
        # the first output, then the last
        assert len(merged) == 2 and merged[-1].finished and any(o.delta_token_ids for o in merged[0].outputs)
        for index in (0, 1):
            ids, text, logprobs = deltas(merged, index)
            want_ids, want_text, want_logprobs = deltas(per_step, index)
            assert (ids, text) == (want_ids, want_text)
            # approx: the two runs may batch the requests' first steps differently (float32 sums in another order)
            assert [sorted((t, v.rank, v.decoded_token) for t, v in lp.items()) for lp in logprobs] == \
                [sorted((t, v.rank, v.decoded_token) for t, v in lp.items()) for lp in want_logprobs]
            assert [v.logprob for lp in logprobs for v in lp.values()] == \
                pytest.approx([v.logprob for lp in want_logprobs for v in lp.values()], abs=1e-4)
            final = [o for o in merged[-1].outputs if o.index == index][0]
            want = [o for o in per_step[-1].outputs if o.index == index][0]
            assert (final.text, final.token_ids, final.finish_reason) == (want.text, want.token_ids, want.finish_reason)


async def _collect(stream) -> list:
    return [out async for out in stream]


class _Req:
    def __init__(self, rid: str, stream: bool = True):
        self.request_id, self.stream, self.finished = rid, stream, False


def test_coalescer_holds_by_request_and_flushes_when_the_interval_passes():
    c = StreamCoalescer(item_seconds=0.025)                # 3 requests in the engine: a 50 ms interval
    a, b, quiet = _Req("a"), _Req("b"), _Req("q", stream=False)

    def ids(reqs):
        return [r.request_id for r in reqs]

    assert ids(c.due({"a": a, "b": b, "q": quiet}, 0.0, 3)) == ["a", "b"]          # first outputs at once
    assert c.due({"a": a, "b": b}, 0.02, 3) == []                                     # held
    assert c.due({"a": a}, 0.04, 3) == []                                             # b was preempted
    assert ids(c.due({}, 0.06, 3)) == ["a", "b"]                                      # interval passed
    c.due({"b": b}, 0.07, 3)
    c.forget("b")                                                                     # aborted
    assert "b" not in c.held and "b" not in c.last_sent
    a.finished = quiet.finished = True
    assert ids(c.due({"a": a, "q": quiet}, 0.08, 3)) == ["a", "q"]                    # last: at once
    assert c.held == {} and "a" not in c.last_sent
    assert ids(c.due({"b": b, "q": _Req("q2", stream=False)}, 0.09, 1)) == ["b"]      # one stream: every step
    assert ids(c.due({"b": b}, 0.091, 1)) == ["b"]


def test_sse_sends_each_frame_at_once_and_the_last_with_usage_and_done():
    """One write per frame, as soon as it comes; the frame that finishes every choice waits for the stream's end
    and leaves with the usage chunk and [DONE] in the same write."""
    release = asyncio.Event()

    async def frames():
        await release.wait()
        yield [ChoiceDelta(0, " world", [2], None, None)]
        yield [ChoiceDelta(0, "!", [3], None, "length")]

    async def run():
        builder = ResponseBuilder("completion", "cmpl-1", "m", 1, 1, None, include_usage=True)
        first = StreamStart("r", 5, [ChoiceDelta(0, "Hello", [1], None, None)])
        builder.start(0, first)
        writes = OpenAIRoutes._sse(None, [frames()], [first], builder)
        opening = await writes.__anext__()             # the first token, before the stream has produced more
        release.set()
        return opening, [w async for w in writes]

    opening, rest = asyncio.run(run())
    assert opening.count("data: ") == 1 and '"text":"Hello"' in opening
    assert len(rest) == 2 and rest[0].count("data: ") == 1 and '" world"' in rest[0]
    last = rest[1].split("\n\n")
    assert '"finish_reason":"length"' in last[0] and '"usage":' in last[1] and last[2] == "data: [DONE]" \
        and '"completion_tokens":3' in last[1]


@pytest.mark.parametrize("kind", ["chat", "completion"])
def test_sse_events_equal_the_response_models_dump(kind):
    """The stream chunks the builder encodes by hand are the pydantic response models' `model_dump(exclude_none)`:
    opening roles, text, an empty delta, logprobs, finish reasons and the usage chunk."""
    chat = kind == "chat"
    builder = ResponseBuilder(kind, "id-1", "m", 2, 1, 1, include_usage=True)
    builder.start(0, StreamStart("r", 4, []))
    lp = [{5: Logprob(-0.5, 1, "a"), 6: Logprob(-1.5, 2, "b")}]
    frames = [[ChoiceDelta(0, "a", [5], lp, None), ChoiceDelta(1, "", [5], lp, None)],
              [ChoiceDelta(1, "é\"\n", [5], lp, "stop")], [ChoiceDelta(0, "", [], None, "length")]]
    events = builder.opening_events() + "".join(builder.add_events(0, f) for f in frames) + builder.usage_event()
    got = [json.loads(e[len("data: "):]) for e in events.split("\n\n") if e]

    check = ResponseBuilder(kind, "id-1", "m", 2, 1, 1, include_usage=True)
    want = []

    def dump(choices, usage=None):
        cls = ChatCompletionResponse if chat else CompletionResponse
        extra = {"object": "chat.completion.chunk"} if chat else {}
        return cls(id="id-1", created=builder.created, model="m", choices=choices, usage=usage,
                   **extra).model_dump(exclude_none=True)
    if chat:
        want += [dump([ChatChoice(index=i, delta=ChatDelta(role="assistant", content=""))]) for i in (0, 1)]
    for frame in frames:
        for d in frame:
            piece = check._logprobs_piece(d.index, d)
            check.text_len[d.index] += len(d.text)
            choice = (ChatChoice(index=d.index, delta=ChatDelta(content=d.text or None), logprobs=piece,
                                 finish_reason=d.finish_reason) if chat else
                      CompletionChoice(index=d.index, text=d.text, logprobs=piece, finish_reason=d.finish_reason))
            want.append(dump([choice]))
    want.append(dump([], usage=builder.usage()))
    assert got == want
    assert builder.usage().completion_tokens == 3 and builder.finished
