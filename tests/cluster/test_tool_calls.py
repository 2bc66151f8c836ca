"""Tool calling: the call parser on fixed strings (whole and cut into any pieces), the call format read from a chat
template and the fallback prompt, and the chat route of a replica serving a tiny Qwen3 (its own tool template)
in this process: forced calls (tool_choice required and named) in Qwen's format, read back by the parser that
reads `auto` calls, streamed and whole alike."""
from __future__ import annotations

import asyncio
import json

import jsonschema
import pytest
from starlette.requests import Request

from cluster.replica import EngineReplica
from cluster.tool_calls import (HERMES, LLAMA3_JSON, ToolCallParser, ToolSupport, parse_tool_calls,
                                template_messages)
from replicas import EngineConfig
from replicas.loaders.default_model import default_model_path
from replicas.tokenizer import Tokenizer
from tests.support.checkpoints import make_tiny_qwen3

WEATHER = {"type": "object", "properties": {"city": {"enum": ["Paris", "Oslo", "Lima"]},
                                             "days": {"type": "integer", "minimum": 1, "maximum": 7},
                                             "metric": {"type": "boolean"}},
           "required": ["city", "days", "metric"]}
TIME = {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The forecast",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "parameters": TIME}}]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
USER = [{"role": "user", "content": "Weather in Paris for two days?"}]


def streamed(text: str, call_format, step: int) -> tuple[str, list[tuple[str, str]]]:
    """(content, [(name, arguments)]) assembled from the parser's deltas, feeding `text` in pieces of `step`."""
    parser, content, calls = ToolCallParser(call_format), "", {}
    for piece in [text[i:i + step] for i in range(0, len(text), step)] + [None]:
        more, deltas = parser.feed(piece) if piece is not None else parser.finish()
        content += more
        for d in deltas:
            entry = calls.setdefault(d.index, ["", ""])
            entry[0] += d.name or ""
            entry[1] += d.arguments
    return content, [tuple(c) for c in calls.values()]


PARSE_CASES = [
    ('I will look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris \\"x\\" {", "n": [1, {"a": '
     '2}]}}\n</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>\n', HERMES,
     "I will look.", [("get_weather", '{"city": "Paris \\"x\\" {", "n": [1, {"a": 2}]}'), ("get_time", "{}")]),
    ("2 < 3 and <tool is not a call", HERMES, "2 < 3 and <tool is not a call", []),
    ('<tool_call>\n{"arguments": {"x": 1}, "name": "g"}\n</tool_call>', HERMES, "", [("g", '{"x": 1}')]),
    ('<tool_call>\n{"foo": 1}\n</tool_call> after', HERMES, '<tool_call>\n{"foo": 1}\n</tool_call> after', []),
    ('<tool_call>\n{"name": "h\\u00e9", "arguments": {"p": "\\\\"}}', HERMES, "", [("hé", '{"p": "\\\\"}')]),
    ('<tool_call>\n{"name": "cut", "argu', HERMES, '<tool_call>\n{"name": "cut", "argu', []),
    ('{"name": "lookup", "parameters": {"q": "a,b}"}}', LLAMA3_JSON, "", [("lookup", '{"q": "a,b}"}')]),
    ('  {"name": "a", "parameters": {}}; {"name": "b", "parameters": {"z": true}}', LLAMA3_JSON, "",
     [("a", "{}"), ("b", '{"z": true}')]),
    ('Hello {"name": "x"}', LLAMA3_JSON, 'Hello {"name": "x"}', []),
    ('{"just": "json"}', LLAMA3_JSON, '{"just": "json"}', []),
]


@pytest.mark.parametrize("text,call_format,content,calls", PARSE_CASES)
def test_parser_reads_calls_and_content_however_the_text_is_cut(text, call_format, content, calls):
    whole_content, whole_calls = parse_tool_calls(text, call_format)
    assert (whole_content, [(c.name, c.arguments) for c in whole_calls]) == (content, calls)
    for step in (1, 2, 3, 5, 11, len(text)):
        assert streamed(text, call_format, step) == (content, calls)


def test_parser_sends_a_calls_header_once_then_argument_pieces():
    parser = ToolCallParser(HERMES, new_id=lambda: "call_1")
    assert parser.feed("<tool_call>\n{\"name\": \"get_ti") == ("", [])
    content, deltas = parser.feed('me", "arguments": {"zo')
    assert content == "" and [(d.index, d.id, d.name, d.arguments) for d in deltas] == \
        [(0, "call_1", "get_time", ""), (0, None, None, '{"zo')]
    content, deltas = parser.feed('ne": "UTC"}}\n</tool_call>')
    assert [d.arguments for d in deltas] == ['ne": "UTC"}'] and parser.calls[0].arguments == '{"zone": "UTC"}'


@pytest.fixture(scope="module")
def smollm2():
    return Tokenizer.from_gguf(default_model_path())


def test_call_format_is_read_from_the_chat_template(smollm2):
    assert ToolSupport.of_template(smollm2.chat_template) == ToolSupport(HERMES, native=False)
    assert ToolSupport.of_template(None) == ToolSupport(HERMES, native=False)
    assert ToolSupport.of_template("{% for t in tools %}<tool_call>{% endfor %}") == ToolSupport(HERMES, True)
    assert ToolSupport.of_template("{% if tools %}<|python_tag|>{% endif %}") == ToolSupport(LLAMA3_JSON, True)


def test_fallback_prompt_lists_the_functions_and_rewrites_tool_turns(smollm2):
    """SmolLM2's template knows no tools: a system block lists them; earlier calls become hermes blocks and tool
    results user turns, and the whole conversation renders through the model's own template."""
    call = {"id": "call_9", "type": "function", "function": {"name": "get_time", "arguments": '{"zone": "UTC"}'}}
    conversation = [{"role": "system", "content": "Be brief."}, *USER,
                    {"role": "assistant", "content": None, "tool_calls": [call]},
                    {"role": "tool", "tool_call_id": "call_9", "content": "12:00"}]
    messages, tools = template_messages(conversation, TOOLS, ToolSupport(HERMES, native=False))
    assert tools is None and messages[0]["role"] == "system" and messages[0]["content"].startswith("Be brief.")
    assert json.dumps(TOOLS[0]) in messages[0]["content"] and "<tool_call>" in messages[0]["content"]
    assert messages[2] == {"role": "assistant",
                           "content": '<tool_call>\n{"name": "get_time", "arguments": {"zone": "UTC"}}\n</tool_call>'}
    assert messages[3] == {"role": "user", "content": "<tool_response>\n12:00\n</tool_response>"}
    text = smollm2.apply_chat_template(messages)
    assert "get_weather" in text and "<tool_response>" in text
    native, offered = template_messages(conversation, TOOLS, ToolSupport(HERMES, native=True))
    assert offered == TOOLS and native[2]["tool_calls"][0]["function"]["arguments"] == {"zone": "UTC"}


# ---- a tiny Qwen3 behind the chat route, in this process -------------------------------------------------------

@pytest.fixture(scope="module")
def qwen_replica(tmp_path_factory):
    folder = make_tiny_qwen3(str(tmp_path_factory.mktemp("qwen3")))
    replica = EngineReplica(EngineConfig.from_flat(model=folder, device="cpu", num_kv_blocks=64))
    yield replica
    replica.__del__()


def chat(replica, body: dict):
    """The replica's /v1/chat/completions handler on `body`: the response's JSON, or its SSE events."""
    raw = json.dumps({"model": replica.engine.model_name, **body}).encode()

    async def receive():
        return {"type": "http.request", "body": raw, "more_body": False}

    async def run():
        request = Request({"type": "http", "method": "POST", "path": "/v1/chat/completions", "query_string": b"",
                           "headers": [(b"content-type", b"application/json")]}, receive)
        response = await replica.chat_completions(request)
        if not body.get("stream"):
            return json.loads(response.body)
        text = "".join([piece async for piece in response.body_iterator])
        return [json.loads(e[6:]) for e in text.split("\n\n") if e.startswith("data: {")]
    return asyncio.run(run())


def assembled(chunks: list[dict]) -> tuple[list[dict], str]:
    """The tool calls (id, name, arguments) and finish reason that stream chunks assemble to."""
    calls: dict[int, dict] = {}
    finish = None
    for chunk in chunks:
        for choice in chunk["choices"]:
            finish = choice.get("finish_reason") or finish
            for d in choice["delta"].get("tool_calls", []):
                call = calls.setdefault(d["index"], {"id": "", "name": "", "arguments": ""})
                call["id"] += d.get("id") or ""
                call["name"] += d["function"].get("name") or ""
                call["arguments"] += d["function"].get("arguments") or ""
    return list(calls.values()), finish


def test_qwen3_template_is_native_hermes(qwen_replica):
    assert qwen_replica.tool_support() == ToolSupport(HERMES, native=True)


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "get_time"}}])
def test_forced_calls_in_qwens_format_are_read_back_whole_and_streamed(qwen_replica, tool_choice):
    body = {"messages": USER, "tools": TOOLS, "tool_choice": tool_choice, "parallel_tool_calls": False,
            "max_tokens": 120, "temperature": 0}
    whole = chat(qwen_replica, body)
    choice = whole["choices"][0]
    calls = choice["message"]["tool_calls"]
    assert choice["finish_reason"] == "tool_calls" and choice["message"].get("content") is None and len(calls) == 1
    name, arguments = calls[0]["function"]["name"], calls[0]["function"]["arguments"]
    assert calls[0]["type"] == "function" and calls[0]["id"].startswith("call_")
    if isinstance(tool_choice, dict):
        assert name == "get_time"
    jsonschema.validate(json.loads(arguments), SCHEMAS[name])
    stream_calls, finish = assembled(chat(qwen_replica, {**body, "stream": True}))
    assert finish == "tool_calls"
    assert [(c["name"], c["arguments"]) for c in stream_calls] == [(name, arguments)]


def test_parallel_required_calls_and_auto_on_real_output(qwen_replica):
    """`required` with parallel calls: one or more hermes blocks, each valid; `auto` on the tiny model's free text
    reads whatever calls are in it (none, for a random model) and returns the rest as content."""
    body = {"messages": USER, "tools": TOOLS, "tool_choice": "required", "max_tokens": 200, "temperature": 1.0,
            "seed": 7}
    choice = chat(qwen_replica, body)["choices"][0]
    for call in choice["message"].get("tool_calls", []):
        if choice["finish_reason"] == "tool_calls":
            jsonschema.validate(json.loads(call["function"]["arguments"]), SCHEMAS[call["function"]["name"]])
    assert choice["message"]["tool_calls"]
    auto = chat(qwen_replica, {"messages": USER, "tools": TOOLS, "max_tokens": 16, "temperature": 0})["choices"][0]
    assert auto["finish_reason"] in ("stop", "length", "tool_calls")
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in
                   chat(qwen_replica, {"messages": USER, "tools": TOOLS, "max_tokens": 16, "temperature": 0,
                                       "stream": True}) if c["choices"])
    assert text == (auto["message"].get("content") or "")
