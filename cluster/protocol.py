"""OpenAI request bodies (pydantic) and the replica <-> ingress frames (responses: cluster/responses.py).

Request models check shape and types only (strict, so "0.5" is not a number); ranges are
checked by `SamplingParams` and by `sampling_params()`, so a type error is a 422 and a bad value a 400.
Structured outputs (docs/structured_outputs.md): `response_format` and `logit_bias` on both endpoints, `tools`,
`tool_choice` and `parallel_tool_calls` on chat; a request's schemas are bounded by the engine's max_schema_bytes.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Optional, Union

from pydantic import BaseModel, ConfigDict, Field

from cluster.errors import bad_request
from cluster.json_schemas import check_schema
from cluster.tool_calls import ToolSupport, forced_calls
from replicas.outputs import Logprob
from replicas.sampling_params import MAX_LOGIT_BIAS, SamplingParams
from replicas.structured.spec import GrammarSpec

CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")
NAME = re.compile(r"[a-zA-Z0-9_-]{1,64}")      # function and json_schema names, as OpenAI checks them
MAX_TOOLS = 128
MAX_DESCRIPTION_CHARS = 8192
MAX_TOOL_CALLS = 128                            # in one assistant message of the conversation
MAX_TOOL_CALL_ID_CHARS = 256
TOOL_CHOICES = ("none", "auto", "required")


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class StreamOptions(_Strict):
    include_usage: bool = False


class JsonSchemaFormat(_Strict):
    model_config = ConfigDict(strict=True, extra="ignore", populate_by_name=True)
    name: str
    description: Optional[str] = None
    schema_: Optional[dict[str, Any]] = Field(default=None, alias="schema")
    strict: Optional[bool] = None


class ResponseFormat(_Strict):
    type: str
    json_schema: Optional[JsonSchemaFormat] = None


class FunctionDefinition(_Strict):
    name: str
    description: Optional[str] = None
    parameters: Optional[dict[str, Any]] = None
    strict: Optional[bool] = None


class ToolDefinition(_Strict):
    type: str
    function: FunctionDefinition


class FunctionName(_Strict):
    name: str


class NamedToolChoice(_Strict):
    type: str
    function: FunctionName


class FunctionCall(_Strict):
    name: str
    arguments: str


class MessageToolCall(_Strict):
    id: str
    type: str = "function"
    function: FunctionCall


@dataclass(frozen=True)
class ToolPlan:
    """What a chat request does with tools: those offered in the prompt (OpenAI tool objects), the grammar that
    forces calls (tool_choice required or a named function), and whether the output is parsed for calls."""
    offered: Optional[list[dict]] = None
    grammar: Optional[GrammarSpec] = None
    parse: bool = False


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
    response_format: Optional[ResponseFormat] = None
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
        if self.stream_options is not None and not self.stream:
            raise bad_request("stream_options is only allowed with stream=true", "stream_options")

    def _logit_bias(self) -> Optional[dict[int, float]]:
        """Token id strings as ints (the values are range-checked by SamplingParams, the ids by the engine)."""
        if not self.logit_bias:
            return None
        if len(self.logit_bias) > MAX_LOGIT_BIAS:
            raise bad_request(f"logit_bias has {len(self.logit_bias)} entries; at most {MAX_LOGIT_BIAS} are allowed",
                              "logit_bias", "invalid_value")
        out: dict[int, float] = {}
        for key, value in self.logit_bias.items():
            if not re.fullmatch(r"[0-9]{1,10}", key):
                raise bad_request(f"logit_bias keys must be token ids (non-negative integers), got {key[:32]!r}",
                                  "logit_bias", "invalid_value")
            if int(key) in out:
                raise bad_request(f"logit_bias names token {int(key)} twice", "logit_bias", "invalid_value")
            out[int(key)] = value
        return out

    def _response_grammar(self, max_schema_bytes: int) -> Optional[GrammarSpec]:
        rf = self.response_format
        if rf is None or rf.type == "text":
            return None
        if rf.type == "json_object":
            return GrammarSpec.json_object()
        if rf.type != "json_schema":
            raise bad_request(f"response_format type must be text, json_object or json_schema; got {rf.type[:32]!r}",
                              "response_format", "unsupported_parameter")
        js = rf.json_schema
        if js is None or js.schema_ is None:
            raise bad_request("response_format of type json_schema needs json_schema.schema", "response_format",
                              "invalid_value")
        if not NAME.fullmatch(js.name):
            raise bad_request("response_format json_schema.name must be 1 to 64 letters, digits, '_' or '-'",
                              "response_format", "invalid_value")
        check_schema(js.schema_, "response_format", max_schema_bytes)
        return GrammarSpec.json_schema(js.schema_)

    def _sampling_params(self, max_tokens: Optional[int], logprobs: Optional[int],
                         grammar: Optional[GrammarSpec]) -> SamplingParams:
        def pick(value, default):
            return default if value is None else value
        return SamplingParams(
            n=self.n, temperature=pick(self.temperature, 1.0), top_p=pick(self.top_p, 1.0),
            top_k=pick(self.top_k, -1), min_p=pick(self.min_p, 0.0), seed=self.seed,
            presence_penalty=pick(self.presence_penalty, 0.0), frequency_penalty=pick(self.frequency_penalty, 0.0),
            repetition_penalty=pick(self.repetition_penalty, 1.0), max_tokens=max_tokens,
            min_tokens=self.min_tokens, stop=pick(self.stop, ()), stop_token_ids=pick(self.stop_token_ids, ()),
            include_stop_str_in_output=self.include_stop_str_in_output, ignore_eos=self.ignore_eos,
            logprobs=logprobs, skip_special_tokens=self.skip_special_tokens, grammar=grammar,
            logit_bias=self._logit_bias(),
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

    def sampling_params(self, max_schema_bytes: int) -> SamplingParams:
        self._check_common()
        if self.echo:
            raise bad_request("echo is not supported", "echo", "unsupported_parameter")
        if self.suffix:
            raise bad_request("suffix is not supported", "suffix", "unsupported_parameter")
        if self.best_of is not None and self.best_of != self.n:
            raise bad_request("best_of different from n is not supported", "best_of", "unsupported_parameter")
        return self._sampling_params(self.max_tokens, self.logprobs, self._response_grammar(max_schema_bytes))


class ContentPart(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    type: str
    text: Optional[str] = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    role: str
    content: Union[str, list[ContentPart], None] = None
    name: Optional[str] = None
    tool_calls: Optional[list[MessageToolCall]] = None
    tool_call_id: Optional[str] = None


class ChatCompletionRequest(_SamplingRequest):
    messages: list[ChatMessage]
    max_tokens: Optional[int] = None
    max_completion_tokens: Optional[int] = None
    logprobs: bool = False
    top_logprobs: Optional[int] = None
    tools: Optional[list[ToolDefinition]] = None
    tool_choice: Union[str, NamedToolChoice, None] = None
    parallel_tool_calls: Optional[bool] = None

    def sampling_params(self, tools: ToolPlan, max_schema_bytes: int) -> SamplingParams:
        self._check_common()
        if self.top_logprobs is not None and not self.logprobs:
            raise bad_request("top_logprobs requires logprobs=true", "top_logprobs")
        grammar = self._response_grammar(max_schema_bytes)
        if grammar is not None and tools.parse:
            raise bad_request("response_format cannot be combined with tools unless tool_choice is 'none'",
                              "response_format", "invalid_value")
        max_tokens = self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        return self._sampling_params(max_tokens, logprobs, grammar or tools.grammar)

    def tool_plan(self, support: ToolSupport, max_schema_bytes: int) -> ToolPlan:
        """The tools checked (OpenAI's bounds and name format, each parameters schema) and what to do with them."""
        choice = self.tool_choice
        if isinstance(choice, str) and choice not in TOOL_CHOICES:
            raise bad_request(f"tool_choice must be one of {', '.join(TOOL_CHOICES)} or a function; got "
                              f"{choice[:32]!r}", "tool_choice", "invalid_value")
        if not self.tools:
            if choice is not None and choice != "none":
                raise bad_request("tool_choice needs tools", "tool_choice", "invalid_value")
            return ToolPlan()
        if len(self.tools) > MAX_TOOLS:
            raise bad_request(f"tools has {len(self.tools)} entries; at most {MAX_TOOLS} are allowed", "tools",
                              "invalid_value")
        definitions: dict[str, dict] = {}
        for i, tool in enumerate(self.tools):
            f = tool.function
            if tool.type != "function":
                raise bad_request("only tools of type 'function' are supported", f"tools[{i}].type",
                                  "invalid_value")
            if not NAME.fullmatch(f.name):
                raise bad_request("a function name must be 1 to 64 letters, digits, '_' or '-'",
                                  f"tools[{i}].function.name", "invalid_value")
            if f.name in definitions:
                raise bad_request(f"two tools are named {f.name!r}", f"tools[{i}].function.name", "invalid_value")
            if f.description is not None and len(f.description) > MAX_DESCRIPTION_CHARS:
                raise bad_request(f"a description may have at most {MAX_DESCRIPTION_CHARS} characters",
                                  f"tools[{i}].function.description", "invalid_value")
            parameters = f.parameters if f.parameters is not None else {"type": "object", "properties": {}}
            check_schema(parameters, f"tools[{i}].function.parameters", max_schema_bytes)
            definitions[f.name] = parameters
        named = None
        if isinstance(choice, NamedToolChoice):
            if choice.type != "function" or choice.function.name not in definitions:
                raise bad_request(f"tool_choice names the function {choice.function.name[:64]!r}, which is not "
                                  "among the tools", "tool_choice", "invalid_value")
            named = choice.function.name
        elif choice == "none":
            return ToolPlan()
        offered = [t.model_dump(exclude_none=True, by_alias=True) for t in self.tools]
        grammar = None
        if named is not None or choice == "required":
            grammar = forced_calls(list(definitions.items()), named, self.parallel_tool_calls is not False, support)
        return ToolPlan(offered, grammar, parse=True)

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
            self._check_tool_fields(i, m)
            msg = m.model_dump(exclude_none=True)
            if msg["role"] == "developer":   # OpenAI's newer name for the system role
                msg["role"] = "system"
            out.append(msg)
        return out

    @staticmethod
    def _check_tool_fields(i: int, m: ChatMessage) -> None:
        if m.role == "tool":
            if not m.tool_call_id or len(m.tool_call_id) > MAX_TOOL_CALL_ID_CHARS:
                raise bad_request(f"a tool message needs a tool_call_id of 1 to {MAX_TOOL_CALL_ID_CHARS} characters",
                                  f"messages[{i}].tool_call_id", "invalid_value")
            if m.content is None:
                raise bad_request("a tool message needs content (the tool's result)", f"messages[{i}].content",
                                  "invalid_value")
        if m.tool_calls is None:
            return
        if m.role != "assistant":
            raise bad_request("only assistant messages carry tool_calls", f"messages[{i}].tool_calls",
                              "invalid_value")
        if len(m.tool_calls) > MAX_TOOL_CALLS:
            raise bad_request(f"at most {MAX_TOOL_CALLS} tool calls per message", f"messages[{i}].tool_calls",
                              "invalid_value")
        for j, call in enumerate(m.tool_calls):
            if call.type != "function" or not NAME.fullmatch(call.function.name):
                raise bad_request("a tool call must be of type 'function' with a valid function name",
                                  f"messages[{i}].tool_calls[{j}]", "invalid_value")


# ---- replica <-> ingress frames (plain dataclasses, pickled by Ray) -----------------------

@dataclass
class GenerationJob:
    """One prompt to generate from. Chat jobs carry messages; the replica applies the template."""
    request_id: str
    params: SamplingParams
    prompt: Union[str, list[int], None] = None
    messages: Optional[list[dict[str, Any]]] = None
    tools: Optional[list[dict]] = None               # offered to the chat template with the messages


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
