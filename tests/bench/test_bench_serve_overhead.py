"""bench/serve_overhead.py end to end on CPU (the embedded SmolLM2, a real `tidal serve`), tiny settings,
and the claim its method rests on: the direct engine runs the EngineConfig that `tidal serve` builds."""
from __future__ import annotations

import argparse
import json

import pytest

from bench.serve_overhead import (Stream, direct_config, main, over_repeats, serve_flags, steady_gaps,
                                  streaming_over_repeats, write_section)
from cluster.app import engine_config
from cluster.serve_cmd import add_serve_parser, serve_app_args


def test_direct_engine_config_is_what_tidal_serve_builds():
    parser = argparse.ArgumentParser()
    add_serve_parser(parser.add_subparsers())
    for model, async_scheduling in ((None, None), ("/models/some.gguf", False), (None, True), (None, False)):
        args = argparse.Namespace(device="cpu", load_format="auto", ingress="auto", async_scheduling=async_scheduling,
                                  api_server_count=None)
        ns = parser.parse_args(["serve", *serve_flags(model, args)])
        served = engine_config(serve_app_args(ns))
        assert served == direct_config(model, args)
        assert served.scheduling.async_scheduling == async_scheduling
        assert ns.knob == [] and not ns.controller       # no runtime knob differs from the direct engine
    # on a GPU the two engines share it: only their memory shares differ
    gpu = argparse.Namespace(device="cuda", load_format="auto", ingress="auto", async_scheduling=False,
                             api_server_count=None)
    ns = parser.parse_args(["serve", *serve_flags(None, gpu)])
    assert serve_app_args(ns).api_server_count == 4      # tidal serve's default on CUDA, sent explicitly
    served = engine_config(serve_app_args(ns))
    direct = direct_config(None, gpu)
    assert served.cache.gpu_memory_utilization + direct.cache.gpu_memory_utilization > 0.85
    assert served.with_(gpu_memory_utilization=direct.cache.gpu_memory_utilization) == direct


def test_serve_overhead_cpu_smoke(tmp_path, capsys):
    out = tmp_path / "serve_overhead.json"
    res = main(["--device", "cpu", "--num-prompts", "4", "--max-tokens", "4", "--concurrency", "2",
                "--idle-prompts", "2", "--warmup", "2", "--input-len", "16", "--out", str(out)])
    assert json.loads(out.read_text()) == json.loads(json.dumps(res))
    for key in ("added_median_ttft_ms_c1", "added_median_ttft_ms_c64", "throughput_ratio_64", "serve", "direct",
                "device", "method"):
        assert key in res
    assert res["device"].startswith("CPU") and res["concurrency"] == 2
    assert res["direct_runs"] == [res["direct"]] and res["serve_runs"] == [res["serve"]]
    engine = res["serve"]["loaded"]["engine"]
    assert engine["steps"] >= 4 and 0 < engine["prefill_steps"] <= engine["steps"]
    # the engine's requests, sampled during the loaded run: never more running than the closed loop keeps in flight
    for path in ("serve", "direct"):
        sampled = res[path]["loaded"]["engine"]
        assert 0 <= sampled["mean_running"] <= 2 and 0 <= sampled["mean_waiting"] <= 2
        # the step budget at the run's start and end (on CPU no controller moves it)
        assert sampled["max_num_batched_tokens"][0] == sampled["max_num_batched_tokens"][1] > 0
    # the server's CPU during the loaded run, by role: the replica and its engine core both worked
    loaded = res["serve"]["loaded"]
    assert set(loaded["server_cpu_s"]) == {"replica", "ingress", "engine_core", "front_door"}
    assert loaded["server_cpu_s"]["replica"] > 0 and loaded["server_cpu_s"]["engine_core"] > 0
    assert loaded["server_cpu_s"]["ingress"] == 0          # on CPU the replica serves HTTP itself
    assert 4 <= loaded["chunks"] <= 4 * 4 and loaded["server_cpu_us_per_chunk"]["replica"] == \
        1e6 * loaded["server_cpu_s"]["replica"] / loaded["chunks"]
    assert "server_cpu_s" not in res["direct"]["loaded"]
    for level, requests in (("idle", 2), ("loaded", 4)):
        direct, serve = res["direct"][level], res["serve"][level]
        assert direct["num_requests"] == serve["num_requests"] == requests
        # ignore_eos: every request streams exactly max_tokens tokens on both paths
        assert direct["output_tokens"] == serve["output_tokens"] == requests * 4
        for r in (direct, serve):
            assert 0 < r["ttft_ms"]["median"] <= r["ttft_ms"]["p99"]
            assert r["output_tok_s"] > 0 and r["failed"] == 0
            assert 0 < r["tpot_ms"]["median"] <= r["tpot_ms"]["p99"]
            assert 0 <= r["itl_ms"]["median"] <= r["itl_ms"]["p90"] <= r["itl_ms"]["p99"]
    assert res["added_median_ttft_ms_c1"] == (res["serve"]["idle"]["ttft_ms"]["median"]
                                              - res["direct"]["idle"]["ttft_ms"]["median"])
    assert res["throughput_ratio_64"] == \
        res["serve"]["loaded"]["output_tok_s"] / res["direct"]["loaded"]["output_tok_s"]
    # the replica's own port (Serve's direct ingress, which tidal serve turns on): the same requests, all served
    replica = res["replica_direct_ingress"]
    assert [replica["serve"][lv]["output_tokens"] for lv in ("idle", "loaded")] == [2 * 4, 4 * 4]
    assert replica["throughput_ratio_64"] == replica["serve"]["loaded"]["output_tok_s"] / \
        res["direct"]["loaded"]["output_tok_s"]
    table = capsys.readouterr().out
    assert "replica port" in table
    assert "added median TTFT" in table and "serve" in table and "direct" in table and "TPOT mean" in table


def test_repeats_compare_each_run_with_its_own_direct_run_and_report_the_medians():
    def run(ttft_idle, ttft_loaded, tok_s):
        return {"idle": {"ttft_ms": {"median": ttft_idle}}, "loaded": {"ttft_ms": {"median": ttft_loaded},
                                                                      "output_tok_s": tok_s}}
    directs = [run(10.0, 20.0, 1000.0), run(10.0, 20.0, 500.0), run(12.0, 30.0, 1000.0)]
    res = over_repeats([run(12.0, 30.0, 950.0), run(30.0, 90.0, 500.0), run(14.0, 40.0, 900.0)], directs)
    assert [e["throughput_ratio_64"] for e in res["each_repeat"]] == [0.95, 1.0, 0.9]
    assert [e["added_median_ttft_ms_c1"] for e in res["each_repeat"]] == [2.0, 20.0, 2.0]
    assert res["added_median_ttft_ms_c1"] == 2.0 and res["added_median_ttft_ms_c64"] == 10.0
    assert res["throughput_ratio_64"] == 0.95 and res["meets_targets"] == {"added_median_ttft_ms_c1": True,
                                                                           "throughput_ratio_64": True}


def test_streaming_section_takes_the_front_doors_figures_and_keeps_the_files_other_keys(tmp_path):
    def run(tok_s, failed=0):
        def level(tpot, p99):
            return {"failed": failed, "tpot_ms": {"mean": tpot}, "itl_ms": {"median": tpot, "p99": p99},
                    "itl_ms_steady": {"p99": p99 / 2}, "output_tok_s": tok_s, "output_tokens": 1000,
                    "seconds": 1000 / tok_s}
        return {"idle": level(1.2, 2.0), "loaded": level(10.0, 40.0)}
    # the direct engine's second run was slow: per repeat the ratios are 0.9, 1.9, 0.8 (median 0.9), pooled over
    # repeats each path's tokens over its seconds: 3000 / (10/9 + 20/19 + 1.25) over 3000 / (1 + 2 + 1)
    section = streaming_over_repeats([run(900.0), run(950.0, failed=1), run(800.0)],
                                     [run(1000.0), run(500.0), run(1000.0)])
    assert [e["throughput_ratio"] for e in section["each_repeat"]] == [0.9, 1.9, 0.8]
    assert section["throughput_ratio"] == pytest.approx(4 / (10 / 9 + 20 / 19 + 1.25))
    assert (section["tpot_ms_c1"], section["p99_itl_ms_c256"], section["median_itl_ms_c256"],
            section["mean_tpot_ms_c256"]) == (1.2, 40.0, 10.0, 10.0)
    assert section["p99_itl_ms_c256_steady"] == 20.0
    assert section["failed"] == 2 and [e["failed"] for e in section["each_repeat"]] == [0, 2, 0]
    assert section["meets_targets"] == {"failed": False, "tpot_ms_c1": True, "p99_itl_ms_c256": True,
                                        "median_itl_ms_c256": True, "throughput_ratio": True}
    out = tmp_path / "serve_overhead.json"
    out.write_text(json.dumps({"throughput_ratio_64": 0.98}))
    write_section(str(out), "streaming", section)
    assert json.loads(out.read_text()) == {"throughput_ratio_64": 0.98, "streaming": json.loads(json.dumps(section))}


def test_steady_gaps_leave_out_the_opening_wave_and_the_drain():
    """Two streams at once, then a third sent at 5.0: the steady span runs from 2.0 (the opening wave's last first
    token) to 5.0 (the last send); only gaps wholly inside it count."""
    streams = [Stream(0.0, (1.0, 2.5, 3.0, 6.0), 4), Stream(0.0, (2.0, 4.0, 4.5), 3), Stream(5.0, (5.5, 7.0), 2),
               Stream(0.5, error="HTTP 500")]
    assert steady_gaps(streams[:3], 2) == [0.5, 2.0, 0.5]
    assert steady_gaps(streams[:2], 2) == []              # no request beyond the opening wave: no steady state
    # a failed request of the opening wave: the others' first tokens set the span
    assert steady_gaps([streams[3], *streams[:3]], 2) == [1.5, 0.5, 2.0, 0.5]
    assert steady_gaps([streams[3], *streams[:3]], 1) == []       # the whole opening wave failed
