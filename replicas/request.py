"""A request: its n sequences, their detokenizers, and turning them into `RequestOutput`s."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from replicas.outputs import CompletionOutput, RequestOutput
from replicas.sampling_params import SamplingParams
from replicas.sequence import Sequence


class RequestError(ValueError):
    """A request the engine cannot take (empty or too-long prompt, ...); maps to an HTTP 400."""

    def __init__(self, param: Optional[str], message: str, code: Optional[str] = None):
        super().__init__(message)
        self.param, self.code = param, code

    def __reduce__(self):                         # it crosses the engine core's pipe
        return RequestError, (self.param, str(self), self.code)


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
        return all(s.is_finished for s in self.seqs)

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
