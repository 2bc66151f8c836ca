"""Property-based fuzzing of the OpenAI routes, generated from the server's own /openapi.json (schemathesis):
every request, valid or not, gets a 2xx or a 4xx with an OpenAI error object (never a 5xx, a broken stream or a
traceback), and the server still serves a normal request afterwards.

Generation is derandomized with a fixed number of examples per operation and mode, so every run sends the same
requests. Generated values that only cost time (max_tokens, n, prompt counts) are clamped before sending, and a
body without max_tokens gets a small one; the model id is the served one for most valid bodies, so they reach
the engine instead of stopping at the 404."""
from __future__ import annotations

import json
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests

schemathesis = pytest.importorskip("schemathesis")
hypothesis = pytest.importorskip("hypothesis")
from schemathesis.generation.modes import GenerationMode  # noqa: E402

POSITIVE, NEGATIVE = GenerationMode.POSITIVE, GenerationMode.NEGATIVE
# Chat bodies (lists of message objects) cost about four times as much to generate as completion bodies.
EXAMPLES = {("POST /v1/completions", POSITIVE): 1400, ("POST /v1/chat/completions", POSITIVE): 350,
            ("POST /v1/completions", NEGATIVE): 150, ("POST /v1/chat/completions", NEGATIVE): 100}
PLAIN_GETS = ("/health", "/v1/models", "/stats", "/openapi.json")
MAX_TOKENS, MAX_N, MAX_PROMPTS, MAX_MESSAGES = 2, 2, 2, 4
CONCURRENCY = 16
ERROR_FIELDS = {"message", "type", "param", "code"}


def bounded(body, served_model: str, serial: int, positive: bool):
    """The generated body with its costly values clamped (wrong types and negative values pass untouched)."""
    if not isinstance(body, dict):
        return body
    body = dict(body)
    for key, limit in (("max_tokens", MAX_TOKENS), ("max_completion_tokens", MAX_TOKENS),
                       ("min_tokens", MAX_TOKENS), ("n", MAX_N), ("best_of", MAX_N)):
        value = body.get(key)
        if isinstance(value, int) and not isinstance(value, bool) and value > limit:
            body[key] = limit
    for key in ("max_tokens", "max_completion_tokens"):
        if key in body and body[key] is None:
            del body[key]
    if "max_tokens" not in body and "max_completion_tokens" not in body:
        body["max_tokens"] = MAX_TOKENS          # unset or null: 16 tokens, or (chat) up to the context length
    if isinstance(body.get("prompt"), list) and body["prompt"] and isinstance(body["prompt"][0], (str, list)):
        body["prompt"] = body["prompt"][:MAX_PROMPTS]
    if isinstance(body.get("messages"), list):
        body["messages"] = body["messages"][:MAX_MESSAGES]
    if positive and serial % 4:
        body["model"] = served_model
    return body


def problem(response: requests.Response) -> str | None:
    """What is wrong with an answer, or None."""
    status = response.status_code
    if not 200 <= status < 500 or 300 <= status < 400:
        return f"status {status}"
    if status >= 400:
        try:
            error = response.json()["error"]
        except (ValueError, KeyError, TypeError):
            return f"{status} without an OpenAI error object"
        if set(error) != ERROR_FIELDS or not isinstance(error["message"], str) or not error["message"]:
            return f"{status} with a malformed error object {error}"
        if "Traceback" in error["message"]:
            return f"{status} with a traceback"
        return None
    if response.headers.get("content-type", "").startswith("text/event-stream"):
        events = [line[len("data: "):] for line in response.text.splitlines() if line.startswith("data: ")]
        if not events or events[-1] != "[DONE]":
            return "a stream that does not end with [DONE]"
        if any('"error"' in e and "error" in json.loads(e) for e in events[:-1]):
            return "a stream with an in-band error"
    return None


@pytest.mark.timeout(300, func_only=True)   # the session server may start in its set-up
def test_generated_requests_get_2xx_or_openai_4xx(tidal_server):
    from hypothesis import HealthCheck, Phase, given, settings

    spec = requests.get(f"{tidal_server}/openapi.json", timeout=30).json()
    served_model = requests.get(f"{tidal_server}/v1/models", timeout=30).json()["data"][0]["id"]
    schema = schemathesis.openapi.from_dict(spec)
    operations = {op.label: op for op in (result.ok() for result in schema.get_all_operations())}
    assert set(label for label, _ in EXAMPLES) <= set(operations), sorted(operations)

    local = threading.local()
    lock = threading.Lock()
    failures: list[str] = []
    sent = [0]

    def send(method: str, url: str, kwargs: dict, body=None) -> None:
        session = getattr(local, "session", None) or requests.Session()
        local.session = session
        if body is not None:
            kwargs = {**kwargs, "data": json.dumps(body).encode()}
        try:
            response = session.request(method, url, timeout=120, **kwargs)
            why = problem(response)
        except requests.RequestException as e:
            why, response = f"no answer: {e}", None
        with lock:
            sent[0] += 1
            if why is not None and len(failures) < 20:
                failures.append(f"{method} {url} {body!r:.400}: {why}; {response.text[:400] if response else ''}")

    with ThreadPoolExecutor(CONCURRENCY) as pool:
        for path in PLAIN_GETS:
            pool.submit(send, "GET", f"{tidal_server}{path}", {})
        for (label, mode), count in EXAMPLES.items():
            serial = iter(range(1 << 30))

            @settings(max_examples=count, derandomize=True, database=None, deadline=None,
                      phases=[Phase.generate], suppress_health_check=list(HealthCheck))
            @given(operations[label].as_strategy(generation_mode=mode))
            def generate(case):
                kwargs = case.as_transport_kwargs(base_url=tidal_server)
                method, url = kwargs.pop("method"), kwargs.pop("url")
                body = kwargs.pop("json", None)
                if body is not None:
                    body = bounded(body, served_model, next(serial), mode == POSITIVE)
                pool.submit(send, method, url, kwargs, body)

            generate()

    assert not failures, "\n".join(failures)
    assert sent[0] >= 2000
    after = requests.post(f"{tidal_server}/v1/chat/completions", timeout=120, json={
        "model": served_model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "temperature": 0})
    assert after.status_code == 200 and after.json()["choices"][0]["message"]["content"]
    assert requests.get(f"{tidal_server}/health", timeout=30).status_code == 200
