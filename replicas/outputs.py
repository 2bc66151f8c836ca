"""What the engine hands back per request."""
from __future__ import annotations

from dataclasses import dataclass, field, fields
from operator import attrgetter
from typing import Optional


def positional_pickling(cls):
    """Pickle instances as the constructor call with their fields in order: faster to load and smaller than the
    default state dict. Every step's outputs cross the engine core's pipe, and the serving process's
    reader thread loads them while it shares a GIL with the HTTP side."""
    fields_of = attrgetter(*(f.name for f in fields(cls)))
    cls.__reduce__ = lambda self: (cls, fields_of(self))
    return cls


@positional_pickling
@dataclass
class Logprob:
    logprob: float
    rank: int                 # 1 = most likely
    decoded_token: str = ""


@positional_pickling
@dataclass
class CompletionOutput:
    """On the output that finishes a sequence, `text`, `token_ids` and `logprobs` are the whole output;
    on intermediate (streaming) outputs they hold only what is new, like the `delta_` fields."""
    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    delta_text: str = ""                            # text new since the previous output of this stream
    delta_token_ids: list[int] = field(default_factory=list)
    cumulative_logprob: Optional[float] = None
    logprobs: Optional[list[dict[int, Logprob]]] = None   # per generated token: id -> Logprob (sampled + top-k)
    finish_reason: Optional[str] = None             # "stop" | "length" | "abort"
    stop_reason: Optional[object] = None            # matched stop string or stop token id

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@positional_pickling
@dataclass
class RequestOutput:
    request_id: str
    prompt: Optional[str]
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = False
    num_cached_tokens: int = 0
