"""Which requests report an output this step: per-request coalescing before anything is built or pickled, an
overload valve on the rate of stream items.

Every output is one object per stream per engine step for the engine core to build and pickle and for the serving
process to load, turn into an SSE chunk and write, on the GIL its HTTP side needs. With an item budget set
(`EngineConfig.serving.stream_item_ms`; a Serve replica sets it), each of n streaming requests that the step
touched reports only once (n - 1) x the budget has passed since its last report, so the engine sends at most
about one item per budget however many streams run. Below that rate (n x steps per second < 1 / budget) it
changes nothing: every stream reports every step; a lone stream always does. A request that does not report
simply keeps its new tokens and text: `Request.make_output` copies out everything since the previous
output, so merging costs nothing. A request's first output (its first token: TTFT) and its last one go out
at once, so coalescing never delays a request's start or end (tests/replicas/test_stream_batches.py).
"""
from __future__ import annotations

from typing import Protocol


class Reporting(Protocol):
    request_id: str
    stream: bool

    @property
    def finished(self) -> bool: ...


class StreamCoalescer:
    def __init__(self, item_seconds: float = 0.0):
        self.item_seconds = item_seconds
        self.last_sent: dict[str, float] = {}
        self.held: dict[str, Reporting] = {}        # touched since their last report, not yet reported

    def due(self, touched: dict[str, Reporting], now: float, streams: int) -> list[Reporting]:
        """The requests this step touched, plus any held ones, that report now (in touched order), with
        `streams` requests in the engine."""
        interval, last_sent, held = (streams - 1) * self.item_seconds, self.last_sent, self.held
        if interval <= 0 and not last_sent:          # nothing held or timed: every streaming request reports
            return [r for r in touched.values() if r.stream or r.finished]
        report = []
        for rid, req in touched.items():
            last = last_sent.get(rid)
            if req.finished:
                report.append(req)
                last_sent.pop(rid, None)
                held.pop(rid, None)
            elif not req.stream:
                continue
            elif last is None or now - last >= interval:
                report.append(req)
                last_sent[rid] = now
                held.pop(rid, None)
            else:
                held[rid] = req
        if held:
            for rid in [r for r in held if r not in touched and now - last_sent[r] >= interval]:
                report.append(held.pop(rid))          # a request that produced nothing this step
                last_sent[rid] = now
        return report

    @property
    def num_tracked(self) -> int:
        return len(self.held) + len(self.last_sent)

    def forget(self, request_id: str) -> None:
        self.held.pop(request_id, None)
        self.last_sent.pop(request_id, None)
