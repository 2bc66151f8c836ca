"""bench.draft_round on CPU: every part of a round is labelled and timed, for every mode."""
from tests.support.checkpoints import make_tiny_llama

from bench.draft_round import LABELS, main


def test_draft_round_reports_each_part(tmp_path):
    model = make_tiny_llama(str(tmp_path / "m"))
    res = main(["--model", model, "--allow-random-drafter", "--device", "cpu", "--rounds", "3", "--context", "32",
                "--modes", "dominotree,chain", "--out", str(tmp_path / "r.json")])
    assert set(res["modes"]) == {"dominotree", "chain"}
    for r in res["modes"].values():
        assert r["wall_ms_per_round"] > 0
        assert all(r["labels"][k] is not None and r["labels"][k]["host_ms"] > 0 for k in LABELS)
    assert (tmp_path / "r.json").exists()
