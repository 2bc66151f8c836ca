"""Structured outputs against the session's `tidal serve` (SmolLM2 GGUF, CPU), through the openai SDK: json_schema
outputs that all parse and validate, json_object, a named tool choice whose arguments validate (streamed and
whole alike), a conversation carrying tool calls and results, and logit_bias. Bad schemas and tool definitions:
tests/cluster/test_serve_errors.py."""
from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import jsonschema
import pytest
import requests

openai = pytest.importorskip("openai")

PERSON = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 24},
    "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "address": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 24},
                                                 "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                "required": ["city", "zip"]},
    "hobbies": {"type": "array", "items": {"enum": ["chess", "golf", "music", "reading"]}, "minItems": 1,
                "maxItems": 3},
    "score": {"type": "number", "minimum": 0, "maximum": 10}},
    "required": ["name", "age", "address", "hobbies", "score"]}
PRODUCT = {"type": "object", "properties": {
    "sku": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{3}$"},
    "price": {"type": "number", "minimum": 0, "maximum": 1000},
    "category": {"enum": ["food", "tools", "toys"]},
    "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 3},
    "in_stock": {"type": "boolean"}},
    "required": ["sku", "price", "category", "tags", "in_stock"]}
EVENT = {"type": "object", "properties": {
    "title": {"type": "string", "maxLength": 40},
    "priority": {"type": "integer", "minimum": 1, "maximum": 5},
    "attendees": {"type": "array", "maxItems": 3, "items": {
        "type": "object", "properties": {"name": {"type": "string", "maxLength": 20},
                                         "role": {"enum": ["host", "guest"]}},
        "required": ["name", "role"]}}},
    "required": ["title", "priority", "attendees"]}
ANSWER = {"type": "object", "properties": {
    "answer": {"enum": ["yes", "no", "maybe"]},
    "confidence": {"type": "integer", "minimum": 0, "maximum": 100},
    "reasons": {"type": "array", "items": {"type": "string", "maxLength": 40}, "minItems": 1, "maxItems": 2}},
    "required": ["answer", "confidence", "reasons"]}
SCHEMAS = {"person": PERSON, "product": PRODUCT, "event": EVENT, "answer": ANSWER}
ASKS = ["Reply in JSON.", "Describe it as JSON, please.", "Output JSON only.", "Fill in the JSON.",
        "Make one up, as JSON."]
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30},
                                            "unit": {"enum": ["celsius", "fahrenheit"]}},
           "required": ["city", "unit"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Current weather in a city",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "description": "Local time in a time zone",
                                           "parameters": {"type": "object", "properties": {
                                               "tz": {"type": "string", "maxLength": 12}}, "required": ["tz"]}}}]
WEATHER_QUESTION = [{"role": "user", "content": "What is the weather in Paris?"}]


def json_schema_format(name: str, schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": name, "schema": schema, "strict": True}}


def test_twenty_json_schema_outputs_parse_and_validate(client, model, tidal_server):
    """Four schemas (nested objects, arrays, enums, required fields, bounded numbers, patterns) times five prompts,
    ten at a time on two replicas: every output ends on its own (the grammar forces the end) and validates."""
    jobs = [(name, ask) for name in SCHEMAS for ask in ASKS]

    def ask(job):
        name, text = job
        out = client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": f"A {name}. {text}"}], max_tokens=300, temperature=0,
            response_format=json_schema_format(name, SCHEMAS[name]))
        return name, out.choices[0]

    with ThreadPoolExecutor(max_workers=10) as pool:
        answers = list(pool.map(ask, jobs))
    assert len(answers) == 20
    for name, choice in answers:
        assert choice.finish_reason == "stop", (name, choice.message.content)
        jsonschema.validate(json.loads(choice.message.content), SCHEMAS[name])
    stats = requests.get(f"{tidal_server}/stats", timeout=60).json()["data"]
    assert sum(r["stats"]["constrained_requests"].get("json_schema", 0) for r in stats) >= 20
    assert sum(r["stats"]["grammar_cache_hits"] for r in stats) >= 20 - 2 * len(SCHEMAS)


def test_json_object_and_completions_with_a_schema(client, model):
    out = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Give a JSON object with a cat's name and age."}],
        max_tokens=200, temperature=0, response_format={"type": "json_object"})
    assert out.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(out.choices[0].message.content), dict)
    whole = client.completions.create(model=model, prompt="Is the sky blue? Answer as JSON:", max_tokens=200,
                                      temperature=0, extra_body={"response_format": json_schema_format(
                                          "answer", ANSWER)})
    jsonschema.validate(json.loads(whole.choices[0].text), ANSWER)
    chunks = client.completions.create(model=model, prompt="Is the sky blue? Answer as JSON:", max_tokens=200,
                                       temperature=0, stream=True,
                                       extra_body={"response_format": json_schema_format("answer", ANSWER)})
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole.choices[0].text


def test_named_tool_choice_calls_validate_streamed_and_whole(client, model):
    choice = {"type": "function", "function": {"name": "get_weather"}}
    out = client.chat.completions.create(model=model, messages=WEATHER_QUESTION, tools=TOOLS, tool_choice=choice,
                                         max_tokens=100, temperature=0)
    message = out.choices[0].message
    assert out.choices[0].finish_reason == "tool_calls" and message.content is None
    [call] = message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather" and call.id.startswith("call_")
    jsonschema.validate(json.loads(call.function.arguments), WEATHER)
    calls, finish = {}, None
    for chunk in client.chat.completions.create(model=model, messages=WEATHER_QUESTION, tools=TOOLS,
                                                tool_choice=choice, max_tokens=100, temperature=0, stream=True):
        for c in chunk.choices:
            finish = c.finish_reason or finish
            for d in c.delta.tool_calls or []:
                entry = calls.setdefault(d.index, {"name": "", "arguments": "", "ids": []})
                entry["ids"].append(d.id)
                entry["name"] += (d.function.name or "") if d.function else ""
                entry["arguments"] += (d.function.arguments or "") if d.function else ""
    assert finish == "tool_calls" and list(calls) == [0]
    assert (calls[0]["name"], calls[0]["arguments"]) == (call.function.name, call.function.arguments)
    assert calls[0]["ids"][0].startswith("call_") and not any(calls[0]["ids"][1:])     # the id comes once


def test_a_conversation_with_tool_calls_and_results(client, model):
    call = {"id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": json.dumps({"city": "Paris", "unit": "celsius"})}}
    messages = WEATHER_QUESTION + [{"role": "assistant", "content": None, "tool_calls": [call]},
                                   {"role": "tool", "tool_call_id": "call_1", "content": "21 C and sunny"}]
    prompt_tokens = {}
    for tool_choice in ("auto", "none"):
        out = client.chat.completions.create(model=model, messages=messages, tools=TOOLS, tool_choice=tool_choice,
                                             max_tokens=24, temperature=0)
        assert out.choices[0].finish_reason in ("stop", "length", "tool_calls")
        prompt_tokens[tool_choice] = out.usage.prompt_tokens
    assert prompt_tokens["auto"] > prompt_tokens["none"] + 50          # with "none" no tools are offered


@pytest.fixture(scope="module")
def token_id():
    """The id of a token, given as the text the API reports for it."""
    from replicas.loaders.default_model import default_model_path
    from replicas.tokenizer import Tokenizer, byte_to_unicode
    tokenizer, alphabet = Tokenizer.from_gguf(default_model_path()), byte_to_unicode()
    return lambda text: tokenizer.token_to_id("".join(alphabet[b] for b in text.encode()))


def test_logit_bias_keeps_a_token_out(client, model, token_id):
    prompt = "The capital of France is"

    def completion(**kw):
        return client.completions.create(model=model, prompt=prompt, max_tokens=6, temperature=0, logprobs=0,
                                         **kw).choices[0].logprobs.tokens

    def chat(**kw):
        return [t.token for t in client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": prompt}], max_tokens=6, temperature=0,
            logprobs=True, **kw).choices[0].logprobs.content]

    for generate in (completion, chat):
        first = generate()[0]
        assert token_id(first) is not None
        biased = generate(logit_bias={str(token_id(first)): -100})
        assert biased and first not in biased
