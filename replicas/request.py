"""A request: its n sequences, their detokenizers, and turning them into `RequestOutput`s; the checks a request
passes at admission and the errors that end one."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Sequence as Seq

from replicas.outputs import CompletionOutput, RequestOutput
from replicas.sampling_params import SamplingParams, SamplingParamsError
from replicas.sequence import Sequence, SequenceStatus


class RequestError(ValueError):
    """A request the engine cannot take (empty or too-long prompt, a parameter past a limit, ...); maps to an
    HTTP 400."""

    def __init__(self, param: Optional[str], message: str, code: Optional[str] = None):
        super().__init__(message)
        self.param, self.code = param, code

    def __reduce__(self):                         # it crosses the engine core's pipe
        return RequestError, (self.param, str(self), self.code)


class EngineStepError(RuntimeError):
    """The engine dropped this request because the step running it failed (out of device memory, a failed elastic
    reclaim); the engine itself keeps serving, so the request may be retried."""


def check_params(params: SamplingParams, limits) -> None:
    """The sampling parameters in range and within the engine's limits (`EngineConfig.limits`)."""
    if not isinstance(params, SamplingParams):
        raise RequestError("params", f"expected SamplingParams, got {type(params).__name__}")
    try:
        params.validate()
    except SamplingParamsError as e:
        raise RequestError(e.param, str(e), "invalid_value") from None
    if len(params.stop_token_ids) > limits.max_stop_token_ids:
        raise RequestError("stop_token_ids", f"stop_token_ids has {len(params.stop_token_ids)} ids; this server "
                           f"takes at most {limits.max_stop_token_ids}", "invalid_value")
    if len(params.stop) > limits.max_stop_strings:
        raise RequestError("stop", f"stop has {len(params.stop)} strings; this server takes at most "
                           f"{limits.max_stop_strings}", "invalid_value")
    longest = max(map(len, params.stop), default=0)
    if longest > limits.max_stop_string_chars:
        raise RequestError("stop", f"a stop string has {longest} characters; this server takes at most "
                           f"{limits.max_stop_string_chars}", "invalid_value")
    grammar = params.grammar
    if grammar is not None and grammar.num_bytes > limits.max_schema_bytes:
        raise RequestError(grammar.param, f"the JSON schemas of this request take {grammar.num_bytes} bytes; this "
                           f"server takes at most {limits.max_schema_bytes}", "invalid_value")


def check_logit_bias(params: SamplingParams, vocab_size: int) -> None:
    """Every logit_bias key is a token id of the vocabulary."""
    if params.logit_bias and max(params.logit_bias) >= vocab_size:
        raise RequestError("logit_bias", f"logit_bias has token id {max(params.logit_bias)}; this model's token ids "
                           f"are below {vocab_size}", "invalid_value")


def check_prompt(ids: Seq[int], params: SamplingParams, max_model_len: int,
                 vocab_size: Optional[int] = None) -> None:
    """The prompt is not empty and, with max_tokens, fits the context (the engine sizes max_model_len so that
    one such sequence also fits its KV cache); its ids are in the vocabulary when `vocab_size` is given."""
    if not ids:
        raise RequestError("prompt", "the prompt is empty", "empty_prompt")
    room = max_model_len - len(ids)
    if room < 1:
        raise RequestError("prompt", f"the prompt has {len(ids)} tokens; this model's maximum context length "
                           f"is {max_model_len} tokens", "context_length_exceeded")
    if params.max_tokens is not None and params.max_tokens > room:
        raise RequestError("max_tokens", f"max_tokens={params.max_tokens} plus the prompt's {len(ids)} tokens "
                           f"exceeds the maximum context length of {max_model_len}", "context_length_exceeded")
    if vocab_size is not None and any((not isinstance(t, int)) or t < 0 or t >= vocab_size for t in ids):
        raise RequestError("prompt", "prompt token ids must be integers in [0, vocab_size)")


@dataclass
class Request:
    """Per step only what is new is copied out (O(new tokens)); the full text, token ids and logprobs
    are assembled once, on the output that finishes a sequence."""
    request_id: str
    prompt: Optional[str]
    prompt_token_ids: list[int]
    params: SamplingParams
    seqs: list[Sequence]
    detokenizers: list = field(default_factory=list)
    stream: bool = True                                      # emit intermediate outputs (else only finished)
    sent_tokens: list[int] = field(default_factory=list)     # per seq: output tokens already reported
    text_parts: list[list[str]] = field(default_factory=list)
    sent_parts: list[int] = field(default_factory=list)

    def __post_init__(self):
        self.sent_tokens = [0] * len(self.seqs)
        self.text_parts = [[] for _ in self.seqs]
        self.sent_parts = [0] * len(self.seqs)

    @property
    def finished(self) -> bool:
        for seq in self.seqs:                # asked several times per sequence per step: no generator
            if seq.status is not SequenceStatus.FINISHED:
                return False
        return True

    def make_output(self) -> RequestOutput:
        outs = []
        for i, seq in enumerate(self.seqs):
            start = seq.num_prompt_tokens + self.sent_tokens[i]
            delta_ids = seq.token_ids[start:]
            delta_text = "".join(self.text_parts[i][self.sent_parts[i]:])
            want_lp = self.params.logprobs is not None
            if seq.is_finished:
                text, ids = "".join(self.text_parts[i]), seq.output_token_ids
                lp = list(seq.logprobs) if want_lp else None
            else:
                text, ids = delta_text, delta_ids
                lp = seq.logprobs[self.sent_tokens[i]:] if want_lp else None
            outs.append(CompletionOutput(
                index=i, text=text, token_ids=ids, delta_text=delta_text, delta_token_ids=delta_ids,
                cumulative_logprob=seq.cumulative_logprob if want_lp else None, logprobs=lp,
                finish_reason=seq.finish_reason, stop_reason=seq.stop_reason))
            self.sent_tokens[i] = seq.num_output_tokens
            self.sent_parts[i] = len(self.text_parts[i])
        return RequestOutput(self.request_id, self.prompt, self.prompt_token_ids, outs, self.finished,
                             num_cached_tokens=self.seqs[0].num_cached_tokens)
