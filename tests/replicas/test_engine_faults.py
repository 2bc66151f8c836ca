"""The engine survives bad requests and faults: a request's own failure ends that request only, a step that runs out
of device memory or an elastic reclaim that fails ends the requests of that step and the engine serves the next
ones exactly as a clean engine does; limits and a KV pool smaller than one sequence are refused at admission or
start-up instead of waiting forever; the async engine tokenizes off its event loop, enforces deadlines and reports
a stuck core."""
import asyncio
import logging
import multiprocessing as mp
import os
import signal
import threading

import pytest
import torch

from tests.support.checkpoints import make_tiny_llama
from memory.vmm import VmmError
from replicas import EngineConfig, SamplingParams
from replicas.async_engine import (AsyncLLMEngine, ChatPrompt, EngineDeadError, EngineStepError, RequestError,
                                   RequestTimeout)
from replicas.engine import LLMEngine
from replicas.engine_core import EngineCore
from replicas.engine_messages import AddRequest, Outputs, RequestFailed, Shutdown, decode_core_message

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
PROMPT_B = [11, 12, 13, 14, 15, 16, 17]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return make_tiny_llama(str(tmp_path_factory.mktemp("faults")))


@pytest.fixture(scope="module")
def engine(model):
    """Prefix caching off: a prompt run twice is computed the same way both times (a clean run is the reference)."""
    return LLMEngine(EngineConfig.from_flat(model=model, device="cpu", num_kv_blocks=64, max_num_seqs=2,
                                            enable_prefix_caching=False))


def drive(engine, max_steps=2000) -> dict[str, list[int]]:
    done = {}
    for _ in range(max_steps):
        if not engine.has_unfinished:
            return done
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.outputs[0].token_ids
    raise AssertionError(f"still unfinished after {max_steps} steps")


def run_alone(engine, rid, prompt, params=GREEDY) -> list[int]:
    engine.add_request(rid, prompt, params)
    return drive(engine)[rid]


def fail_once(monkeypatch, obj, name, error):
    real = getattr(obj, name)
    raised = []

    def flaky(*args, **kw):
        if not raised:
            raised.append(error)
            raise error
        return real(*args, **kw)
    monkeypatch.setattr(obj, name, flaky)
    return raised


@pytest.mark.timeout(60)
def test_out_of_memory_fails_the_step_and_the_engine_goes_on(engine, monkeypatch):
    want = run_alone(engine, "ref", PROMPT_B)
    raised = fail_once(monkeypatch, engine.runner, "execute", torch.OutOfMemoryError("injected: CUDA out of memory"))
    for rid in ("a", "b"):
        engine.add_request(rid, [5, 6, 7], GREEDY)
    engine.add_request("c", PROMPT_B, GREEDY)           # max_num_seqs=2: waits, not part of the failing step
    assert engine.step() == [] and raised
    failed = dict(engine.take_failed())
    assert set(failed) == {"a", "b"} and all(isinstance(e, EngineStepError) for e in failed.values())
    assert "Traceback" not in str(failed["a"])
    assert drive(engine) == {"c": want}
    assert engine.block_manager.num_used_blocks == 0 and engine.take_failed() == []


@pytest.mark.timeout(60)
def test_a_request_that_fails_on_its_own_ends_alone(engine, monkeypatch):
    engine.add_request("sick", [5, 6, 7], GREEDY)
    engine.add_request("well", PROMPT_B, GREEDY)
    engine.step()
    def broken_update(ids):
        raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "injected")
    monkeypatch.setattr(engine.requests["sick"].detokenizers[0], "update", broken_update)
    done = drive(engine)
    (rid, error), = engine.take_failed()
    assert rid == "sick" and isinstance(error, RuntimeError) and "UnicodeDecodeError" in str(error)
    assert set(done) == {"well"} and len(done["well"]) == GREEDY.max_tokens
    assert engine.block_manager.num_used_blocks == 0


@pytest.mark.timeout(60)
def test_limits_are_refused_by_name(engine):
    limits = engine.config.limits
    cases = {"stop_token_ids": dict(stop_token_ids=list(range(limits.max_stop_token_ids + 1))),
             "stop": dict(stop=[f"s{i}" for i in range(limits.max_stop_strings + 1)])}
    for param, kw in cases.items():
        with pytest.raises(RequestError) as e:
            engine.add_request("x", [5, 6], SamplingParams(**kw))
        assert e.value.param == param
    with pytest.raises(RequestError, match="characters") as e:
        engine.add_request("x", [5, 6], SamplingParams(stop=["y" * (limits.max_stop_string_chars + 1)]))
    assert e.value.param == "stop"
    bad = SamplingParams()
    bad.temperature = 9.0                               # changed after construction: checked again at admission
    with pytest.raises(RequestError) as e:
        engine.add_request("x", [5, 6], bad)
    assert e.value.param == "temperature"
    narrow = EngineConfig.from_flat(max_stop_token_ids=1, max_stop_strings=0, max_stop_string_chars=2).limits
    assert (narrow.max_stop_token_ids, narrow.max_stop_strings, narrow.max_stop_string_chars) == (1, 0, 2)
    assert not engine.has_unfinished


@pytest.mark.timeout(60)
def test_a_core_answers_failing_requests_and_keeps_serving(engine, monkeypatch):
    """The core loop (in a thread here): a request whose admission raises something unexpected and one whose step
    runs out of memory each get a RequestFailed; the next request is served as before; the heartbeat moves."""
    want = run_alone(engine, "ref-core", PROMPT_B)
    core_in, to_core = mp.Pipe(duplex=False)
    from_core, core_out = mp.Pipe(duplex=False)
    heartbeat = mp.Value("d", 0.0, lock=False)
    real_add = engine.add_request

    def add(rid, *args, **kw):
        if rid == "odd":
            raise KeyError("injected")
        return real_add(rid, *args, **kw)
    monkeypatch.setattr(engine, "add_request", add)
    core = EngineCore(engine, core_in, core_out, heartbeat)
    thread = threading.Thread(target=core.run, daemon=True)
    thread.start()

    def receive():
        assert from_core.poll(30)
        return decode_core_message(from_core.recv_bytes())
    try:
        to_core.send(AddRequest("odd", [5, 6, 7], GREEDY))
        msg = receive()
        assert isinstance(msg, RequestFailed) and msg.request_id == "odd" and "KeyError" in str(msg.error)
        fail_once(monkeypatch, engine.runner, "execute", torch.OutOfMemoryError("injected"))
        to_core.send(AddRequest("oom", [5, 6, 7], GREEDY))
        msg = receive()
        assert isinstance(msg, RequestFailed) and isinstance(msg.error, EngineStepError)
        to_core.send(AddRequest("after", PROMPT_B, GREEDY))
        tokens = []
        while True:
            msg = receive()
            assert isinstance(msg, Outputs)
            (out,) = msg.outputs
            tokens += out.outputs[0].delta_token_ids
            if out.finished:
                break
        assert tokens == want and heartbeat.value > 0
    finally:
        to_core.send(Shutdown())
        thread.join(30)
    assert not thread.is_alive() and not engine.has_unfinished


@pytest.mark.timeout(90)
def test_a_failed_reclaim_fails_the_running_requests_and_lending_goes_on(model, monkeypatch):
    base, reserve = 8, 8
    engine = LLMEngine(EngineConfig.from_flat(
        model=model, device="cpu", num_kv_blocks=base + reserve, block_size=16, max_model_len=base * 16,
        max_num_batched_tokens=256, enable_prefix_caching=False, elastic="elastic", reserve_blocks=reserve,
        elastic_lend_step_tokens=16, elastic_lend_after_steps=1, elastic_min_lend_steps=0))
    long_prompt = list(range(20, 60))                   # a 40-token prefill: the reserve must come back first
    want = run_alone(engine, "ref", long_prompt)
    engine.add_request("decoding", [5, 6, 7], SamplingParams(temperature=0, max_tokens=60, ignore_eos=True))
    for _ in range(4):
        engine.step()
    assert engine.block_manager.reserve_lent
    raised = fail_once(monkeypatch, engine.elastic, "dispatch", VmmError("injected: cuMemUnmap failed"))
    lends = engine.elastic.lend_total
    engine.add_request("prefill", long_prompt, GREEDY)
    done = drive(engine)
    (rid, error), = engine.take_failed()
    assert raised and rid == "decoding" and isinstance(error, EngineStepError)
    assert done == {"prefill": want}
    assert engine.runner.kv.memory.mapped == engine.block_manager.reserve_mapped
    assert engine.elastic.lend_total > lends, "the reserve is lent again after the failure"
    assert engine.block_manager.num_used_blocks == 0
    engine.shutdown()


@pytest.mark.timeout(60)
def test_a_pool_smaller_than_the_model_context_caps_it_and_never_livelocks(model, caplog):
    with caplog.at_level(logging.WARNING, logger="replicas.engine"):
        engine = LLMEngine(EngineConfig.from_flat(model=model, device="cpu", num_kv_blocks=4, block_size=16))
    assert engine.max_model_len == 64 and "max_model_len lowered" in caplog.text
    with pytest.raises(RequestError) as e:
        engine.add_request("long", list(range(5, 105)), GREEDY)
    assert e.value.code == "context_length_exceeded"
    with pytest.raises(RequestError) as e:
        engine.add_request("long-output", [5, 6, 7], SamplingParams(max_tokens=100))
    assert e.value.code == "context_length_exceeded"
    # Two sequences of 40 tokens (3 blocks) each fit the 4 blocks alone, not together: preemption, then both finish.
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    for rid in ("x", "y"):
        engine.add_request(rid, list(range(30, 50)), params)
    done = drive(engine, max_steps=400)
    assert {rid: len(t) for rid, t in done.items()} == {"x": 20, "y": 20}
    assert engine.scheduler.num_preemptions > 0
    assert len(run_alone(engine, "short", [5, 6, 7])) == GREEDY.max_tokens
    # Were a request ever admitted that cannot fit, it fails instead of waiting for room forever.
    engine.max_model_len = 10 ** 6
    engine.add_request("huge", list(range(5, 105)), GREEDY)
    assert drive(engine, max_steps=5) == {}
    (rid, error), = engine.take_failed()
    assert rid == "huge" and error.code == "context_length_exceeded"
    engine.shutdown()


@pytest.mark.timeout(60)
def test_an_explicit_context_beyond_the_pool_refuses_to_start(model):
    with pytest.raises(ValueError, match="--max-model-len"):
        LLMEngine(EngineConfig.from_flat(model=model, device="cpu", num_kv_blocks=4, block_size=16,
                                         max_model_len=512))


# ---- the async engine (one engine core process per test below) ----------------------------------

async def _collect(stream) -> list:
    return [out async for out in stream]


@pytest.mark.timeout(120)
def test_async_engine_tokenizes_off_the_loop_enforces_deadlines_and_reports_health(model):
    engine = AsyncLLMEngine(EngineConfig.from_flat(model=model, device="cpu"))
    encode_threads = []
    real_encode = engine.tokenizer.encode

    def encode(*args, **kw):
        encode_threads.append(threading.current_thread().name)
        return real_encode(*args, **kw)
    engine.tokenizer.encode = encode
    long_run = SamplingParams(temperature=0, max_tokens=480, ignore_eos=True)

    async def run():
        loop = asyncio.get_running_loop()
        text = await _collect(engine.generate("hello there", GREEDY, "text"))
        chat = ChatPrompt([{"role": "user", "content": "hi"}])
        chatted = await _collect(engine.generate(chat, GREEDY, "chat"))
        with pytest.raises(RequestTimeout):
            await _collect(engine.generate([5, 6, 7], long_run, "late", deadline=loop.time() + 0.05))
        with pytest.raises(RequestTimeout):
            await _collect(engine.generate([5, 6, 7], GREEDY, "past", deadline=loop.time() - 1))
        with pytest.raises(RequestError) as e:
            await _collect(engine.generate("x " * 2000, GREEDY, "too-long"))
        assert e.value.code == "context_length_exceeded"
        with pytest.raises(RequestError) as e:
            await _collect(engine.generate([5], SamplingParams(stop_token_ids=list(range(65))), "limits"))
        assert e.value.param == "stop_token_ids"
        return text, chatted

    try:
        text, chatted = asyncio.run(run())
        assert encode_threads and all(name.startswith("tidal-tokenize") for name in encode_threads)
        assert text[-1].prompt == "hello there" and text[-1].prompt_token_ids == real_encode("hello there")
        assert chatted[0].prompt_token_ids == engine.tokenizer.encode_chat([{"role": "user", "content": "hi"}])
        stats = engine.stats()              # answered after the late request's abort, sent before it on the pipe
        assert (stats.num_running, stats.num_waiting, stats.kv_blocks_used) == (0, 0, 0)
        health = engine.health()
        assert health.alive and not health.stuck and health.detail == "ok"
        assert health.seconds_since_heartbeat < engine.config.serving.watchdog_s
    finally:
        engine.shutdown()
    assert not engine.health().alive


@pytest.mark.timeout(120)
def test_a_stuck_core_ends_every_stream_and_refuses_new_requests(model):
    engine = AsyncLLMEngine(EngineConfig.from_flat(model=model, device="cpu", engine_watchdog_s=2.0))
    params = SamplingParams(temperature=0, max_tokens=480, ignore_eos=True)

    async def run():
        got = 0
        async for _ in engine.generate([5, 6, 7], params, "frozen"):
            got += 1
            if got == 2:
                os.kill(engine._proc.pid, signal.SIGSTOP)     # the core hangs (as in a stuck collective)
        return got

    try:
        with pytest.raises(EngineDeadError, match="stuck"):
            asyncio.run(run())
        health = engine.health()
        assert health.stuck and not health.alive and not engine.is_alive()
        assert health.seconds_since_heartbeat > 2.0
        with pytest.raises(EngineDeadError):
            asyncio.run(_collect(engine.generate([5, 6], GREEDY, "after")))
    finally:
        engine.shutdown()                                 # kills the stopped core at once
        if engine._proc.is_alive():
            os.kill(engine._proc.pid, signal.SIGKILL)
    assert not engine._proc.is_alive()
