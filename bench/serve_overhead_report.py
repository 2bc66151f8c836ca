"""Printing for bench.serve_overhead: a line per measured path as it finishes, and the final table."""
from __future__ import annotations

TTFT_TARGET_MS = 5.0
THROUGHPUT_TARGET = 0.90


def progress(name: str, result: dict) -> None:
    """One line per measured path as it finishes (a run cut short still shows what it measured)."""
    idle, loaded = result["idle"], result["loaded"]
    engine = loaded["engine"]
    print(f"{name}: idle TTFT median {idle['ttft_ms']['median']:.2f} ms; loaded {loaded['output_tok_s']:.0f} tok/s, "
          f"TTFT median {loaded['ttft_ms']['median']:.2f} ms; engine {engine['mean_tokens_per_step']:.1f} tokens "
          f"per step, {engine['step_ms']:.2f} ms per step, {engine['prefill_steps']} of {engine['steps']} steps with a "
          f"prefill; client CPU {loaded['process_cpu_s']:.1f} s of "
          f"{loaded['seconds']:.1f}", flush=True)


def report(res: dict) -> None:
    print(f"\nserve overhead on {res['device']} ({res['model']}, {res['input_len']} prompt + "
          f"{res['max_tokens']} output tokens per request)")
    print(f"{'path':<8}{'streams':>8}{'requests':>10}{'out tok':>9}{'tok/s':>10}{'TTFT med':>10}{'mean':>9}{'p99':>9}")
    for level in ("idle", "loaded"):
        for path in ("direct", "serve"):
            r = res[path][level]
            t = r["ttft_ms"]
            print(f"{path:<8}{r['concurrency']:>8}{r['num_requests']:>10}{r['output_tokens']:>9}"
                  f"{r['output_tok_s']:>10.1f}{t['median']:>10.2f}{t['mean']:>9.2f}{t['p99']:>9.2f}")
    c = res["concurrency"]
    paths = [(f"front door ({res['front_door']})", res)]
    if "replica_direct_ingress" in res:
        r = res["replica_direct_ingress"]
        paths.append(("replica port", r))
        for level in ("idle", "loaded"):
            s, t = r["serve"][level], r["serve"][level]["ttft_ms"]
            print(f"{'replica':<8}{s['concurrency']:>8}{s['num_requests']:>10}{s['output_tokens']:>9}"
                  f"{s['output_tok_s']:>10.1f}{t['median']:>10.2f}{t['mean']:>9.2f}{t['p99']:>9.2f}")
    for name, r in paths:
        if len(r["each_repeat"]) > 1:
            print(f"{name}, each run: " + "; ".join(f"{e['added_median_ttft_ms_c1']:+.2f} ms, {e['throughput_ratio_64']:.3f}"
                                                   for e in r["each_repeat"]) + " (medians below)")
        print(f"{name}: added median TTFT {r['added_median_ttft_ms_c1']:.2f} ms at 1 stream (target <= "
              f"{TTFT_TARGET_MS:g}), {r['added_median_ttft_ms_c64']:.2f} ms at {c}; Serve/direct throughput at {c} "
              f"streams {r['throughput_ratio_64']:.3f} (target >= {THROUGHPUT_TARGET:.2f})")
    client = res["serve"]["loaded"]
    if client["process_cpu_s"] > 0.8 * client["seconds"]:
        print(f"warning: the HTTP client was busy {client['process_cpu_s'] / client['seconds']:.0%} of the loaded "
              "Serve run; the Serve figure may be the client's limit")
