"""A request: its n sequences, their detokenizers, and turning them into `RequestOutput`s."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from replicas.outputs import CompletionOutput, Logprob, RequestOutput
from replicas.sampling_params import SamplingParams
from replicas.sequence import Sequence


class RequestError(ValueError):
    """A request the engine cannot take (empty or too-long prompt, ...); maps to an HTTP 400."""

    def __init__(self, param: Optional[str], message: str, code: Optional[str] = None):
        super().__init__(message)
        self.param, self.code = param, code


@dataclass
class Request:
    request_id: str
    prompt: Optional[str]
    prompt_token_ids: list[int]
    params: SamplingParams
    seqs: list[Sequence]
    detokenizers: list = field(default_factory=list)
    sent_tokens: list[int] = field(default_factory=list)     # per seq: tokens already reported
    sent_text: list[int] = field(default_factory=list)       # per seq: chars already reported
    texts: list[str] = field(default_factory=list)           # per seq: detokenized output so far

    def __post_init__(self):
        self.sent_tokens = [0] * len(self.seqs)
        self.sent_text = [0] * len(self.seqs)
        self.texts = [""] * len(self.seqs)

    @property
    def finished(self) -> bool:
        return all(s.is_finished for s in self.seqs)

    def make_output(self, tokenizer) -> RequestOutput:
        outs = []
        for i, seq in enumerate(self.seqs):
            tokens = seq.output_token_ids
            text = self.texts[i]
            lp = None
            if self.params.logprobs is not None:
                lp = [{tid: Logprob(v, r, tokenizer.decode([tid], skip_special_tokens=False))
                       for tid, (v, r) in entry.items()} for entry in seq.logprobs]
            outs.append(CompletionOutput(
                index=i, text=text, token_ids=list(tokens),
                delta_text=text[self.sent_text[i]:], delta_token_ids=tokens[self.sent_tokens[i]:],
                cumulative_logprob=seq.cumulative_logprob if self.params.logprobs is not None else None,
                logprobs=lp, finish_reason=seq.finish_reason, stop_reason=seq.stop_reason))
            self.sent_text[i], self.sent_tokens[i] = len(text), len(tokens)
        return RequestOutput(self.request_id, self.prompt, self.prompt_token_ids, outs, self.finished,
                             num_cached_tokens=self.seqs[0].num_cached_tokens)
