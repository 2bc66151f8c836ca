"""bench.drafter_shapes on CPU with a tiny target: every shape is trained alike (the same steps and tokens), then
measured on the speculative engine; the JSON holds what the GPU run fills, tau agrees with the engine's own
counters, --resume keeps the shapes measured earlier and refuses other settings, and the choice follows its rule."""
import json
import random

import pytest

from bench.drafter_shapes import main
from speculative.train_data import write_pairs
from tests.support.checkpoints import make_tiny_llama

TEXTS = ["Hello world! How are you today?", "Write a function that adds two numbers.", "The capital of France is",
         "Count: one, two, three.", "Tell me a story.", "What is two plus two?"]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("shapes")
    target = make_tiny_llama(str(root / "target"))
    rng = random.Random(0)
    write_pairs(str(root / "pairs.jsonl"), [([rng.randrange(5, 300) for _ in range(rng.randint(4, 10))],
                                             [rng.randrange(5, 300) for _ in range(rng.randint(12, 30))])
                                            for _ in range(40)])
    (root / "prompts.json").write_text(json.dumps(TEXTS))
    return root, target


def run(root, target, layers: str, *extra: str) -> dict:
    main(["--model", target, "--pairs", str(root / "pairs.jsonl"), "--layers", layers, "--widths", "64,128",
          "--steps", "3", "--batch-size", "2", "--anchors-per-seq", "4", "--device", "cpu",
          "--train-args", "--seq-len 32 --block-size 4 --warmup-steps 1 --curriculum-steps 2",
          "--work", str(root / "work"), "--prompts", str(root / "prompts.json"), "--num-prompts", "2",
          "--max-tokens", "8", "--budget", "6", "--min-cell-seconds", "0", "--repeats", "2",
          "--out", str(root / "shapes.json"), *extra])
    return json.loads((root / "shapes.json").read_text())


def test_shapes_are_trained_alike_measured_and_resumed(setup):
    root, target = setup
    first = run(root, target, "1")
    assert list(first["shapes"]) == ["L1-W64", "L1-W128"]
    for name, shape in first["shapes"].items():
        assert shape["layers"] == 1 and name.endswith(f"W{shape['intermediate_size']}")
        assert shape["train"]["finished"] and shape["train"]["steps"] == 3
        assert len(shape["repeats"]) == 2 and shape["rounds"] > 0
        depth = shape["accept_rate_by_depth"]
        assert shape["tau"] == pytest.approx(1 + sum(depth)) and len(depth) <= 6
        assert set(shape["draft_ms"]) == {"b1", "b8"} and shape["verify_ms_b1"] > 0
        assert shape["speedup_b1"] == pytest.approx(shape["tok_s"] / shape["plain_tok_s_b1"])
        assert shape["bound_speedup_b1"] == pytest.approx(
            shape["tau"] * shape["plain_ms_b1"] / (shape["draft_ms"]["b1"] + shape["verify_ms_b1"]))
        assert 0.0 <= shape["outputs_identical_plain"] <= 1.0
    # the same data and steps for every shape; a wider MLP has more parameters
    assert first["shapes"]["L1-W64"]["train"]["tokens_seen"] == first["shapes"]["L1-W128"]["train"]["tokens_seen"]
    assert first["shapes"]["L1-W128"]["drafter_parameters"] > first["shapes"]["L1-W64"]["drafter_parameters"]
    best = max(first["shapes"], key=lambda k: first["shapes"][k]["speedup_b1"])
    assert first["choice"]["shape"] == best
    assert first["provenance"]["command"].startswith("python -m bench.drafter_shapes")

    resumed = run(root, target, "1,2", "--resume")
    assert list(resumed["shapes"]) == ["L1-W64", "L1-W128", "L2-W64", "L2-W128"]
    for name in first["shapes"]:
        assert resumed["shapes"][name] == first["shapes"][name]         # kept, not measured again
    assert resumed["shapes"]["L2-W64"]["layers"] == 2
    assert (resumed["shapes"]["L2-W64"]["drafter_parameters"]
            > resumed["shapes"]["L1-W64"]["drafter_parameters"])
    with pytest.raises(SystemExit, match="steps"):
        main(["--model", target, "--pairs", str(root / "pairs.jsonl"), "--steps", "4", "--resume", "--device", "cpu",
              "--prompts", str(root / "prompts.json"), "--num-prompts", "2", "--max-tokens", "8", "--budget", "6",
              "--train-args", "--seq-len 32 --block-size 4 --warmup-steps 1 --curriculum-steps 2",
              "--out", str(root / "shapes.json")])
