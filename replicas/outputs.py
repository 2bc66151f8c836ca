"""What the engine hands back per request.

msgspec Structs: every step's outputs cross the engine core's pipe as msgpack (replicas/engine_messages.py), and
the serving process's reader thread loads them while it shares a GIL with the HTTP side. Fields hold plain Python
values only (int, float, str, lists and dicts of them): the pipe's decoder checks every field's type.
"""
from __future__ import annotations

from typing import Optional, Union

import msgspec


class Logprob(msgspec.Struct, array_like=True, gc=False):
    logprob: float
    rank: int                 # 1 = most likely
    decoded_token: str = ""


class CompletionOutput(msgspec.Struct, array_like=True, gc=False):
    """On the output that finishes a sequence, `text`, `token_ids` and `logprobs` are the whole output;
    on intermediate (streaming) outputs they hold only what is new, like the `delta_` fields."""
    index: int
    text: str = ""
    token_ids: list[int] = []
    delta_text: str = ""                            # text new since the previous output of this stream
    delta_token_ids: list[int] = []
    cumulative_logprob: Optional[float] = None
    logprobs: Optional[list[dict[int, Logprob]]] = None   # per generated token: id -> Logprob (sampled + top-k)
    finish_reason: Optional[str] = None             # "stop" | "length" | "abort"
    stop_reason: Union[str, int, None] = None       # matched stop string or stop token id

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class RequestOutput(msgspec.Struct, array_like=True, gc=False):
    request_id: str
    prompt: Optional[str]
    prompt_token_ids: Optional[list[int]]           # None on the engine core's pipe (the client keeps them)
    outputs: list[CompletionOutput]
    finished: bool = False
    num_cached_tokens: int = 0
