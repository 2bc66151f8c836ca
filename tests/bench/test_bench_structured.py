"""bench.structured on CPU (tiny model, short cells): both modes run interleaved, every constrained output is valid,
the result carries its ratio and provenance."""
import json

import pytest

from tests.support.checkpoints import make_tiny_llama

from bench.structured import main


@pytest.mark.parametrize("extra", [[], ["--async-scheduling"]])
def test_structured_bench_smoke(tmp_path, extra):
    model = make_tiny_llama(str(tmp_path / "m"))
    out = tmp_path / "structured.json"
    res = main(["--model", model, "--device", "cpu", "--concurrency", "4", "--seconds", "1", "--repeats", "2",
                "--records", "1", "--warmup", "2", "--out", str(out), *extra])
    assert all((c["steps_ahead"] > 0) == bool(extra) for c in res["cells"])
    assert json.loads(out.read_text())["ratio"] == res["ratio"] > 0
    pairs = zip(res["cells"][0::2], res["cells"][1::2])
    assert all((p["mode"], c["mode"], p["repeat"]) == ("plain", "json_schema", c["repeat"]) for p, c in pairs)
    assert res["ratio_paired"] > 0
    assert [(c["repeat"], c["mode"]) for c in res["cells"]] == [(0, "plain"), (0, "json_schema"),
                                                               (1, "plain"), (1, "json_schema")]
    assert all(c["output_tokens"] > 0 for c in res["cells"])
    assert len(res["plain_max_tokens_by_prompt"]) == 16 and min(res["plain_max_tokens_by_prompt"]) >= 1
    grammar = res["grammar"]
    assert grammar["finished_outputs"] > 0 and grammar["valid_outputs"] == grammar["finished_outputs"]
    assert len(grammar["compile_ms"]) == 1 and grammar["mask_ms_per_step_median"] > 0
    assert {"date", "commit", "machine", "command"} <= set(res["provenance"])


def test_structured_bench_stops_when_its_requests_fail(tmp_path, monkeypatch):
    """A grammar backend that cannot load fails every constrained request: the benchmark stops with the error
    instead of waiting forever for requests the engine has ended."""
    from replicas.structured import backend

    monkeypatch.setitem(backend.BACKENDS, "xgrammar", "tests.bench.no_such_grammar_module")
    model = make_tiny_llama(str(tmp_path / "m"))
    with pytest.raises(RuntimeError, match="no_such_grammar_module"):
        main(["--model", model, "--device", "cpu", "--concurrency", "2", "--seconds", "1", "--repeats", "2",
              "--records", "1", "--warmup", "2", "--out", str(tmp_path / "structured.json")])
