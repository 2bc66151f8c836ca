"""The engine core process behind AsyncLLMEngine: errors cross the pipe with their type and fields, engine calls
answer between steps, and a core that dies fails every open stream and the liveness check."""
import asyncio

import pytest
from tests.support.checkpoints import make_tiny_llama

from replicas import EngineConfig, SamplingParams
from replicas.async_engine import AsyncLLMEngine, ChatPrompt, EngineDeadError, RequestError


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return make_tiny_llama(str(tmp_path_factory.mktemp("core")), max_position_embeddings=256)


def collect(engine, prompt, params, rid):
    async def run():
        return [o async for o in engine.generate(prompt, params, rid)]
    return asyncio.run(run())


def test_errors_and_calls_cross_the_pipe(model):
    engine = AsyncLLMEngine(EngineConfig.from_flat(model=model, device="cpu", max_model_len=64))
    try:
        with pytest.raises(RequestError) as e:
            collect(engine, list(range(3, 100)), SamplingParams(max_tokens=4), "too-long")
        assert e.value.code == "context_length_exceeded" and e.value.param is not None
        with pytest.raises(ValueError):          # the chat template refuses an unknown role, in the core
            collect(engine, ChatPrompt([{"role": "wizard", "content": "hi"}]), SamplingParams(max_tokens=4), "chat")
        outs = collect(engine, [5, 6, 7], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True), "ok")
        assert outs[0].prompt_token_ids == [5, 6, 7] and outs[-1].prompt_token_ids == [5, 6, 7]
        assert outs[-1].finished and len(outs[-1].outputs[0].token_ids) == 6
        assert engine.reconfigure(max_num_batched_tokens=128)["max_num_batched_tokens"] == 128
        with pytest.raises(ValueError):
            engine.reconfigure(elastic="elastic")              # not started elastic
        stats = engine.stats()
        assert stats.num_running == 0 and stats.kv_blocks_used == 0
        assert [t.request_id for t in engine.drain_finished_timings()][-1] == "ok"
        assert engine.is_alive()
    finally:
        engine.shutdown()
    assert not engine.is_alive()


def test_a_dead_core_fails_open_streams_and_liveness(model):
    engine = AsyncLLMEngine(EngineConfig(model=model, device="cpu"))
    params = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)

    async def run():
        got = 0
        async for _ in engine.generate([5, 6, 7], params, "doomed"):
            got += 1
            if got == 2:
                engine._proc.kill()              # the core process dies mid-stream
        return got

    try:
        with pytest.raises(EngineDeadError):
            asyncio.run(run())
        assert not engine.is_alive()
        with pytest.raises(EngineDeadError):
            collect(engine, [5, 6], params, "after")
    finally:
        engine.shutdown()
