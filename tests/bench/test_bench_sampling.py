"""bench.sampling: the torch path timed per row count (CPU: the fused kernel needs CUDA), tokens recorded."""
import json

from bench.sampling import main


def test_sampling_bench_times_the_torch_path_on_cpu(tmp_path):
    res = main(["--device", "cpu", "--rows", "1,8", "--vocab", "512", "--seconds", "0.02", "--repeats", "2",
                "--out", str(tmp_path / "s.json")])
    assert [c["rows"] for c in res["cells"]] == [1, 8]
    for c in res["cells"]:
        assert list(c["us_each_repeat"]) == ["torch"] and len(c["us_each_repeat"]["torch"]) == 2
        assert c["us_median"]["torch"] > 0 and c["same_tokens"] and "speedup" not in c
    assert json.loads((tmp_path / "s.json").read_text())["provenance"]["command"].startswith("python -m bench.sampling")
