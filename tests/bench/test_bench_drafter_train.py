"""bench.drafter_train: each configuration trains through the product Trainer and reports its log's figures."""
import json

from bench.drafter_train import main


def test_drafter_train_reports_online_and_cached(tmp_path):
    res = main(["--device", "cpu", "--layers", "2", "--configs", "online:2:4,cached:2:4", "--steps", "4",
                "--log-every", "2", "--pairs", "8", "--out", str(tmp_path / "t.json")])
    online, cached = res["configs"]
    assert (online["target_features"], cached["target_features"]) == ("online", "cached")
    assert all(r["step_ms"] > 0 and r["seq_tokens_per_s"] > 0 and r["windows"] == 1 for r in res["configs"])
    assert online["feature_cache_s"] is None and cached["feature_cache_s"] > 0 and cached["feature_cache_gib"] > 0
    assert set(res["cached_over_online_speed"]) == {"b2_a4"}
    saved = json.loads((tmp_path / "t.json").read_text())
    assert saved["provenance"]["command"].startswith("python -m bench.drafter_train")
