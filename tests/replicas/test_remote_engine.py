"""Clients of one engine core beyond its owner (replicas/core_endpoint.py, replicas/remote_engine.py): each gets
its own requests' outputs, equal to what the owner gets for the same prompt; a client that leaves or falls behind
has its requests aborted and the core goes on; a wrong key never reaches the step loop; a core that goes away or
stops stepping fails the remote client's streams and its health."""
import asyncio
import os
import signal
import socket
import threading
import time
from multiprocessing.connection import AuthenticationError

import pytest
from tests.support.checkpoints import make_tiny_llama

from replicas import EngineConfig, SamplingParams
from replicas.async_engine import AsyncLLMEngine
from replicas.core_endpoint import connect
from replicas.engine_client import EngineDeadError
from replicas.engine_messages import CoreAddress
from replicas.remote_engine import RemoteEngine

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return make_tiny_llama(str(tmp_path_factory.mktemp("remote")), max_position_embeddings=256)


@pytest.fixture()
def owner(model):
    engine = AsyncLLMEngine(EngineConfig.from_flat(model=model, device="cpu", max_model_len=256,
                                                   engine_watchdog_s=2.0))
    yield engine
    engine.shutdown()


async def tokens(engine, prompt, rid, params=GREEDY):
    out = None
    async for out in engine.generate(prompt, params, rid):
        pass
    return out.outputs[0].token_ids


def wait_until(check, timeout_s=20.0):
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def test_clients_get_their_own_outputs(owner):
    address = owner.open_endpoint("127.0.0.1")
    assert owner.open_endpoint("127.0.0.1") == address            # idempotent
    a, b = RemoteEngine(address, owner.config), RemoteEngine(address, owner.config)
    try:
        assert a.info == owner.info and a.tokenizer.vocab_size == owner.tokenizer.vocab_size
        prompts = [[5, 6, 7 + i] for i in range(6)]

        async def run():
            jobs = [tokens(c, p, f"{name}-{i}") for i, p in enumerate(prompts)
                    for name, c in (("owner", owner), ("a", a), ("b", b))]
            return await asyncio.gather(*jobs)

        got = asyncio.run(run())
        for i in range(len(prompts)):
            assert got[3 * i] == got[3 * i + 1] == got[3 * i + 2] and len(got[3 * i]) == 12
        with pytest.raises(ValueError, match="already running"):        # an id another client runs is refused
            async def clash():
                first = a.generate([5, 6, 7], SamplingParams(max_tokens=100, ignore_eos=True), "same")
                await first.__anext__()
                try:
                    await tokens(b, [5, 6, 7], "same")
                finally:
                    await first.aclose()
            asyncio.run(clash())
        wait_until(lambda: owner.stats().num_running == 0)          # a's abort crosses its own connection
        assert owner.stats().kv_blocks_used == 0
        assert a.stats().num_running == 0 and a.is_alive()
    finally:
        a.shutdown()
        b.shutdown()
    assert not a.is_alive() and owner.is_alive()


def test_a_client_that_leaves_has_its_requests_aborted(owner):
    remote = RemoteEngine(owner.open_endpoint("127.0.0.1"), owner.config)
    long = SamplingParams(temperature=0, max_tokens=owner.max_model_len - 8, ignore_eos=True)
    owner.drain_finished_timings()

    async def run():
        streams = [remote.generate([5, 6, 7 + i], long, f"left-{i}") for i in range(4)]
        await asyncio.gather(*(s.__anext__() for s in streams))
        # Held still while the connection drops, the core reads the EOF before its next step: the requests are
        # at their first tokens, far from their last.
        os.kill(owner._proc.pid, signal.SIGSTOP)
        with socket.socket(fileno=os.dup(remote._to_core.fileno())) as raw:
            raw.shutdown(socket.SHUT_RDWR)  # the connection drops under open streams, without a goodbye
        os.kill(owner._proc.pid, signal.SIGCONT)
        deadline = time.monotonic() + 20
        while (await asyncio.to_thread(owner.stats)).num_running:
            assert time.monotonic() < deadline, "the core kept the requests of a client that left"
            await asyncio.sleep(0.05)
        for s in streams:                   # what arrived before the drop, then the end
            with pytest.raises(EngineDeadError):
                async for _ in s:
                    pass

    asyncio.run(run())
    assert owner.stats().kv_blocks_used == 0
    done = [t for t in owner.drain_finished_timings() if t.request_id.startswith("left-")]
    assert all(t.num_generation_tokens < long.max_tokens for t in done), done
    assert asyncio.run(tokens(owner, [5, 6, 7], "after")) and owner.is_alive()
    assert not remote.is_alive()
    remote.shutdown()


def test_a_wrong_key_is_refused(owner):
    address = owner.open_endpoint("127.0.0.1")
    with pytest.raises(AuthenticationError):
        connect(CoreAddress(address.host, address.port, b"x" * 32))
    assert asyncio.run(tokens(owner, [5, 6, 7], "still")) and owner.is_alive()


def test_a_gone_core_fails_the_remote_client(owner):
    remote = RemoteEngine(owner.open_endpoint("127.0.0.1"), owner.config)
    long = SamplingParams(temperature=0, max_tokens=10_000 // 100, ignore_eos=True)

    async def run():
        got = 0
        async for _ in remote.generate([5, 6, 7], long, "doomed"):
            got += 1
            if got == 2:
                owner._proc.kill()
        return got

    with pytest.raises(EngineDeadError):
        asyncio.run(run())
    wait_until(lambda: not remote.is_alive())
    with pytest.raises(EngineDeadError):
        asyncio.run(tokens(remote, [5, 6, 7], "later"))
    remote.shutdown()


def test_a_stuck_core_makes_the_remote_client_unhealthy(owner):
    remote = RemoteEngine(owner.open_endpoint("127.0.0.1"), owner.config)
    os.kill(owner._proc.pid, signal.SIGSTOP)
    try:
        wait_until(lambda: remote.health().stuck, timeout_s=10)
        assert not remote.is_alive() and "no answer" in remote.health().detail
    finally:
        os.kill(owner._proc.pid, signal.SIGCONT)
        remote.shutdown()


def test_a_socket_client_never_blocks_the_core_and_is_dropped_when_far_behind(monkeypatch):
    """SocketClient.send returns at once however little the peer reads: what the socket does not take waits in
    `pending` and goes out in order, in the framing `recv_bytes` reads; past MAX_PENDING_BYTES the client closes."""
    from multiprocessing.connection import Connection

    from replicas import core_endpoint
    from replicas.core_endpoint import SocketClient
    ours, theirs = socket.socketpair()
    client, peer = SocketClient(Connection(ours.detach()), "t"), Connection(theirs.detach())
    messages = [bytes([i % 256]) * 50_000 for i in range(200)]          # 10 MB, more than the socket buffers
    for m in messages:
        client.send(m)
    assert client.pending and not client.closed
    got = []
    reader = threading.Thread(target=lambda: got.extend(peer.recv_bytes() for _ in messages))
    reader.start()
    while reader.is_alive():
        client.flush()
        time.sleep(0.001)
    assert got == messages and not client.pending
    monkeypatch.setattr(core_endpoint, "MAX_PENDING_BYTES", 1 << 20)
    for m in messages:
        client.send(m)
    assert client.closed and not client.pending
    client.close()
    peer.close()
