"""bench.seed_experiment on CPU (SmolLM2's shape, one layer, a few seconds of trace): the first policy's run sets
the SLOs every policy is judged by, unless they are given; each run's goodput counts the requests that met them."""
import json

import pytest

from bench.seed_experiment import calibrated_slos, main, slo_met

TINY = ["--shape", "smollm2-135m", "--device", "cpu", "--num-layers", "1", "--duration-s", "2", "--drain-s", "3",
        "--warmup-s", "1", "--decode-rate", "3", "--long-every-s", "1", "--long-tokens", "256,512", "--decode-prompt-tokens", "16,32",
        "--decode-output-tokens", "4,8", "--budgets", "512,128", "--num-kv-blocks", "128", "--reserve-blocks", "16",
        "--interval-s", "0.5", "--trial-rounds", "1"]


def test_slos_are_a_multiple_of_the_reference_medians_and_count_both_bounds():
    requests = [(0.1, 0.01), (0.2, 0.02), (0.3, 0.05)]
    assert calibrated_slos(requests, 2.0) == (400.0, 40.0)
    assert slo_met(requests, 400.0, 40.0) == 2 and slo_met(requests, 150.0, 100.0) == 1


@pytest.mark.timeout(300)
def test_first_policy_sets_the_slos_every_policy_is_judged_by_and_a_resumed_run_adds_repeats(tmp_path):
    args = TINY + ["--policies", "static512,static128,auto", "--out", str(tmp_path / "a.json")]
    res = main(args + ["--repeats", "1"])
    runs, slo = res["tp1"]["runs"], res["slo"]
    assert slo["set_by"].endswith("static512's requests") and slo["ttft_ms"] > 0 and slo["itl_ms"] > 0
    for (r,) in runs.values():
        met = slo_met(r["request_latencies_s"], slo["ttft_ms"], slo["itl_ms"])
        assert r["goodput"] == round(met / 2, 4) and r["slo_attainment"] == round(met / r["requests"], 4)
    assert "auto_goodput_vs_best_static" in res["tp1"] and res["tp1"]["repeats"] == 1
    assert main(["--plot", str(tmp_path / "a.json")]) == json.loads((tmp_path / "a.json").read_text())
    assert (tmp_path / "a.png").stat().st_size > 0

    # the same settings resumed with a second repeat: the first runs and the SLOs stand, each policy runs once more
    first = json.loads((tmp_path / "a.json").read_text())["tp1"]["runs"]
    more = main(args + ["--repeats", "2", "--resume"])
    assert more["slo"] == slo and len(more["resumed_by"]) == 1 and more["tp1"]["repeats"] == 2
    for name, pair in more["tp1"]["runs"].items():
        assert [r["repeat"] for r in pair] == [0, 1] and json.loads(json.dumps(pair[0])) == first[name][0]
        goodput = more["tp1"]["policies"][name]
        assert goodput["goodput_repeats"] == [r["goodput"] for r in pair]
        assert goodput["goodput"] == pytest.approx(sum(goodput["goodput_repeats"]) / 2, abs=1e-4)
    assert len(more["tp1"]["auto_goodput_vs_best_static_repeats"]) == 2
    # auto measured again (its code changed): its runs replaced, every other run and the SLOs kept
    again = main(args + ["--repeats", "2", "--resume", "--rerun", "auto"])
    assert again["slo"] == slo and len(again["resumed_by"]) == 2
    assert [r["repeat"] for r in again["tp1"]["runs"]["auto"]] == [0, 1]
    assert again["tp1"]["runs"]["auto"] != json.loads(json.dumps(more["tp1"]["runs"]["auto"]))
    for name in ("static512", "static128"):
        assert again["tp1"]["runs"][name] == json.loads(json.dumps(more["tp1"]["runs"][name]))
    with pytest.raises(SystemExit):
        main(args + ["--rerun", "auto"])                # --rerun only continues a result
    with pytest.raises(SystemExit):                     # other settings: not the same experiment
        main(args + ["--repeats", "2", "--resume", "--decode-rate", "2"])

    given = main(TINY + ["--policies", "static512", "--repeats", "1", "--ttft-slo-ms", "0", "--itl-slo-ms", "0",
                         "--out", str(tmp_path / "b.json")])
    assert given["slo"]["set_by"] == "given" and given["tp1"]["runs"]["static512"][0]["goodput"] == 0


@pytest.mark.timeout(300)
def test_a_learning_prefix_is_served_but_only_the_cold_goodput_counts_it(tmp_path):
    res = main(TINY + ["--policies", "static512,auto", "--repeats", "1", "--learn-s", "1", "--ttft-slo-ms", "1e6",
                       "--itl-slo-ms", "1e6", "--out", str(tmp_path / "c.json")])
    trace = res["trace"]
    assert trace["learn_s"] == 1 and trace["requests"] > 0
    for (r,) in res["tp1"]["runs"].values():
        assert r["requests"] + r["requests_learning"] == trace["requests"] and r["requests_learning"] > 0
        assert len(r["request_latencies_s"]) == r["finished"] <= r["requests"]
        assert len(r["request_arrivals_s"]) == r["finished"] and len(r["learning_arrivals_s"]) == len(
            r["learning_latencies_s"])
        assert all(1 <= t < 3 for t in r["request_arrivals_s"]) and all(t < 1 for t in r["learning_arrivals_s"])
        # SLOs nobody misses: goodput counts the finished counted requests per counted second, cold counts all
        assert r["goodput"] == round(len(r["request_latencies_s"]) / 2, 4)
        assert r["goodput_cold"] == round((len(r["request_latencies_s"]) + len(r["learning_latencies_s"])) / 3, 4)
    assert "auto_goodput_cold_vs_best_static" in res["tp1"]
    # auto's arm and phase whenever either changed: from the engine's start state, trials in A B B A cycles
    timeline = res["tp1"]["runs"]["auto"][0]["auto_timeline"]
    assert res["tp1"]["runs"]["static512"][0]["auto_timeline"] is None and timeline[0][1] == "elastic"
    assert all(a[1:] != b[1:] and a[0] <= b[0] for a, b in zip(timeline, timeline[1:]))
    trials = [arm for _, arm, phase in timeline if phase == "trial"]
    assert trials == ["elastic", "chunk"] * (len(trials) // 2) + ["elastic"] * (len(trials) % 2)
    # each round of trials' verdict, as auto made it after judging (meanwhile the arm that led so far in force):
    # the arm the exploit phase then ran, both arms' scores and the prompts that waited under each
    assert all(b[2] == "judge" for a, b in zip(timeline, timeline[1:]) if a[2] == "trial" and b[2] != "trial")
    chosen = [[t, arm] for (_, _, before), (t, arm, phase) in zip(timeline, timeline[1:])
              if before == "judge" and phase == "exploit"]
    choices = res["tp1"]["runs"]["auto"][0]["auto_choices"]
    assert [[c["t_s"], c["arm"]] for c in choices] == chosen
    assert all(set(c["scores"]) <= {"elastic", "chunk"} and set(c["loads"]) == set(c["scores"])
               and set(c["queue"]) <= {"elastic", "chunk"} for c in choices)
    assert res["tp1"]["auto_chose"] == [choices or [res["tp1"]["runs"]["auto"][0]["auto_state"]]]
    # what chunk measured per budget, under auto only from the requests that arrived while it was in force
    evidence = res["tp1"]["runs"]["auto"][0]["chunk_evidence"]
    assert res["tp1"]["runs"]["static512"][0]["chunk_evidence"] is None
    assert all(0 <= e["met"] <= e["requests"] for e in evidence.values())
    assert sum(e["requests"] for e in evidence.values()) <= trace["requests"]
    # the engine at every round, every policy alike: a static budget holds, counters only grow
    for name, (r,) in res["tp1"]["runs"].items():
        rounds = [dict(zip(r["rounds_columns"], row)) for row in r["rounds"]]
        assert len(rounds) >= 2 and all(a["t_s"] < b["t_s"] for a, b in zip(rounds, rounds[1:]))
        assert all(0.0 <= x["kv_usage"] <= 1.0 and x["kv_blocks_total"] > 0 for x in rounds)
        for key in ("preemptions", "kv_admission_waits", "generation_tokens"):
            assert all(0 <= a[key] <= b[key] for a, b in zip(rounds, rounds[1:]))
        assert rounds[-1]["generation_tokens"] > 0
        if name == "static512":
            assert {x["max_num_batched_tokens"] for x in rounds} == {512} and {x["elastic"] for x in rounds} == {"off"}
