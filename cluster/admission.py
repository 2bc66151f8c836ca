"""Admission of generation requests into one replica: by the tokens the engine will have to hold, with a request
count only as a safety bound.

A request is charged its prompt tokens plus what it may generate (`n` x `max_tokens`, or what the context leaves
when `max_tokens` is unset) from the moment it reaches the engine until its stream ends, however it ends (finish,
abort, client disconnect, engine failure, timeout). A new request is refused when the charge of all requests in
the replica would pass `token_limit` (a 503 `overloaded` with a Retry-After), or when `request_limit` requests
are already in the replica. A request that alone exceeds the token limit is admitted into an empty replica (it
would otherwise never run); the engine still refuses one that does not fit its context.

Both checks count in the same synchronous call as they check (no await between), so concurrent requests on the
event loop never overshoot a limit. The request count is taken when the stream starts (`enter`), the tokens once
the prompt is tokenized (`Ticket.charge`, called by the engine right before the request goes to the core).
"""
from __future__ import annotations

import math
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Optional

from replicas.sampling_params import SamplingParams

KV_MULTIPLE = 4                 # default token limit: this many times the tokens the KV cache holds
MAX_QUEUED_REQUESTS = 4096      # default request-count bound beyond max_ongoing_requests (AppArgs, tidal serve)
RETRY_WINDOW_S = 10.0           # Retry-After is estimated from the charge released over this window
MIN_RETRY_AFTER_S = 1
MAX_RETRY_AFTER_S = 60
REASONS = ("tokens", "requests")


def request_tokens(prompt_tokens: int, params: SamplingParams, max_model_len: int) -> int:
    """What a request is charged: its prompt, and the most every one of its `n` samples may generate."""
    room = max(0, max_model_len - prompt_tokens)
    most = room if params.max_tokens is None else min(params.max_tokens, room)
    return prompt_tokens + params.n * most


class Refused(Exception):
    """The replica is full; `retry_after_s` is when a retry is likely to be admitted."""

    def __init__(self, reason: str, message: str, retry_after_s: int):
        super().__init__(message)
        self.reason = reason
        self.retry_after_s = retry_after_s


@dataclass(frozen=True)
class AdmissionSnapshot:
    requests: int                                   # in the replica: admitted and not finished
    tokens: int                                     # their charge
    token_limit: int
    request_limit: int
    refused: dict[str, int] = field(default_factory=dict)     # refusals since start, by reason (monotonic)


class Admission:
    def __init__(self, token_limit: int, request_limit: int, clock: Callable[[], float] = time.monotonic):
        if token_limit < 1 or request_limit < 1:
            raise ValueError(f"admission limits must be >= 1 (tokens {token_limit}, requests {request_limit})")
        self.token_limit = token_limit
        self.request_limit = request_limit
        self.clock = clock
        self.requests = 0
        self.tokens = 0
        self.refused = {reason: 0 for reason in REASONS}
        self._released: deque[tuple[float, int]] = deque()       # (when, tokens) of charged streams ended lately
        self._released_tokens = 0                                   # their sum

    def enter(self) -> "Ticket":
        """A place for one request, or Refused("requests") when `request_limit` are in the replica."""
        if self.requests >= self.request_limit:
            self.refused["requests"] += 1
            raise Refused("requests", f"The server is overloaded ({self.requests} requests in flight on this "
                          "replica); retry later.", self._retry_after(1, len(self._window())))
        self.requests += 1
        return Ticket(self)

    def snapshot(self) -> AdmissionSnapshot:
        return AdmissionSnapshot(self.requests, self.tokens, self.token_limit, self.request_limit,
                                 dict(self.refused))

    def _charge(self, tokens: int) -> None:
        if self.tokens and self.tokens + tokens > self.token_limit:
            self.refused["tokens"] += 1
            self._window()
            raise Refused("tokens", f"The server is overloaded (the requests in flight on this replica hold "
                          f"{self.tokens} of its {self.token_limit} prompt and output tokens; this one needs "
                          f"{tokens}); retry later.",
                          self._retry_after(self.tokens + tokens - self.token_limit, self._released_tokens))
        self.tokens += tokens

    def _release(self, tokens: int) -> None:
        self.requests -= 1
        self.tokens -= tokens
        if tokens:                                  # a request that reached the engine (not one refused or failed)
            self._released.append((self.clock(), tokens))
            self._released_tokens += tokens
        self._window()

    def _window(self) -> deque[tuple[float, int]]:
        """The releases of the last RETRY_WINDOW_S seconds (older ones dropped)."""
        horizon = self.clock() - RETRY_WINDOW_S
        while self._released and self._released[0][0] < horizon:
            self._released_tokens -= self._released.popleft()[1]
        return self._released

    @staticmethod
    def _retry_after(excess: int, released_in_window: int) -> int:
        """Seconds until the replica, releasing at its rate of the last window, has released `excess`; nothing
        released in the window: the window itself."""
        if released_in_window <= 0:
            return int(RETRY_WINDOW_S)
        seconds = math.ceil(excess * RETRY_WINDOW_S / released_in_window)
        return max(MIN_RETRY_AFTER_S, min(MAX_RETRY_AFTER_S, seconds))


class Ticket:
    """One admitted request's place; `release()` ends it (idempotent)."""

    __slots__ = ("admission", "tokens", "released")

    def __init__(self, admission: Admission):
        self.admission = admission
        self.tokens = 0
        self.released = False

    def charge(self, tokens: int) -> None:
        """Charge the request's tokens, or Refused("tokens") (the ticket stays to be released)."""
        assert not self.released and not self.tokens, "a ticket is charged once, before it is released"
        self.admission._charge(tokens)
        self.tokens = tokens

    def release(self) -> None:
        if not self.released:
            self.released = True
            self.admission._release(self.tokens)


def admission_for(token_limit: Optional[int], kv_tokens: int, request_limit: int, share: int = 1) -> Admission:
    """One serving process's admission: `token_limit`, or KV_MULTIPLE x the tokens its KV cache holds, and
    `request_limit`, each divided among the `share` processes that admit into the same engine (ingress replicas)."""
    tokens = token_limit if token_limit is not None else KV_MULTIPLE * kv_tokens
    return Admission(max(1, tokens // share), max(1, request_limit // share))
