"""Printing for bench.serve_overhead: a line per measured path as it finishes, and the final table."""
from __future__ import annotations

TTFT_TARGET_MS = 5.0
THROUGHPUT_TARGET = 0.90
TPOT_TARGET_MS = 1.3          # --streaming: mean TPOT at one stream
ITL_P99_TARGET_MS = 50.0      # --streaming: p99 chunk gap at 256 streams
ITL_OVER_TPOT_TARGET = 3.0    # --streaming: median chunk gap over mean TPOT at 256 streams (how bursty a stream is)


def progress(name: str, result: dict) -> None:
    """One line per measured path as it finishes (a run cut short still shows what it measured)."""
    idle, loaded = result["idle"], result["loaded"]
    engine = loaded["engine"]
    failed = idle["failed"] + loaded["failed"]
    print(f"{name}: idle TTFT median {idle['ttft_ms']['median']:.2f} ms, TPOT mean {idle['tpot_ms']['mean']:.2f} ms; "
          f"loaded {loaded['output_tok_s']:.0f} tok/s, TTFT median {loaded['ttft_ms']['median']:.2f} ms (after the "
          f"opening wave {loaded.get('ttft_ms_after_opening_wave', {}).get('median', 0):.2f}), TPOT mean "
          f"{loaded['tpot_ms']['mean']:.2f} ms, ITL median {loaded['itl_ms']['median']:.2f} / p99 "
          f"{loaded['itl_ms']['p99']:.2f} ms{f'; {failed} FAILED' if failed else ''}; engine "
          f"{engine['mean_tokens_per_step']:.1f} tokens "
          f"per step, {engine['step_ms']:.2f} ms per step, {engine['prefill_steps']} of {engine['steps']} steps with a "
          f"prefill, {engine.get('mean_running') or 0:.0f} running / {engine.get('mean_waiting') or 0:.0f} "
          f"waiting, budget {'-'.join(map(str, engine.get('max_num_batched_tokens', [])))}; client CPU "
          f"{loaded['process_cpu_s']:.1f} s of {loaded['seconds']:.1f}", flush=True)


HEADER = " ".join((f"{'path':<7}", *(f"{h:>9}" for h in ("streams", "requests", "failed", "out tok", "tok/s",
                                                           "TTFT med", "p99", "TPOT mean", "med", "p99",
                                                           "ITL med", "p90", "p99"))))


def row(path: str, r: dict) -> str:
    """One run's line of HEADER: TTFT, TPOT and ITL (chunk gaps) in ms."""
    t, p, i = r["ttft_ms"], r["tpot_ms"], r["itl_ms"]
    counts = (r["concurrency"], r["num_requests"], r["failed"], r["output_tokens"])
    times = (r["output_tok_s"], t["median"], t["p99"], p["mean"], p["median"], p["p99"], i["median"], i["p90"],
             i["p99"])
    return " ".join((f"{path:<7}", *(f"{c:>9}" for c in counts), *(f"{x:>9.2f}" for x in times)))


def report_streaming(section: dict) -> None:
    c = section["concurrency"]
    print(f"\nstreaming on {section['device']} ({section['model']}, {section['input_len']} prompt + "
          f"{section['max_tokens']} output tokens per request; ms)")
    print(HEADER)
    for path in ("direct", "serve"):
        for r in section[f"{path}_runs"]:
            for level in ("idle", "loaded"):
                print(row(path, r[level]))
    met = section["meets_targets"]
    print(f"front door: TPOT at 1 stream {section['tpot_ms_c1']:.2f} ms (target <= {TPOT_TARGET_MS:g}: "
          f"{'met' if met['tpot_ms_c1'] else 'missed'}); at {c} streams ITL median "
          f"{section['median_itl_ms_c256']:.2f} ({section['median_itl_ms_c256'] / section['mean_tpot_ms_c256']:.1f}x "
          f"TPOT, target <= {ITL_OVER_TPOT_TARGET:g}x: {'met' if met['median_itl_ms_c256'] else 'missed'}), "
          f"p99 {section['p99_itl_ms_c256']:.2f} ms (target <= {ITL_P99_TARGET_MS:g}: "
          f"{'met' if met['p99_itl_ms_c256'] else 'missed'}; steady state {section['p99_itl_ms_c256_steady']:.2f}), "
          f"TPOT mean {section['mean_tpot_ms_c256']:.2f} ms; "
          f"Serve/direct throughput {section['throughput_ratio']:.3f} (target >= {THROUGHPUT_TARGET:.2f}: "
          f"{'met' if met['throughput_ratio'] else 'missed'}); {section['failed']} failed")


def report(res: dict) -> None:
    print(f"\nserve overhead on {res['device']} ({res['model']}, {res['input_len']} prompt + "
          f"{res['max_tokens']} output tokens per request)")
    print(HEADER)
    for level in ("idle", "loaded"):
        for path in ("direct", "serve"):
            print(row(path, res[path][level]))
    c = res["concurrency"]
    paths = [(f"front door ({res['front_door']})", res)]
    if "replica_direct_ingress" in res:
        r = res["replica_direct_ingress"]
        paths.append(("replica port", r))
        for level in ("idle", "loaded"):
            print(row("replica", r["serve"][level]))
    for name, r in paths:
        if len(r["each_repeat"]) > 1:
            print(f"{name}, each run: " + "; ".join(f"{e['added_median_ttft_ms_c1']:+.2f} ms, "
                                                   f"{e['throughput_ratio_64']:.3f}" for e in r["each_repeat"])
                  + " (medians below)")
        print(f"{name}: added median TTFT {r['added_median_ttft_ms_c1']:.2f} ms at 1 stream (target <= "
              f"{TTFT_TARGET_MS:g}), {r['added_median_ttft_ms_c64']:.2f} ms at {c}; Serve/direct throughput at {c} "
              f"streams {r['throughput_ratio_64']:.3f} (target >= {THROUGHPUT_TARGET:.2f})")
    client = res["serve"]["loaded"]
    if client["process_cpu_s"] > 0.8 * client["seconds"]:
        print(f"warning: the HTTP client was busy {client['process_cpu_s'] / client['seconds']:.0%} of the loaded "
              "Serve run; the Serve figure may be the client's limit")
