"""Serving metrics from per-request results: the summary table and the result JSON."""
from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Optional, Sequence

import numpy as np

from cluster.benchmark.load import RequestResult

MAX_ERRORS_KEPT = 100


@dataclass(frozen=True)
class Slo:
    """Service-level objectives, in ms, a request must all meet to count toward goodput."""
    ttft_ms: Optional[float] = None
    tpot_ms: Optional[float] = None
    e2el_ms: Optional[float] = None

    @classmethod
    def parse(cls, items: Sequence[str]) -> "Slo":
        """From ['ttft:200', 'tpot:50'] (keys ttft, tpot, e2el; values in ms)."""
        values = {}
        for item in items:
            key, sep, value = item.partition(":")
            key = key.strip().lower()
            if not sep or key not in ("ttft", "tpot", "e2el"):
                raise ValueError(f"bad --goodput item {item!r}: use ttft:MS, tpot:MS or e2el:MS")
            ms = float(value)
            if ms <= 0:
                raise ValueError(f"--goodput {key} must be > 0 ms, got {value}")
            values[f"{key}_ms"] = ms
        if not values:
            raise ValueError("--goodput needs at least one of ttft:MS, tpot:MS, e2el:MS")
        return cls(**values)

    def met(self, ttft_ms: float, tpot_ms: Optional[float], e2el_ms: float) -> bool:
        """TPOT is undefined for a one-token output; that request is judged on the other SLOs."""
        return ((self.ttft_ms is None or ttft_ms <= self.ttft_ms)
                and (self.tpot_ms is None or tpot_ms is None or tpot_ms <= self.tpot_ms)
                and (self.e2el_ms is None or e2el_ms <= self.e2el_ms))


def request_tpot(latency: float, ttft: float, output_tokens: int) -> Optional[float]:
    """Time per output token after the first: (E2EL - TTFT) / (output_tokens - 1); None below 2 tokens."""
    if output_tokens < 2:
        return None
    return (latency - ttft) / (output_tokens - 1)


@dataclass(frozen=True)
class Summary:
    mean: float
    median: float
    p90: float
    p99: float

    @classmethod
    def of_seconds(cls, values: Sequence[float]) -> "Summary":
        """Mean, median, p90 and p99 (linear interpolation) in ms; zeros when there is nothing to summarize."""
        if len(values) == 0:
            return cls(0.0, 0.0, 0.0, 0.0)
        ms = np.asarray(values, dtype=np.float64) * 1000.0
        p90, p99 = np.percentile(ms, (90, 99))
        return cls(float(ms.mean()), float(np.median(ms)), float(p90), float(p99))


@dataclass(frozen=True)
class BenchmarkMetrics:
    completed: int
    failed: int
    duration: float
    total_input_tokens: int
    total_output_tokens: int
    request_throughput: float
    output_throughput: float
    total_token_throughput: float
    ttft: Summary
    tpot: Summary                   # per request (E2EL - TTFT) / (tokens - 1)
    itl: Summary                    # the gaps between a stream's consecutive content chunks, all streams pooled
    e2el: Summary
    good_requests: Optional[int]    # None when no SLO was given
    goodput: Optional[float]        # good requests per second

    @property
    def goodput_fraction(self) -> Optional[float]:
        if self.good_requests is None:
            return None
        return self.good_requests / self.completed if self.completed else 0.0


def compute_metrics(results: Sequence[RequestResult], duration: float, slo: Optional[Slo] = None) -> BenchmarkMetrics:
    """Totals count successful requests only; ITL pools every gap of every successful stream."""
    ok = [r for r in results if r.success]
    tpots = [request_tpot(r.latency, r.ttft, r.output_tokens) for r in ok]
    input_tokens = sum(r.prompt_len for r in ok)
    output_tokens = sum(r.output_tokens for r in ok)
    good = None
    if slo is not None:
        good = sum(slo.met(r.ttft * 1e3, None if t is None else t * 1e3, r.latency * 1e3) for r, t in zip(ok, tpots))
    per_s = (lambda x: x / duration) if duration > 0 else (lambda x: 0.0)
    return BenchmarkMetrics(
        completed=len(ok), failed=len(results) - len(ok), duration=duration,
        total_input_tokens=input_tokens, total_output_tokens=output_tokens,
        request_throughput=per_s(len(ok)), output_throughput=per_s(output_tokens),
        total_token_throughput=per_s(input_tokens + output_tokens),
        ttft=Summary.of_seconds([r.ttft for r in ok]),
        tpot=Summary.of_seconds([t for t in tpots if t is not None]),
        itl=Summary.of_seconds([gap for r in ok for gap in r.itl]),
        e2el=Summary.of_seconds([r.latency for r in ok]),
        good_requests=good, goodput=None if good is None else per_s(good))


def format_table(m: BenchmarkMetrics, max_concurrency: Optional[int] = None,
                 request_rate: Optional[float] = None) -> str:
    width = 50
    lines = [" Serving Benchmark Result ".center(width, "=")]

    def row(label: str, value) -> None:
        text = f"{value:.2f}" if isinstance(value, float) else str(value)
        lines.append(f"{label:<40}{text:>10}")

    row("Successful requests:", m.completed)
    row("Failed requests:", m.failed)
    if max_concurrency:
        row("Maximum request concurrency:", max_concurrency)
    if request_rate is not None:
        row("Request rate configured (RPS):", request_rate)
    row("Benchmark duration (s):", m.duration)
    row("Total input tokens:", m.total_input_tokens)
    row("Total generated tokens:", m.total_output_tokens)
    row("Request throughput (req/s):", m.request_throughput)
    if m.goodput is not None:
        row("Request goodput (req/s):", m.goodput)
    row("Output token throughput (tok/s):", m.output_throughput)
    row("Total token throughput (tok/s):", m.total_token_throughput)
    for key, title in (("ttft", "Time to First Token"), ("tpot", "Time per Output Token (excl. 1st token)"),
                       ("itl", "Inter-token Latency (chunk gaps)"), ("e2el", "End-to-end Latency")):
        s: Summary = getattr(m, key)
        lines.append(f" {title} ".center(width, "-"))
        name = key.upper()
        row(f"Mean {name} (ms):", s.mean)
        row(f"Median {name} (ms):", s.median)
        if key == "itl":
            row(f"P90 {name} (ms):", s.p90)
        row(f"P99 {name} (ms):", s.p99)
    lines.append("=" * width)
    return "\n".join(lines)


def result_json(m: BenchmarkMetrics, settings: dict, results: Sequence[RequestResult], detailed: bool = False) -> dict:
    """The --save-result document: flat metrics, the run's settings, errors (capped) and optional per-request data."""
    out = {"completed": m.completed, "failed": m.failed, "duration": m.duration,
           "total_input_tokens": m.total_input_tokens, "total_output_tokens": m.total_output_tokens,
           "request_throughput": m.request_throughput, "output_throughput": m.output_throughput,
           "total_token_throughput": m.total_token_throughput}
    for key in ("ttft", "tpot", "itl", "e2el"):
        for stat, value in asdict(getattr(m, key)).items():
            out[f"{stat}_{key}_ms"] = value
    if m.goodput is not None:
        out.update(goodput=m.goodput, good_requests=m.good_requests, goodput_fraction=m.goodput_fraction)
    out.update(settings)
    errors = [r.error for r in results if not r.success]
    out["errors"] = errors[:MAX_ERRORS_KEPT]
    out["num_errors_not_kept"] = max(len(errors) - MAX_ERRORS_KEPT, 0)
    if detailed:
        out["input_lens"] = [r.prompt_len for r in results]
        out["output_lens"] = [r.output_tokens for r in results]
        out["ttfts"] = [r.ttft for r in results]
        out["e2els"] = [r.latency for r in results]
        out["itls"] = [r.itl for r in results]
    return out
