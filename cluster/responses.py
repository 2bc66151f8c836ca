"""OpenAI response bodies and the builder that turns a replica's stream of `ChoiceDelta`s into
SSE chunks or one final response."""
from __future__ import annotations

import functools
import json
import time
from typing import Any, Literal, Optional

from pydantic import BaseModel

from cluster.protocol import ChoiceDelta, StreamStart
from cluster.tool_calls import ToolCallDelta, ToolCallParser
from replicas.outputs import Logprob
from replicas.structured.spec import ToolCallFormat


# ---- responses -------------------------------------------------------------------------

class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class HealthStatus(BaseModel):
    status: Literal["ok"] = "ok"
    model: str


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "tidal"
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: Optional[dict[str, Any]] = None
    finish_reason: Optional[str] = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Optional[Usage] = None


class FunctionCallOut(BaseModel):
    name: Optional[str] = None
    arguments: Optional[str] = None


class ToolCallOut(BaseModel):
    index: Optional[int] = None           # in stream chunks only
    id: Optional[str] = None
    type: Optional[Literal["function"]] = None
    function: FunctionCallOut


class ChatDelta(BaseModel):
    role: Optional[str] = None
    content: Optional[str] = None
    tool_calls: Optional[list[ToolCallOut]] = None


class ChatChoice(BaseModel):
    index: int
    message: Optional[ChatDelta] = None
    delta: Optional[ChatDelta] = None
    logprobs: Optional[dict[str, Any]] = None
    finish_reason: Optional[str] = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion", "chat.completion.chunk"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Optional[Usage] = None


def completion_logprobs(token_ids: list[int], logprobs: list[dict[int, Logprob]], offset: int) -> dict:
    """The legacy completions logprobs object for a run of generated tokens starting at `offset` chars."""
    tokens, token_logprobs, top, offsets = [], [], [], []
    for tid, entry in zip(token_ids, logprobs):
        sampled = entry[tid]
        tokens.append(sampled.decoded_token)
        token_logprobs.append(sampled.logprob)
        top.append({lp.decoded_token: lp.logprob for lp in sorted(entry.values(), key=lambda lp: lp.rank)})
        offsets.append(offset)
        offset += len(sampled.decoded_token)
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top, "text_offset": offsets}


def chat_logprobs(token_ids: list[int], logprobs: list[dict[int, Logprob]], top_n: int) -> dict:
    """The chat logprobs object: per token its logprob, bytes and `top_n` alternatives."""
    def item(lp: Logprob) -> dict:
        return {"token": lp.decoded_token, "logprob": lp.logprob, "bytes": list(lp.decoded_token.encode("utf-8"))}
    content = []
    for tid, entry in zip(token_ids, logprobs):
        ranked = sorted(entry.values(), key=lambda lp: lp.rank)[:top_n]
        content.append({**item(entry[tid]), "top_logprobs": [item(lp) for lp in ranked]})
    return {"content": content}


def _tool_call_chunks(deltas: list[ToolCallDelta]) -> list[ToolCallOut]:
    """One entry per call in a chunk: a call's header and its first arguments piece travel together."""
    merged: dict[int, ToolCallOut] = {}
    for d in deltas:
        out = merged.get(d.index)
        if out is None:
            merged[d.index] = ToolCallOut(index=d.index, id=d.id, type="function" if d.id else None,
                                          function=FunctionCallOut(name=d.name, arguments=d.arguments))
        else:
            out.function.arguments += d.arguments
    return list(merged.values())


_json = functools.partial(json.dumps, separators=(",", ":"))


def sse_event(payload: dict) -> str:
    return f"data: {_json(payload)}\n\n"


class ResponseBuilder:
    """Turns one request's frames into OpenAI stream chunks (SSE events) and/or the final response body.

    Choice `i` of prompt `j` is choice `j * n + i` of the response, as in the OpenAI API. A stream chunk is the
    `ChatCompletionResponse` / `CompletionResponse` shape with None fields left out; its fixed part (id, object,
    created, model) is encoded once per request and each chunk encodes only its choice, as plain dicts (no
    pydantic per chunk: tests/replicas/test_stream_batches.py holds them equal to the models' dump). With
    `tool_format` (a chat offering tools) each choice's text goes through a ToolCallParser: content and tool calls
    apart, the finish reason `tool_calls` when a choice that called a tool stopped on its own.
    """

    def __init__(self, kind: Literal["chat", "completion"], request_id: str, model: str, n: int,
                 num_prompts: int, logprobs: Optional[int], include_usage: bool,
                 tool_format: Optional[ToolCallFormat] = None):
        self.chat = kind == "chat"
        self.id, self.model, self.n = request_id, model, n
        self.created = int(time.time())
        self.top_logprobs = logprobs
        self.include_usage = include_usage
        count = n * num_prompts
        self.texts: list[list[str]] = [[] for _ in range(count)]
        self.text_len = [0] * count
        self.num_tokens = [0] * count
        self.finish: list[Optional[str]] = [None] * count
        self.logprobs: list[Optional[dict]] = [None] * count
        self.prompt_tokens = 0
        self.tool_parsers = [ToolCallParser(tool_format) for _ in range(count)] if tool_format else None
        head = {"id": request_id, "object": "chat.completion.chunk" if self.chat else "text_completion",
                "created": self.created, "model": model}
        self._event_head = "data: " + _json(head)[:-1] + ',"choices":['

    def start(self, prompt_index: int, start: StreamStart) -> None:
        self.prompt_tokens += start.prompt_tokens

    def add(self, prompt_index: int, deltas: list["ChoiceDelta"]) -> None:
        """Record one frame."""
        for d in deltas:
            self._record(prompt_index * self.n + d.index, d)

    def opening_events(self) -> str:
        """A chat stream's first events: the assistant role, per choice."""
        if not self.chat:
            return ""
        return "".join(self._event({"index": i, "delta": {"role": "assistant", "content": ""}})
                       for i in range(len(self.texts)))

    def add_events(self, prompt_index: int, deltas: list["ChoiceDelta"]) -> str:
        """Record one frame; returns its SSE events (one chunk per choice that moved)."""
        events = []
        for d in deltas:
            i = prompt_index * self.n + d.index
            piece, text, calls, finish = self._record(i, d)
            choice: dict[str, Any] = {"index": i}
            if self.chat:
                if self.tool_parsers is not None and not (text or calls or finish or piece):
                    continue            # the tool-call parser holds it back
                delta: dict[str, Any] = {"content": text} if text else {}
                if calls:
                    delta["tool_calls"] = [c.model_dump(exclude_none=True) for c in _tool_call_chunks(calls)]
                choice["delta"] = delta
            else:
                choice["text"] = text
            if piece is not None:
                choice["logprobs"] = piece
            if finish is not None:
                choice["finish_reason"] = finish
            events.append(self._event(choice))
        return "".join(events)

    def usage_event(self) -> str:
        """The usage chunk (`choices: []`) when the request asked for it, else nothing."""
        if not self.include_usage:
            return ""
        return self._event_head + '],"usage":' + _json(self.usage().model_dump()) + "}\n\n"

    @property
    def finished(self) -> bool:
        """Every choice has its finish reason: no more frames will come."""
        return all(f is not None for f in self.finish)

    def usage(self) -> Usage:
        completion = sum(self.num_tokens)
        return Usage(prompt_tokens=self.prompt_tokens, completion_tokens=completion,
                     total_tokens=self.prompt_tokens + completion)

    def final(self) -> dict:
        if self.chat:
            choices = [ChatChoice(index=i, message=self._message(i, "".join(t)), logprobs=self.logprobs[i],
                                  finish_reason=self.finish[i]) for i, t in enumerate(self.texts)]
            body = ChatCompletionResponse(id=self.id, created=self.created, model=self.model, choices=choices,
                                          usage=self.usage())
        else:
            choices = [CompletionChoice(index=i, text="".join(t), logprobs=self.logprobs[i],
                                        finish_reason=self.finish[i]) for i, t in enumerate(self.texts)]
            body = CompletionResponse(id=self.id, created=self.created, model=self.model, choices=choices,
                                      usage=self.usage())
        return body.model_dump(exclude_none=True)

    def _message(self, i: int, content: str) -> ChatDelta:
        calls = self.tool_parsers[i].calls if self.tool_parsers is not None else []
        if not calls:
            return ChatDelta(role="assistant", content=content)
        return ChatDelta(role="assistant", content=content or None, tool_calls=[
            ToolCallOut(id=c.id, type="function", function=FunctionCallOut(name=c.name, arguments=c.arguments))
            for c in calls])

    def _event(self, choice: dict) -> str:
        return self._event_head + _json(choice) + "]}\n\n"

    def _record(self, i: int, d: "ChoiceDelta") -> tuple[Optional[dict], str, Optional[list[ToolCallDelta]],
                                                        Optional[str]]:
        """Add a delta to choice i; returns its logprobs piece (None without logprobs), the text and tool calls it
        adds (with tools, what the parser lets through) and its finish reason."""
        piece = self._logprobs_piece(i, d)
        text, calls, finish = d.text, None, d.finish_reason
        if self.tool_parsers is not None and self.chat:
            text, calls, finish = self._parse_tools(i, d)
        self.texts[i].append(text)
        self.text_len[i] += len(text)
        self.num_tokens[i] += len(d.token_ids)
        self.finish[i] = finish or self.finish[i]
        return piece, text, calls, finish

    def _parse_tools(self, i: int, d: "ChoiceDelta") -> tuple[str, list[ToolCallDelta], Optional[str]]:
        parser = self.tool_parsers[i]
        text, calls = parser.feed(d.text)
        if d.finish_reason is None:
            return text, calls, None
        more, last = parser.finish()
        finish = "tool_calls" if parser.calls and d.finish_reason == "stop" else d.finish_reason
        return text + more, calls + last, finish

    def _logprobs_piece(self, i: int, d: "ChoiceDelta") -> Optional[dict]:
        """This delta's logprobs in the endpoint's format, also appended to choice i's total."""
        if self.top_logprobs is None or not d.logprobs:
            return None
        if self.chat:
            piece = chat_logprobs(d.token_ids, d.logprobs, self.top_logprobs)
        else:
            piece = completion_logprobs(d.token_ids, d.logprobs, self.text_len[i])
        total = self.logprobs[i]
        if total is None:
            self.logprobs[i] = {k: list(v) for k, v in piece.items()}
        else:
            for k, v in piece.items():
                total[k].extend(v)
        return piece
