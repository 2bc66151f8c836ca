"""OpenAI request bodies (pydantic) and the replica <-> ingress frames (responses: cluster/responses.py).

Request models check shape and types only (strict, so "0.5" is not a number); ranges are
checked by `SamplingParams` and by `sampling_params()`, so a type error is a 422 and a bad value a 400.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional, Union

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
    """First frame of every successful generation stream; it carries the first tokens (one message, not two)."""
    replica_id: str
    prompt_tokens: int
    deltas: list["ChoiceDelta"] = field(default_factory=list)


@dataclass
class StreamFailure:
    """Sole frame of a stream the replica rejected (bad prompt, overload); maps to an OpenAIError."""
    status: int
    message: str
    param: Optional[str] = None
    code: Optional[str] = None
    retry_after_s: Optional[int] = None       # an overload's Retry-After


@dataclass
class ChoiceDelta:
    """What one choice gained in one engine step."""
    index: int
    text: str
    token_ids: list[int]
    logprobs: Optional[list[dict[int, Logprob]]]
    finish_reason: Optional[str]
