"""The async engine's batched stream and the replica's merge: a consumer slower than the engine receives
fewer, larger items carrying exactly the tokens, text and finish reason of the per-step stream."""
import asyncio

from checkpoints import make_tiny_llama

from cluster.protocol import ChoiceDelta
from cluster.replica import _merge
from replicas import EngineConfig, SamplingParams
from replicas.async_engine import AsyncLLMEngine


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


def test_pacing_gathers_outputs_and_never_delays_the_last_one(tmp_path):
    """A pace far longer than the request: the first output goes out at once, the rest arrive together as soon
    as the last one is there (no wait for the pace to run out)."""
    engine = AsyncLLMEngine(EngineConfig(model=make_tiny_llama(str(tmp_path / "m")), device="cpu"))
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)

    async def run():
        per_step = [o async for o in engine.generate([5, 6, 7], params, "steps")]
        paced = engine.generate_batches([5, 6, 7], params, "paced", pace=lambda: 600.0)
        batches = await asyncio.wait_for(_collect(paced), timeout=60)
        return per_step, batches

    try:
        per_step, batches = asyncio.run(run())
    finally:
        engine.shutdown()
    assert len(batches) == 2 and batches[-1][-1].finished
    assert [t for b in batches for o in b for t in o.outputs[0].delta_token_ids] == \
        [t for o in per_step for t in o.outputs[0].delta_token_ids]


async def _collect(stream) -> list:
    return [batch async for batch in stream]
