"""Per-request coalescing of step outputs in the engine core, before they cross the pipe.

A server streaming to many clients cannot use an output per request per step: at 64 streams the engine
steps ~300 times a second, ~19,000 outputs a second for the serving process to load and fan out, on the
GIL its HTTP side needs. With an interval set (`("interval", seconds)` from the serving process, which
knows how many streams it serves), a request's outputs are merged until `interval` has passed since its last
one was sent. A request's first output (its first token: TTFT) and its last one go out at once, so coalescing
never delays a request's start or end; the merged output carries exactly the deltas of the outputs it
replaces (tests/test_stream_batches.py).
"""
from __future__ import annotations

import time
from typing import Callable, Optional

from replicas.outputs import CompletionOutput, RequestOutput


def _join(a: Optional[list], b: Optional[list]) -> Optional[list]:
    if a is None or b is None:
        return a if b is None else b
    return a + b


def merge_completion(prev: CompletionOutput, new: CompletionOutput) -> CompletionOutput:
    """One output for two consecutive ones of the same choice. A finishing output already holds the whole
    text, ids and logprobs; intermediate ones hold only what is new."""
    whole = new.finished
    return CompletionOutput(
        index=new.index,
        text=new.text if whole else prev.text + new.text,
        token_ids=new.token_ids if whole else prev.token_ids + new.token_ids,
        delta_text=prev.delta_text + new.delta_text,
        delta_token_ids=prev.delta_token_ids + new.delta_token_ids,
        cumulative_logprob=new.cumulative_logprob,
        logprobs=new.logprobs if whole else _join(prev.logprobs, new.logprobs),
        finish_reason=new.finish_reason,
        stop_reason=new.stop_reason,
    )


def merge_request(prev: RequestOutput, new: RequestOutput) -> RequestOutput:
    choices = {o.index: o for o in prev.outputs}
    for o in new.outputs:
        old = choices.get(o.index)
        choices[o.index] = o if old is None else merge_completion(old, o)
    prompt_ids = prev.prompt_token_ids if prev.prompt_token_ids is not None else new.prompt_token_ids
    return RequestOutput(new.request_id, prev.prompt if prev.prompt is not None else new.prompt, prompt_ids,
                         [choices[i] for i in sorted(choices)], new.finished, new.num_cached_tokens)


class StreamCoalescer:
    def __init__(self, clock: Callable[[], float] = time.monotonic):
        self.interval = 0.0
        self.clock = clock
        self.held: dict[str, RequestOutput] = {}
        self.last_sent: dict[str, float] = {}

    def set_interval(self, seconds: float) -> None:
        self.interval = seconds

    def take(self, outputs: list[RequestOutput]) -> list[RequestOutput]:
        """This step's outputs -> the ones to send now (merged with what each request held back)."""
        now = self.clock()
        send = []
        for out in outputs:
            rid = out.request_id
            prev = self.held.pop(rid, None)
            if prev is not None:
                out = merge_request(prev, out)
            last = self.last_sent.get(rid)
            if out.finished or last is None or now - last >= self.interval:
                send.append(out)
                if out.finished:
                    self.last_sent.pop(rid, None)
                else:
                    self.last_sent[rid] = now
            else:
                self.held[rid] = out
        for rid in [r for r, out in self.held.items() if now - self.last_sent[r] >= self.interval]:
            send.append(self.held.pop(rid))             # a request that produced nothing this step
            self.last_sent[rid] = now
        return send

    def forget(self, request_id: str) -> None:
        self.held.pop(request_id, None)
        self.last_sent.pop(request_id, None)
