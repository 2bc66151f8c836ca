"""`tidal serve --async-scheduling` (one replica, CPU, the default model) with the official openai SDK: streams
of requests in flight together assemble into the same text as the same requests answered one at a time, with
their finish reasons and token counts, and the replica's engine launched most of its steps ahead."""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
import requests

STREAMS = 12
MAX_TOKENS = 24


@pytest.fixture(scope="module")
def server(tidal_server_factory):
    started = tidal_server_factory("--replicas", "1", "--async-scheduling")
    model = requests.get(f"{started.url}/v1/models", timeout=30).json()["data"][0]["id"]
    yield started, model
    started.stop()


def ask(client, model: str, i: int, stream: bool) -> tuple[str, str, int]:
    """(text, finish reason, completion tokens) of request i: greedy or seeded sampling, every other one."""
    kw = dict(model=model, messages=[{"role": "user", "content": f"Write a line about the number {i}."}],
              max_tokens=MAX_TOKENS, temperature=0.0 if i % 2 else 0.8, seed=i, extra_body={"ignore_eos": True})
    if not stream:
        r = client.chat.completions.create(**kw)
        return r.choices[0].message.content, r.choices[0].finish_reason, r.usage.completion_tokens
    parts, reason, tokens = [], None, None
    for chunk in client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kw):
        if chunk.choices:
            parts.append(chunk.choices[0].delta.content or "")
            reason = chunk.choices[0].finish_reason or reason
        if chunk.usage is not None:
            tokens = chunk.usage.completion_tokens
    return "".join(parts), reason, tokens


def test_streams_in_flight_equal_the_same_requests_alone(server):
    openai = pytest.importorskip("openai")
    started, model = server
    client = openai.OpenAI(base_url=f"{started.url}/v1", api_key="none", max_retries=0, timeout=120)
    with ThreadPoolExecutor(max_workers=STREAMS) as pool:
        together = list(pool.map(lambda i: ask(client, model, i, stream=True), range(STREAMS)))
    alone = [ask(client, model, i, stream=False) for i in range(STREAMS)]
    assert together == alone
    assert all(reason == "length" and tokens == MAX_TOKENS for _, reason, tokens in together)
    stats = requests.get(f"{started.url}/stats", timeout=60).json()["data"]
    assert sum(replica["stats"]["steps_ahead"] for replica in stats) > 0
