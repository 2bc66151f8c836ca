"""Faults under a real `tidal serve` (one replica, CPU): a request past its deadline, the engine core killed with
requests in flight, the engine core stopped, the server stopped while requests outlast its drain period. Every
client gets its error (on a stream: an error event, then [DONE]) or an error status within seconds, /health fails,
and Serve replaces the replica; the stopped server exits soon after its drain period."""
from __future__ import annotations

import json
import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor

import psutil
import pytest
import requests

from tests.support.serve import wait_serving

REQUEST_TIMEOUT_S = 15
WATCHDOG_S = 4
DRAIN_TIMEOUT_S = 6
EXIT_AFTER_DRAIN_S = 15       # Serve stopping the replica, Ray's shutdown
ANSWER_WITHIN_S = 10          # a client's error after its engine core died
SERVING_AGAIN_WITHIN_S = 60   # a replacement replica serves
LONG = {"max_tokens": 4000, "ignore_eos": True, "temperature": 0}


@pytest.fixture(scope="module")
def server(tidal_server_factory):
    started = tidal_server_factory("--replicas", "1", "--request-timeout-s", str(REQUEST_TIMEOUT_S),
                                   "--engine-watchdog-s", str(WATCHDOG_S), "--drain-timeout-s", str(DRAIN_TIMEOUT_S))
    model = requests.get(f"{started.url}/v1/models", timeout=30).json()["data"][0]["id"]
    yield started, model
    started.stop()


def engine_core_pid(server) -> int:
    """The replica's engine core: the multiprocessing child of the live LLMReplica actor."""
    cores = []
    for proc in psutil.Process(server.process.pid).children(recursive=True):
        try:
            if "spawn_main" in " ".join(proc.cmdline()) and "LLMReplica" in " ".join(proc.parent().cmdline()) \
                    and proc.status() != psutil.STATUS_ZOMBIE:
                cores.append(proc.pid)
        except (psutil.Error, AttributeError):
            continue
    assert len(cores) == 1, f"expected one engine core, found {cores}"
    return cores[0]


def post(server, path: str, body: dict, stream: bool = False) -> requests.Response:
    return requests.post(f"{server.url}{path}", json=body, stream=stream, timeout=120)


def stream_events(server, body: dict) -> tuple[list[str], float]:
    """The `data:` payloads of a streamed completion and when it ended."""
    with post(server, "/v1/completions", {**body, "stream": True}, stream=True) as r:
        assert r.status_code == 200, r.text
        events = [line[len("data: "):] for line in r.iter_lines(decode_unicode=True) if line.startswith("data: ")]
    return events, time.monotonic()


def answer(server, body: dict) -> tuple[requests.Response, float]:
    r = post(server, "/v1/completions", body)
    return r, time.monotonic()


def in_band_error(events: list[str]) -> dict:
    assert events[-1] == "[DONE]", events[-3:]
    return json.loads(events[-2])["error"]


def running_sequences(server) -> int:
    reply = requests.get(f"{server.url}/stats", timeout=30).json()
    return sum(r["stats"]["num_running"] for r in reply["data"])


def wait_health_fails(server, within_s: float) -> requests.Response:
    deadline = time.monotonic() + within_s
    while True:
        r = requests.get(f"{server.url}/health", timeout=10)
        if r.status_code != 200:
            return r
        assert time.monotonic() < deadline, f"/health still passes after {within_s} s"
        time.sleep(0.2)


@pytest.mark.timeout(120, func_only=True)
def test_a_request_past_its_deadline_is_aborted_with_a_timeout_error(server):
    server, model = server
    body = {"model": model, "prompt": "Tell me a very long story.", **LONG}
    start = time.monotonic()
    with ThreadPoolExecutor(2) as pool:
        streamed = pool.submit(stream_events, server, body)
        plain = pool.submit(answer, server, body)
        (events, stream_end), (response, plain_end) = streamed.result(), plain.result()
    assert in_band_error(events)["code"] == "timeout"
    assert len(events) > 2, "tokens streamed before the deadline"
    assert response.status_code == 504 and response.json()["error"]["code"] == "timeout", response.text
    assert max(stream_end, plain_end) - start < REQUEST_TIMEOUT_S + 10
    deadline = time.monotonic() + 10
    while running_sequences(server):               # aborted in the engine, not only answered
        assert time.monotonic() < deadline, "the timed-out requests still run"
        time.sleep(0.2)


@pytest.mark.timeout(180, func_only=True)
def test_a_killed_engine_core_fails_every_request_in_flight_and_the_replica_is_replaced(server):
    server, model = server
    core = engine_core_pid(server)
    prompt = "Tell me a very long story."
    with ThreadPoolExecutor(3) as pool:
        streamed = pool.submit(stream_events, server, {"model": model, "prompt": prompt, **LONG})
        plain = pool.submit(answer, server, {"model": model, "prompt": prompt, **LONG})
        multi = pool.submit(stream_events, server, {"model": model, "prompt": [prompt, "Count to a thousand."], **LONG})
        started = time.monotonic()
        while running_sequences(server) < 4:
            assert time.monotonic() - started < REQUEST_TIMEOUT_S / 2, "the requests did not start in time"
            time.sleep(0.1)
        os.kill(core, signal.SIGKILL)
        killed = time.monotonic()
        (events, stream_end), (response, plain_end), (multi_events, multi_end) = \
            streamed.result(), plain.result(), multi.result()
    assert in_band_error(events)["code"] == "engine_unavailable"
    assert in_band_error(multi_events)["code"] == "engine_unavailable"
    assert response.status_code == 503 and response.json()["error"]["code"] == "engine_unavailable", response.text
    assert max(stream_end, plain_end, multi_end) - killed < ANSWER_WITHIN_S
    health = wait_health_fails(server, ANSWER_WITHIN_S)
    assert health.status_code == 503 and health.json()["error"]["code"] == "engine_unavailable"
    wait_serving(server, model, SERVING_AGAIN_WITHIN_S - (time.monotonic() - killed))
    assert engine_core_pid(server) != core


@pytest.mark.timeout(120, func_only=True)
def test_a_stopped_engine_core_fails_health_within_the_watchdog_period(server):
    server, model = server
    wait_serving(server, model, SERVING_AGAIN_WITHIN_S)
    core = engine_core_pid(server)
    with ThreadPoolExecutor(1) as pool:
        streamed = pool.submit(stream_events, server, {"model": model, "prompt": "Tell me a story.", **LONG})
        started = time.monotonic()
        while running_sequences(server) < 1:
            assert time.monotonic() - started < REQUEST_TIMEOUT_S / 2, "the request did not start in time"
            time.sleep(0.1)
        os.kill(core, signal.SIGSTOP)
        try:
            stopped = time.monotonic()
            health = wait_health_fails(server, WATCHDOG_S + ANSWER_WITHIN_S)
            assert health.status_code == 503 and health.json()["error"]["code"] == "engine_unavailable"
            events, stream_end = streamed.result()
            assert in_band_error(events)["code"] == "engine_unavailable"
            assert stream_end - stopped < WATCHDOG_S + ANSWER_WITHIN_S
        finally:
            try:
                os.kill(core, signal.SIGCONT)
            except ProcessLookupError:
                pass


@pytest.mark.timeout(180, func_only=True)
def test_a_stopping_server_answers_what_outlasts_its_drain_period_then_exits(server):
    """Last in this module: it stops the server. Requests far longer than the drain period get a 503
    `shutting_down` (in-band, then [DONE], on a stream) before the period ends, and the server exits cleanly."""
    server, model = server
    wait_serving(server, model, SERVING_AGAIN_WITHIN_S)
    body = {"model": model, "prompt": "Tell me a very long story.", **LONG}
    with ThreadPoolExecutor(2) as pool:
        streamed = pool.submit(stream_events, server, body)
        plain = pool.submit(answer, server, body)
        started = time.monotonic()
        while running_sequences(server) < 2:
            assert time.monotonic() - started < REQUEST_TIMEOUT_S / 3, "the requests did not start in time"
            time.sleep(0.1)
        server.process.send_signal(signal.SIGTERM)
        stopping = time.monotonic()
        (events, stream_end), (response, plain_end) = streamed.result(), plain.result()
    assert in_band_error(events)["code"] == "shutting_down"
    assert response.status_code == 503 and response.json()["error"]["code"] == "shutting_down", response.text
    assert max(stream_end, plain_end) - stopping < DRAIN_TIMEOUT_S
    assert server.process.wait(timeout=DRAIN_TIMEOUT_S + EXIT_AFTER_DRAIN_S) == 0, server.log_tail()
