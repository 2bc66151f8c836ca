"""Serving benchmarks against any OpenAI-compatible server: `tidal bench serve` and `tidal bench sweep`.

datasets  prompts (ShareGPT, random tokens) and their token lengths
load      arrival times and the streaming client that times each SSE chunk
report    metrics (TTFT, TPOT, ITL, E2EL, goodput), the summary table, the result JSON
sweep     one run per request rate, the highest rate meeting the SLO, plots
cli       argparse wiring: add_bench_parser(subparsers), run_bench(args); also runnable as
          `python -m cluster.benchmark.cli bench serve ...`
"""
