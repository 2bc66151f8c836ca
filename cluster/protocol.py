"""The OpenAI wire schema (pydantic) and the replica <-> ingress frames.

Request models check shape and types only (strict, so "0.5" is not a number); ranges are
checked by `SamplingParams` and by `sampling_params()`, so a type error is a 422 and a bad value a 400.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict

from cluster.errors import bad_request
from replicas.outputs import Logprob
from replicas.sampling_params import SamplingParams

CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class StreamOptions(_Strict):
    include_usage: bool = False


class _SamplingRequest(_Strict):
    """Fields shared by /v1/completions and /v1/chat/completions, plus the usual extras."""
    model: str
    n: int = 1
    temperature: Optional[float] = None
    top_p: Optional[float] = None
    stop: Union[str, list[str], None] = None
    seed: Optional[int] = None
    presence_penalty: Optional[float] = None
    frequency_penalty: Optional[float] = None
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    logit_bias: Optional[dict[str, float]] = None
    user: Optional[str] = None
    # extras (OpenAI SDK: extra_body)
    top_k: Optional[int] = None
    min_p: Optional[float] = None
    repetition_penalty: Optional[float] = None
    ignore_eos: bool = False
    min_tokens: int = 0
    stop_token_ids: Optional[list[int]] = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def _check_common(self) -> None:
        if self.logit_bias:
            raise bad_request("logit_bias is not supported", "logit_bias", "unsupported_parameter")
        if self.stream_options is not None and not self.stream:
            raise bad_request("stream_options is only allowed with stream=true", "stream_options")

    def _sampling_params(self, max_tokens: Optional[int], logprobs: Optional[int]) -> SamplingParams:
        def pick(value, default):
            return default if value is None else value
        return SamplingParams(
            n=self.n, temperature=pick(self.temperature, 1.0), top_p=pick(self.top_p, 1.0),
            top_k=pick(self.top_k, -1), min_p=pick(self.min_p, 0.0), seed=self.seed,
            presence_penalty=pick(self.presence_penalty, 0.0), frequency_penalty=pick(self.frequency_penalty, 0.0),
            repetition_penalty=pick(self.repetition_penalty, 1.0), max_tokens=max_tokens,
            min_tokens=self.min_tokens, stop=pick(self.stop, ()), stop_token_ids=pick(self.stop_token_ids, ()),
            include_stop_str_in_output=self.include_stop_str_in_output, ignore_eos=self.ignore_eos,
            logprobs=logprobs, skip_special_tokens=self.skip_special_tokens,
        )


class CompletionRequest(_SamplingRequest):
    prompt: Union[str, list[str], list[int], list[list[int]]]
    max_tokens: Optional[int] = 16
    logprobs: Optional[int] = None
    echo: bool = False
    suffix: Optional[str] = None
    best_of: Optional[int] = None

    def prompts(self) -> list[Union[str, list[int]]]:
        """The prompt field as a list of prompts (text or token ids)."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if not p:
            raise bad_request("prompt must not be empty", "prompt")
        if isinstance(p[0], int):
            return [p]
        return list(p)

    def sampling_params(self) -> SamplingParams:
        self._check_common()
        if self.echo:
            raise bad_request("echo is not supported", "echo", "unsupported_parameter")
        if self.suffix:
            raise bad_request("suffix is not supported", "suffix", "unsupported_parameter")
        if self.best_of is not None and self.best_of != self.n:
            raise bad_request("best_of different from n is not supported", "best_of", "unsupported_parameter")
        return self._sampling_params(self.max_tokens, self.logprobs)


class ContentPart(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    type: str
    text: Optional[str] = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    role: str
    content: Union[str, list[ContentPart], None] = None
    name: Optional[str] = None


class ChatCompletionRequest(_SamplingRequest):
    messages: list[ChatMessage]
    max_tokens: Optional[int] = None
    max_completion_tokens: Optional[int] = None
    logprobs: bool = False
    top_logprobs: Optional[int] = None
    tools: Optional[list[Any]] = None
    response_format: Optional[dict[str, Any]] = None

    def sampling_params(self) -> SamplingParams:
        self._check_common()
        if self.tools:
            raise bad_request("tools are not supported", "tools", "unsupported_parameter")
        if self.response_format and self.response_format.get("type") != "text":
            raise bad_request("only response_format type 'text' is supported", "response_format",
                              "unsupported_parameter")
        if self.top_logprobs is not None and not self.logprobs:
            raise bad_request("top_logprobs requires logprobs=true", "top_logprobs")
        max_tokens = self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        return self._sampling_params(max_tokens, logprobs)

    def chat_messages(self) -> list[dict[str, Any]]:
        """Messages as plain dicts for the chat template; bad roles and non-text parts are 400s here,
        anything else the template refuses is a 400 from the replica."""
        if not self.messages:
            raise bad_request("messages must not be empty", "messages")
        out = []
        for i, m in enumerate(self.messages):
            if m.role not in CHAT_ROLES:
                raise bad_request(f"messages[{i}].role must be one of {', '.join(CHAT_ROLES)}; got {m.role!r}",
                                  f"messages[{i}].role", "invalid_role")
            if isinstance(m.content, list) and any(p.type != "text" or p.text is None for p in m.content):
                raise bad_request("only text content parts are supported", f"messages[{i}].content")
            msg = m.model_dump(exclude_none=True)
            if msg["role"] == "developer":   # OpenAI's newer name for the system role
                msg["role"] = "system"
            out.append(msg)
        return out


# ---- responses -------------------------------------------------------------------------

class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


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


class ChatDelta(BaseModel):
    role: Optional[str] = None
    content: Optional[str] = None


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


class ResponseBuilder:
    """Turns one request's frames into OpenAI stream chunks and/or the final response body.

    Choice `i` of prompt `j` is choice `j * n + i` of the response, as in the OpenAI API.
    """

    def __init__(self, kind: Literal["chat", "completion"], request_id: str, model: str, n: int,
                 num_prompts: int, logprobs: Optional[int], include_usage: bool):
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

    def start(self, prompt_index: int, start: "StreamStart") -> None:
        self.prompt_tokens += start.prompt_tokens

    def opening_chunks(self) -> list[dict]:
        if not self.chat:
            return []
        return [self._chunk(ChatChoice(index=i, delta=ChatDelta(role="assistant", content="")))
                for i in range(len(self.texts))]

    def add(self, prompt_index: int, deltas: list["ChoiceDelta"]) -> list[dict]:
        """Record one frame; returns its stream chunks (one per choice that moved)."""
        chunks = []
        for d in deltas:
            i = prompt_index * self.n + d.index
            piece = self._logprobs_piece(i, d)
            self.texts[i].append(d.text)
            self.text_len[i] += len(d.text)
            self.num_tokens[i] += len(d.token_ids)
            self.finish[i] = d.finish_reason or self.finish[i]
            if self.chat:
                choice = ChatChoice(index=i, delta=ChatDelta(content=d.text or None), logprobs=piece,
                                    finish_reason=d.finish_reason)
            else:
                choice = CompletionChoice(index=i, text=d.text, logprobs=piece, finish_reason=d.finish_reason)
            chunks.append(self._chunk(choice))
        return chunks

    def usage(self) -> Usage:
        completion = sum(self.num_tokens)
        return Usage(prompt_tokens=self.prompt_tokens, completion_tokens=completion,
                     total_tokens=self.prompt_tokens + completion)

    def usage_chunk(self) -> Optional[dict]:
        return self._chunk(None, usage=self.usage()) if self.include_usage else None

    def final(self) -> dict:
        if self.chat:
            choices = [ChatChoice(index=i, message=ChatDelta(role="assistant", content="".join(t)),
                                  logprobs=self.logprobs[i], finish_reason=self.finish[i])
                       for i, t in enumerate(self.texts)]
            body = ChatCompletionResponse(id=self.id, created=self.created, model=self.model, choices=choices,
                                          usage=self.usage())
        else:
            choices = [CompletionChoice(index=i, text="".join(t), logprobs=self.logprobs[i],
                                        finish_reason=self.finish[i]) for i, t in enumerate(self.texts)]
            body = CompletionResponse(id=self.id, created=self.created, model=self.model, choices=choices,
                                      usage=self.usage())
        return body.model_dump(exclude_none=True)

    def _chunk(self, choice, usage: Optional[Usage] = None) -> dict:
        cls = ChatCompletionResponse if self.chat else CompletionResponse
        extra = {"object": "chat.completion.chunk"} if self.chat else {}
        return cls(id=self.id, created=self.created, model=self.model, choices=[choice] if choice else [],
                   usage=usage, **extra).model_dump(exclude_none=True)

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


# ---- replica <-> ingress frames (plain dataclasses, pickled by Ray) -----------------------

@dataclass
class GenerationJob:
    """One prompt to generate from. Chat jobs carry messages; the replica applies the template."""
    request_id: str
    params: SamplingParams
    prompt: Union[str, list[int], None] = None
    messages: Optional[list[dict[str, str]]] = None


@dataclass
class StreamStart:
    """First frame of every successful generation stream."""
    replica_id: str
    prompt_tokens: int


@dataclass
class StreamFailure:
    """Sole frame of a stream the replica rejected (bad prompt, overload); maps to an OpenAIError."""
    status: int
    message: str
    param: Optional[str] = None
    code: Optional[str] = None


@dataclass
class ChoiceDelta:
    """What one choice gained in one engine step."""
    index: int
    text: str
    token_ids: list[int]
    logprobs: Optional[list[dict[int, Logprob]]]
    finish_reason: Optional[str]
