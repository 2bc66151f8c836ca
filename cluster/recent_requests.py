"""A replica's recently finished requests, as the fleet controller reads them: per request, when it arrived and
when it finished (wall time, seconds), its time to first token, its mean inter-token latency and its prompt
length."""
from __future__ import annotations

import threading
import time
from collections import deque
from typing import Iterable

from replicas.stats import RequestTimings

KEPT = 2048
COLUMNS = ("finished_at", "arrived_at", "ttft_s", "itl_s", "prompt_tokens")


class RecentRequests:
    """Bounded to the newest KEPT requests; fed by the replica's metrics pump, read by `describe`."""

    def __init__(self, kept: int = KEPT):
        self._rows: deque[tuple[float, float, float, float, int]] = deque(maxlen=kept)
        self._lock = threading.Lock()

    def add(self, timings: Iterable[RequestTimings]) -> None:
        """The engine's timings are on this host's monotonic clock (the engine core is a child process): they
        become wall times here."""
        wall = time.time() - time.monotonic()
        rows = []
        for t in timings:
            if t.finish_reason == "abort" or t.num_generation_tokens == 0:
                continue                # a client that went away says nothing about the replica's latency
            itl = (t.finish_time - t.first_token_time) / max(1, t.num_generation_tokens - 1)
            rows.append((wall + t.finish_time, wall + t.arrival_time, t.first_token_time - t.arrival_time, itl,
                         t.num_prompt_tokens))
        with self._lock:
            self._rows.extend(rows)

    def since(self, wall_time: float) -> dict[str, list]:
        """Columns of the requests that finished after `wall_time`: finished_at, arrived_at, ttft_s, itl_s,
        prompt_tokens."""
        with self._lock:
            rows = [r for r in self._rows if r[0] > wall_time]
        return {name: [r[k] for r in rows] for k, name in enumerate(COLUMNS)}
