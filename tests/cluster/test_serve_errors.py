"""Bad input gets the right status and an OpenAI error object, and the server keeps serving.
A client that leaves mid-stream aborts its request: afterwards no KV block is in use. A failure after the first
token ends a stream with an error event and [DONE], and no client sees a traceback."""
from __future__ import annotations

import asyncio
import json
import time

import pytest
import requests

openai = pytest.importorskip("openai")

MODEL = "SmolLM2-135M-Instruct"
CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
USER = [{"role": "user", "content": "hi"}]
TOOL = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}
DEEP = {"type": "object", "properties": {"a": {}}}
for _ in range(20):
    DEEP = {"type": "object", "properties": {"a": DEEP}}


def json_schema(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}


# (endpoint, body, status, param, code); bodies are dicts, or raw bytes for broken JSON.
CASES = {
    "malformed json": (COMPLETIONS, b'{"model": "x", "prompt": ', 400, None, "invalid_json"),
    "body not an object": (COMPLETIONS, b"[1, 2]", 422, None, "invalid_body"),
    "missing prompt": (COMPLETIONS, {"model": MODEL}, 422, "prompt", None),
    "max_tokens a string": (COMPLETIONS, {"model": MODEL, "prompt": "a", "max_tokens": "lots"}, 422, "max_tokens",
                            None),
    "temperature a string": (CHAT, {"model": MODEL, "messages": USER, "temperature": "0.5"}, 422, "temperature", None),
    "messages not a list": (CHAT, {"model": MODEL, "messages": "hi"}, 422, "messages", None),
    "content a number": (CHAT, {"model": MODEL, "messages": [{"role": "user", "content": 7}]}, 422,
                         "messages[0].content", None),
    "temperature too high": (COMPLETIONS, {"model": MODEL, "prompt": "a", "temperature": 5}, 400, "temperature", None),
    "top_p zero": (CHAT, {"model": MODEL, "messages": USER, "top_p": 0}, 400, "top_p", None),
    "n zero": (COMPLETIONS, {"model": MODEL, "prompt": "a", "n": 0}, 400, "n", None),
    "max_tokens zero": (COMPLETIONS, {"model": MODEL, "prompt": "a", "max_tokens": 0}, 400, "max_tokens", None),
    "logprobs too many": (COMPLETIONS, {"model": MODEL, "prompt": "a", "logprobs": 50}, 400, "logprobs", None),
    "penalty out of range": (CHAT, {"model": MODEL, "messages": USER, "presence_penalty": 3}, 400,
                             "presence_penalty", None),
    "top_logprobs without logprobs": (CHAT, {"model": MODEL, "messages": USER, "top_logprobs": 2}, 400,
                                      "top_logprobs", None),
    "stream_options without stream": (CHAT, {"model": MODEL, "messages": USER,
                                             "stream_options": {"include_usage": True}}, 400, "stream_options", None),
    "unknown model": (CHAT, {"model": "gpt-17", "messages": USER}, 404, "model", "model_not_found"),
    "bad role": (CHAT, {"model": MODEL, "messages": [{"role": "wizard", "content": "x"}]}, 400,
                 "messages[0].role", "invalid_role"),
    "empty messages": (CHAT, {"model": MODEL, "messages": []}, 400, "messages", None),
    "image content": (CHAT, {"model": MODEL, "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}]}, 400, "messages[0].content", None),
    "empty prompt": (COMPLETIONS, {"model": MODEL, "prompt": ""}, 400, "prompt", None),
    "token id out of vocabulary": (COMPLETIONS, {"model": MODEL, "prompt": [1, 10 ** 9]}, 400, "prompt", None),
    "prompt longer than the model": (COMPLETIONS, {"model": MODEL, "prompt": "hello " * 9000}, 400, "prompt",
                                     "context_length_exceeded"),
    "max_tokens past the context": (COMPLETIONS, {"model": MODEL, "prompt": "hi", "max_tokens": 9000}, 400,
                                    "max_tokens", "context_length_exceeded"),
    "tool without a function": (CHAT, {"model": MODEL, "messages": USER, "tools": [{"type": "function"}]}, 422,
                                "tools[0].function", None),
    "tool of another type": (CHAT, {"model": MODEL, "messages": USER, "tools": [TOOL, {**TOOL, "type": "retrieval"}]},
                             400, "tools[1].type", "invalid_value"),
    "tool name with a space": (CHAT, {"model": MODEL, "messages": USER, "tools": [
        {"type": "function", "function": {"name": "get weather"}}]}, 400, "tools[0].function.name", "invalid_value"),
    "tool parameters not a schema": (CHAT, {"model": MODEL, "messages": USER, "tools": [
        {"type": "function", "function": {"name": "f", "parameters": {"type": "foo"}}}]}, 400,
        "tools[0].function.parameters", "invalid_value"),
    "too many tools": (CHAT, {"model": MODEL, "messages": USER, "tools": [
        {"type": "function", "function": {"name": f"f{i}"}} for i in range(129)]}, 400, "tools", "invalid_value"),
    "tool_choice naming another function": (CHAT, {"model": MODEL, "messages": USER, "tools": [TOOL], "tool_choice": {
        "type": "function", "function": {"name": "nope"}}}, 400, "tool_choice", "invalid_value"),
    "tool_choice without tools": (CHAT, {"model": MODEL, "messages": USER, "tool_choice": "required"}, 400,
                                  "tool_choice", "invalid_value"),
    "tool result without its call id": (CHAT, {"model": MODEL, "messages": USER + [
        {"role": "tool", "content": "12:00"}]}, 400, "messages[1].tool_call_id", "invalid_value"),
    "response_format with forced tools": (CHAT, {"model": MODEL, "messages": USER, "tools": [TOOL],
                                                 "tool_choice": "required", "response_format": {"type": "json_object"}},
                                          400, "response_format", "invalid_value"),
    "response_format of another type": (CHAT, {"model": MODEL, "messages": USER, "response_format": {"type": "xml"}},
                                        400, "response_format", "unsupported_parameter"),
    "json_schema without a schema": (COMPLETIONS, {"model": MODEL, "prompt": "a", "response_format": {
        "type": "json_schema", "json_schema": {"name": "x"}}}, 400, "response_format", "invalid_value"),
    "invalid json_schema": (CHAT, {"model": MODEL, "messages": USER, "response_format": json_schema(
        {"type": "object", "properties": {"a": {"type": "strng"}}})}, 400, "response_format", "invalid_value"),
    "json_schema nested too deep": (CHAT, {"model": MODEL, "messages": USER, "response_format": json_schema(
        DEEP)}, 400, "response_format", "invalid_value"),
    "json_schema the grammar cannot enforce": (COMPLETIONS, {"model": MODEL, "prompt": "a", "response_format":
                                                             json_schema({"type": "array", "uniqueItems": True})},
                                               400, "response_format", "invalid_value"),
    "json_schema with min_tokens": (CHAT, {"model": MODEL, "messages": USER, "min_tokens": 2,
                                           "response_format": {"type": "json_object"}}, 400, "min_tokens", None),
    "logit_bias key not a token id": (CHAT, {"model": MODEL, "messages": USER, "logit_bias": {"the": 5}}, 400,
                                      "logit_bias", "invalid_value"),
    "logit_bias beyond the vocabulary": (COMPLETIONS, {"model": MODEL, "prompt": "a", "logit_bias": {"49152": 5}},
                                         400, "logit_bias", "invalid_value"),
    "logit_bias out of range": (COMPLETIONS, {"model": MODEL, "prompt": "a", "logit_bias": {"5": 101}}, 400,
                                "logit_bias", None),
    "logit_bias too long": (CHAT, {"model": MODEL, "messages": USER, "logit_bias": {str(i): 1 for i in range(301)}},
                            400, "logit_bias", "invalid_value"),
    "body too large": (COMPLETIONS, {"model": MODEL, "prompt": "x" * (9 << 20)}, 413, None, "request_too_large"),
}


def post(url: str, body, stream: bool = False) -> requests.Response:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    return requests.post(url, data=data, headers={"Content-Type": "application/json"}, timeout=300, stream=stream)


def replica_stats(url: str) -> list[dict]:
    reply = requests.get(f"{url}/stats", timeout=60).json()
    assert reply["unreachable"] == 0
    return reply["data"]


@pytest.mark.parametrize("case", list(CASES))
def test_bad_input_gets_an_openai_error(tidal_server, case):
    endpoint, body, status, param, code = CASES[case]
    r = post(tidal_server + endpoint, body)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    assert error["type"] == ("invalid_request_error" if status < 500 else "server_error")
    assert error["param"] == param
    if code is not None:
        assert error["code"] == code


def test_unknown_route_is_an_openai_404(tidal_server):
    r = requests.get(f"{tidal_server}/v1/engines", timeout=30)
    assert r.status_code == 404 and r.json()["error"]["type"] == "invalid_request_error"


def test_sdk_raises_typed_errors_and_server_keeps_serving(tidal_server):
    client = openai.OpenAI(base_url=f"{tidal_server}/v1", api_key="unused", timeout=300, max_retries=0)
    with pytest.raises(openai.NotFoundError) as e:
        client.chat.completions.create(model="nope", messages=USER)
    assert e.value.body["code"] == "model_not_found"
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt="a", temperature=9)
    assert e.value.body["param"] == "temperature"
    with pytest.raises(openai.UnprocessableEntityError):
        client.completions.create(model=MODEL, prompt="a", extra_body={"n": "two"})
    with pytest.raises(openai.BadRequestError):   # also as a stream: refused before any byte is sent
        list(client.completions.create(model=MODEL, prompt="hello " * 9000, stream=True))
    out = client.chat.completions.create(model=MODEL, messages=USER, max_tokens=2, temperature=0)
    assert out.choices[0].message.content and out.usage.completion_tokens <= 2


def test_disconnect_mid_stream_frees_kv_blocks(tidal_server):
    body = {"model": MODEL, "prompt": "Tell me a very long story.", "max_tokens": 4000, "stream": True,
            "ignore_eos": True, "temperature": 0}
    with post(f"{tidal_server}{COMPLETIONS}", body, stream=True) as r:
        assert r.status_code == 200
        events = r.iter_lines(decode_unicode=True)
        got = [line for line in (next(events) for _ in range(6)) if line.startswith("data: ")]
        assert got
        assert any(s["stats"]["num_running"] > 0 for s in replica_stats(tidal_server))
    # The request would run for thousands of tokens; only an abort frees its blocks this soon.
    deadline = time.monotonic() + 60
    while True:
        stats = [s["stats"] for s in replica_stats(tidal_server)]
        if all(s["kv_blocks_used"] == 0 and s["num_running"] == 0 and s["num_waiting"] == 0 for s in stats):
            break
        assert time.monotonic() < deadline, f"blocks still in use after the client left: {stats}"
        time.sleep(0.5)
    assert all(s["kv_blocks_total"] > 0 for s in stats)


@pytest.mark.timeout(60, func_only=True)
def test_chunked_body_over_the_limit_is_refused_while_it_is_read(tidal_server):
    """A body with no Content-Length (chunked) gets the OpenAI 413 once it passes the limit, not after 20 MiB."""
    import aiohttp

    async def chunks():
        piece = b'{"model": "' + b"x" * (1 << 16)
        yield piece
        for _ in range((20 << 20) // len(piece)):
            yield b"x" * len(piece)

    async def send() -> tuple[int, dict]:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as session:
            async with session.post(f"{tidal_server}{COMPLETIONS}", data=chunks(),
                                    headers={"Content-Type": "application/json"}) as r:
                assert r.request_info.headers.get("Transfer-Encoding") == "chunked"
                return r.status, await r.json()

    status, body = asyncio.run(send())
    assert status == 413 and body["error"]["code"] == "request_too_large", body


# ---- the routes' own failure handling, on a stand-in replica in this process -----------------------

class _ScriptedReplica:
    """Each prompt is a script: "ok" generates two tokens, "hang" one and then waits, "fail" one and then raises
    a bare exception (an internal error), "dead" one and then the replica's engine-unavailable error."""

    def __init__(self):
        self.closed: list[str] = []

    def model_identity(self):
        return "scripted", 64

    def engine_problem(self):
        return None

    def tool_support(self):
        from cluster.tool_calls import HERMES, ToolSupport
        return ToolSupport(HERMES, native=False)

    def max_schema_bytes(self):
        return 1 << 16

    async def generate(self, job):
        from cluster.errors import engine_unavailable
        from cluster.protocol import ChoiceDelta, StreamStart
        try:
            yield StreamStart("r", 1, [ChoiceDelta(0, "a", [1], None, None)])
            await asyncio.sleep(0.05)
            if job.prompt == "fail":
                raise RuntimeError("Traceback (most recent call last): secret internals")
            if job.prompt == "dead":
                raise engine_unavailable(job.request_id)
            if job.prompt == "hang":
                await asyncio.sleep(3600)
            yield [ChoiceDelta(0, "b", [2], None, "length")]
        finally:
            self.closed.append(job.prompt)


@pytest.fixture()
def scripted(monkeypatch):
    """The real routes (cluster.ingress.app, as Serve mounts them on LLMReplica) in front of `_ScriptedReplica`."""
    from types import SimpleNamespace

    from ray import serve
    from starlette.testclient import TestClient

    import cluster.replica  # noqa: F401  (mounts the routes on the class, as Serve does)
    from cluster.ingress import OpenAIRoutes, app

    replica = type("Scripted", (_ScriptedReplica, OpenAIRoutes), {})()
    replica._init_routes(None, None, 1 << 20)
    monkeypatch.setattr(serve, "get_replica_context", lambda: SimpleNamespace(servable_object=replica))
    with TestClient(app, raise_server_exceptions=False) as client:
        yield client, replica


def _events(text: str) -> list[str]:
    return [line[len("data: "):] for line in text.splitlines() if line.startswith("data: ")]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("failing", ["fail", "dead"])
def test_a_prompt_failing_mid_stream_ends_the_stream_with_an_error_and_done(scripted, failing):
    client, replica = scripted
    r = client.post(COMPLETIONS, json={"model": "scripted", "prompt": ["ok", failing, "hang"], "stream": True})
    assert r.status_code == 200
    events = _events(r.text)
    assert events[-1] == "[DONE]"
    error = json.loads(events[-2])["error"]
    request_id = json.loads(events[0])["id"]
    if failing == "fail":
        assert (error["code"], error["type"]) == ("internal_error", "server_error")
        assert error["message"] == f"internal error (request {request_id})"
    else:
        assert error["code"] == "engine_unavailable" and request_id in error["message"]
    assert sorted(replica.closed) == ["fail" if failing == "fail" else "dead", "hang", "ok"], \
        "every prompt's stream is closed (its request aborted)"


@pytest.mark.timeout(60)
def test_failures_after_the_first_token_get_a_status_without_internals(scripted):
    client, replica = scripted
    r = client.post(COMPLETIONS, json={"model": "scripted", "prompt": ["hang", "fail"]})
    error = r.json()["error"]
    assert r.status_code == 500 and error["code"] == "internal_error"
    assert error["message"].startswith("internal error (request cmpl-") and "Traceback" not in r.text
    r = client.post(COMPLETIONS, json={"model": "scripted", "prompt": "dead"})
    assert r.status_code == 503 and r.json()["error"]["code"] == "engine_unavailable"
    assert sorted(replica.closed) == ["dead", "fail", "hang"]
