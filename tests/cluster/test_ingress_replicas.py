"""`tidal serve --api-server-count 2`: two ingress replicas stream one engine replica's requests over their own
connections to its core (cluster/ingress_replica.py). 64 streams through HAProxy get every token once and in order,
in chunks of a few steps, with the offline engine's greedy text; both ingress processes carry requests; a burst of
4x max_num_seqs is queued (each ingress admits half the token limit, Ray exports both halves); a killed engine core
fails the streams in flight with `engine_unavailable`, and the server serves again once Serve replaced the
replicas."""
from __future__ import annotations

import json
import os
import re
import signal
import time
from concurrent.futures import ThreadPoolExecutor

import psutil
import pytest
import requests
from tests.support.serve import burst_completion_tokens, processes_titled, wait_serving

from replicas import LLM, SamplingParams

openai = pytest.importorskip("openai")

MODEL = "SmolLM2-135M-Instruct"
MAX_SEQS = 64
TOKEN_LIMIT = 8192
CHUNK_TOKENS = 4                # as tests/cluster/test_serve_cluster.py: a chunk carries a few steps at most
SERVING_AGAIN_WITHIN_S = 180    # Serve replaces the engine replica, then the ingress replicas paired with it


@pytest.fixture(scope="module")
def server(tidal_server_factory):
    """The default model on float weights (greedy equal to the offline engine's: see test_serve_cluster.py's
    float_server), whose decode step at 64 streams keeps the stream-item valve open on any CPU."""
    return tidal_server_factory("--quantization", "none", "--api-server-count", "2",
                                "--max-num-seqs", str(MAX_SEQS), "--max-queued-tokens", str(TOKEN_LIMIT))


def exported(server, prefix: str) -> dict[str, float]:
    """Ray's export of the server's metrics: each series of `prefix` by its labels."""
    text = requests.get(f"http://127.0.0.1:{server.metrics_port}/metrics", timeout=30).text
    return {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
            if line.startswith(prefix)}


def wait_for(check, within_s: float, what: str):
    deadline = time.monotonic() + within_s
    while not (found := check()):
        assert time.monotonic() < deadline, what
        time.sleep(1)
    return found


def test_64_streams_through_two_ingress_replicas(server):
    prompts = [f"Story {i}:" for i in range(64)]
    llm = LLM(device="cpu", quantization="none")
    try:
        offline = [o.outputs[0].text for o in llm.generate(prompts[:8], SamplingParams(temperature=0, max_tokens=24,
                                                                                         ignore_eos=True))]
    finally:
        llm.shutdown()
    body = {"model": MODEL, "max_tokens": 24, "temperature": 0, "ignore_eos": True, "stream": True, "logprobs": 0}

    def stream(prompt: str) -> list[dict]:
        with requests.post(f"{server.url}/v1/completions", json={**body, "prompt": prompt}, stream=True,
                           timeout=600) as r:
            assert r.status_code == 200, r.text
            events = [json.loads(line[len("data: "):]) for line in r.iter_lines(decode_unicode=True)
                      if line.startswith("data: {")]
        return [e["choices"][0] for e in events if e["choices"]]

    with ThreadPoolExecutor(max_workers=64) as pool:
        streams = list(pool.map(stream, prompts))
    for chunks in streams:
        assert sum(len(c["logprobs"]["tokens"]) for c in chunks) == 24, chunks
        assert [c.get("finish_reason") for c in chunks] == [None] * (len(chunks) - 1) + ["length"]
        assert max(len(c["logprobs"]["tokens"]) for c in chunks) <= CHUNK_TOKENS, chunks
    assert ["".join(c["text"] for c in chunks) for chunks in streams[:8]] == offline
    assert len(processes_titled(server, "IngressReplica")) == 2
    stats = requests.get(f"{server.url}/stats", timeout=60).json()["data"]
    assert len(stats) == 1 and stats[0]["stats"]["num_running"] == 0 and stats[0]["stats"]["kv_blocks_used"] == 0
    # Serve counts the requests each ingress replica took: HAProxy spread the 64 streams over both.
    def ingress_counts():
        replicas = {re.search(r'replica="([^"]+)"', k).group(1)
                    for k, v in exported(server, "ray_serve_deployment_request_counter").items()
                    if 'deployment="IngressReplica"' in k and 'route="/v1/completions"' in k and v > 0}
        return replicas if len(replicas) == 2 else None

    wait_for(ingress_counts, 90, "Serve exported requests on fewer than two ingress replicas")


def test_a_burst_is_queued_and_each_ingress_admits_half_the_limit(server):
    assert burst_completion_tokens(server, MODEL, 4 * MAX_SEQS, 16) == [16] * (4 * MAX_SEQS)
    limits = wait_for(lambda: [v for v in exported(server, "ray_tidal_max_queued_tokens").values()] or None, 60,
                      "Ray exported no admission limit")
    assert sorted(limits) == [TOKEN_LIMIT // 2] * 2, limits


def engine_core_pid(server) -> int:
    cores = [p.pid for p in psutil.Process(server.process.pid).children(recursive=True)
             if _is_core(p)]
    assert len(cores) == 1, f"expected one engine core, found {cores}"
    return cores[0]


def _is_core(proc) -> bool:
    try:
        return ("spawn_main" in " ".join(proc.cmdline()) and "LLMReplica" in " ".join(proc.parent().cmdline())
                and proc.status() != psutil.STATUS_ZOMBIE)
    except (psutil.Error, AttributeError):
        return False


@pytest.mark.timeout(400, func_only=True)
def test_a_killed_engine_core_fails_the_streams_and_the_server_recovers(server):
    body = {"model": MODEL, "prompt": "Once", "max_tokens": 480, "ignore_eos": True, "stream": True}
    events: list[list[str]] = [[], []]

    def stream(i: int) -> None:
        with requests.post(f"{server.url}/v1/completions", json=body, stream=True, timeout=120) as r:
            for line in r.iter_lines(decode_unicode=True):
                if line.startswith("data: "):
                    events[i].append(line[len("data: "):])

    with ThreadPoolExecutor(2) as pool:
        done = [pool.submit(stream, i) for i in range(2)]
        wait_for(lambda: all(events), 120, "the streams did not start")
        os.kill(engine_core_pid(server), signal.SIGKILL)
        for f in done:
            f.result(timeout=60)
    for got in events:
        assert got[-1] == "[DONE]", got[-3:]
        assert json.loads(got[-2])["error"]["code"] == "engine_unavailable", got[-2]
    wait_serving(server, MODEL, SERVING_AGAIN_WITHIN_S)
