"""Request-rate sweep: one serving benchmark per rate, the highest rate meeting the SLO, and plots."""
from __future__ import annotations

import asyncio
import dataclasses
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

import numpy as np

from cluster.benchmark.datasets import BenchRequest
from cluster.benchmark.load import ApiTarget, LoadSettings, RequestResult, run_load
from cluster.benchmark.report import BenchmarkMetrics, Slo, compute_metrics, format_table, result_json


def parse_rates(text: str) -> list[float]:
    """'1,2,4,inf' -> [1.0, 2.0, 4.0, inf], ascending."""
    rates = sorted(float(part) for part in text.split(",") if part.strip())
    if not rates or any(r <= 0 for r in rates):
        raise ValueError(f"--rates needs positive numbers or inf, got {text!r}")
    return rates


def rate_label(rate: float) -> str:
    return "inf" if math.isinf(rate) else f"{rate:g}"


@dataclass
class RatePoint:
    rate: float
    metrics: BenchmarkMetrics
    results: list[RequestResult]


def best_rate(points: Sequence[RatePoint], slo_fraction: float) -> Optional[float]:
    """The highest offered rate whose share of completed requests meeting the SLO is >= slo_fraction."""
    passing = [p.rate for p in points if p.metrics.completed and (p.metrics.goodput_fraction or 0.0) >= slo_fraction]
    return max(passing) if passing else None


def run_sweep(target: ApiTarget, requests: Sequence[BenchRequest], base: LoadSettings, prompt_lens_exact: bool,
              rates: Sequence[float], slo: Slo, slo_fraction: float, output_dir: Path, settings: dict) -> dict:
    """Runs every rate in turn on the same prompts, writes sweep.json and the plots, returns the sweep document."""
    output_dir.mkdir(parents=True, exist_ok=True)
    points = []
    for rate in rates:
        print(f"\n--- request rate {rate_label(rate)} req/s ---", flush=True)
        at_rate = dataclasses.replace(base, request_rate=rate)
        outcome = asyncio.run(run_load(target, requests, at_rate, prompt_lens_exact))
        metrics = compute_metrics(outcome.results, outcome.duration, slo)
        print(format_table(metrics, base.max_concurrency, rate))
        points.append(RatePoint(rate, metrics, outcome.results))
    best = best_rate(points, slo_fraction)
    doc = {**settings, "slo": dataclasses.asdict(slo), "slo_fraction": slo_fraction,
           "max_rate_meeting_slo": None if best is None else rate_label(best),
           "rates": [result_json(p.metrics, {"request_rate": rate_label(p.rate)}, p.results) for p in points]}
    (output_dir / "sweep.json").write_text(json.dumps(doc, indent=2))
    plot_sweep(points, output_dir)
    verdict = "none" if best is None else f"{rate_label(best)} req/s"
    print(f"\nHighest rate with >= {slo_fraction:.0%} of requests meeting the SLO: {verdict}")
    print(f"Wrote {output_dir / 'sweep.json'} and plots to {output_dir}")
    return doc


def plot_sweep(points: Sequence[RatePoint], output_dir: Path) -> list[Path]:
    """ttft_cdf.png, itl_cdf.png (one curve per rate), throughput_vs_rate.png, latency_vs_rate.png."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []

    def save(fig, name: str) -> None:
        fig.tight_layout()
        fig.savefig(output_dir / name, dpi=120)
        plt.close(fig)
        written.append(output_dir / name)

    for name, title, values_of in (
            ("ttft_cdf.png", "Time to first token", lambda rs: [r.ttft for r in rs if r.success]),
            ("itl_cdf.png", "Inter-token latency", lambda rs: [g for r in rs if r.success for g in r.itl])):
        fig, ax = plt.subplots(figsize=(6, 4))
        for p in points:
            ms = np.sort(np.asarray(values_of(p.results), dtype=np.float64) * 1e3)
            if len(ms):
                ax.plot(ms, np.arange(1, len(ms) + 1) / len(ms), label=f"{rate_label(p.rate)} req/s")
        ax.set(xlabel="ms", ylabel="fraction of samples", title=f"{title} CDF")
        ax.grid(alpha=0.3)
        ax.legend()
        save(fig, name)

    # An infinite rate is drawn one step past the largest finite rate.
    finite = [p.rate for p in points if not math.isinf(p.rate)]
    inf_x = (max(finite) * 2 if finite else 1.0)
    xs = [inf_x if math.isinf(p.rate) else p.rate for p in points]
    labels = [rate_label(p.rate) for p in points]

    fig, (req_ax, tok_ax) = plt.subplots(1, 2, figsize=(10, 4))
    req_ax.plot(xs, [p.metrics.request_throughput for p in points], "o-", label="throughput")
    req_ax.plot(xs, [p.metrics.goodput or 0.0 for p in points], "s--", label="goodput")
    req_ax.set(ylabel="req/s", title="Request throughput")
    tok_ax.plot(xs, [p.metrics.output_throughput for p in points], "o-")
    tok_ax.set(ylabel="tok/s", title="Output token throughput")
    for ax in (req_ax, tok_ax):
        ax.set_xticks(xs, labels)
        ax.set_xlabel("offered rate (req/s)")
        ax.grid(alpha=0.3)
    req_ax.legend()
    save(fig, "throughput_vs_rate.png")

    fig, axes = plt.subplots(1, 3, figsize=(14, 4))
    for ax, key, title in zip(axes, ("ttft", "tpot", "itl"), ("TTFT", "TPOT", "ITL")):
        ax.plot(xs, [getattr(p.metrics, key).median for p in points], "o-", label="p50")
        ax.plot(xs, [getattr(p.metrics, key).p99 for p in points], "s--", label="p99")
        ax.set(xlabel="offered rate (req/s)", ylabel="ms", title=title)
        ax.set_xticks(xs, labels)
        ax.grid(alpha=0.3)
        ax.legend()
    save(fig, "latency_vs_rate.png")
    return written
