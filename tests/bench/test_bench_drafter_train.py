"""bench.drafter_train: each configuration trains through the product Trainer and reports its log's figures."""
import argparse
import json

import pytest

from bench.drafter_train import main, parse_config


def test_drafter_train_reports_online_and_cached(tmp_path):
    res = main(["--device", "cpu", "--layers", "2", "--configs", "online:2:4,cached:2:4,cached:2:4:fullvocab",
                "--steps", "6", "--log-every", "2", "--pairs", "8", "--out", str(tmp_path / "t.json")])
    online, cached, full = res["configs"]
    assert (online["target_features"], cached["target_features"]) == ("online", "cached")
    assert all(r["step_ms"] > 0 and r["seq_tokens_per_s"] > 0 and r["windows"] == 2 for r in res["configs"])
    for r in res["configs"]:              # each counted window kept; the figure is their mean
        assert len(r["repeats"]) == 2 and r["step_ms"] == pytest.approx(sum(w["step_ms"] for w in r["repeats"]) / 2)
    assert online["feature_cache_s"] is None and cached["feature_cache_s"] > 0 and cached["feature_cache_gib"] > 0
    assert set(res["cached_over_online_speed"]) == {"b2_a4"}
    assert full["vocab_loss"] == "full" and set(res["chunked_over_full_vocab_speed"]) == {"cached_2_4_False_False"}
    saved = json.loads((tmp_path / "t.json").read_text())
    assert saved["provenance"]["command"].startswith("python -m bench.drafter_train")


def test_a_configuration_names_the_compile_and_the_attention_mask():
    assert parse_config("cached:16:128") == {"target_features": "cached", "batch_size": 16, "anchors_per_seq": 128,
                                             "compile": False, "sparse_attention": False, "vocab_loss": "chunked"}
    assert parse_config("cached:16:128:compile")["compile"] is True
    assert parse_config("cached:16:128:compile:sparse")["sparse_attention"] is True
    assert parse_config("cached:16:128:compile:fullvocab")["vocab_loss"] == "full"
    for bad in ("cached:16", "cached:16:128:sparse", "cached:16:128:compile:dense", "eager:16:128",
                "cached:16:128:compile:compile"):
        with pytest.raises(argparse.ArgumentTypeError):
            parse_config(bad)


def test_a_run_cut_after_its_first_configuration_keeps_that_configuration(tmp_path, monkeypatch):
    import bench.drafter_train as bench
    run_config, runs = bench.run_config, []

    def cut_at_the_second(*args):
        if runs:
            raise KeyboardInterrupt      # what a device call's time limit does to the process
        runs.append(1)
        return run_config(*args)
    monkeypatch.setattr(bench, "run_config", cut_at_the_second)
    out = tmp_path / "t.json"
    with pytest.raises(KeyboardInterrupt):
        main(["--device", "cpu", "--layers", "2", "--configs", "cached:2:4,online:2:4", "--steps", "4",
              "--log-every", "2", "--pairs", "8", "--out", str(out)])
    saved = json.loads(out.read_text())
    assert [r["target_features"] for r in saved["configs"]] == ["cached"]
