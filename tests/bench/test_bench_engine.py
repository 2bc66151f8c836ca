"""bench.engine's accounting (CPU): the bytes and parameters a forward reads, bf16 and FP8, and the fp8 / bf16
speed-ups it reports."""
import pytest

from bench.engine import fp8_speedups, weight_bytes, weight_params
from replicas.config import EngineConfig
from replicas.model_runner import ModelRunner
from tests.support.checkpoints import make_tiny_llama


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> str:
    return make_tiny_llama(str(tmp_path_factory.mktemp("tiny") / "m"))


def test_fp8_weights_count_one_byte_each_plus_their_row_scales(tiny):
    runners = {q: ModelRunner(EngineConfig.from_flat(model=tiny, device="cpu", quantization=q))
               for q in ("none", "fp8")}
    float_model, fp8_model = runners["none"].model, runners["fp8"].model
    assert weight_params(float_model) == weight_params(fp8_model)
    linear = [m for m in float_model.modules() if hasattr(m, "to_fp8")]
    linear_params = sum(m.weight.numel() for m in linear)
    rows = sum(m.weight.shape[0] for m in linear)
    # float32 on the CPU: 4 bytes a weight; FP8: 1 byte, plus a float32 scale per output row
    assert weight_bytes(float_model) - weight_bytes(fp8_model) == 3 * linear_params - 4 * rows
    cfg = float_model.config
    assert weight_params(float_model) == linear_params + cfg.vocab_size * cfg.hidden_size + sum(
        p.numel() for n, p in float_model.named_parameters() if "norm" in n)


def test_fp8_speedups_pair_the_runs_by_batch():
    bf16 = {"output_tok_s": 100.0, "prefill_step_ms": 30.0,
            "decode_by_batch": [{"batch": 1, "step_ms": 2.0}, {"batch": 64, "step_ms": 4.0}]}
    fp8 = {"output_tok_s": 150.0, "prefill_step_ms": 20.0,
           "decode_by_batch": [{"batch": 1, "step_ms": 1.0}, {"batch": 64, "step_ms": 3.2}]}
    assert fp8_speedups(bf16, fp8) == {"output_tok_s": 1.5, "decode_b1": 2.0, "decode_b64": 1.25, "prefill": 1.5}
    bf16["decode_by_batch"][1]["bytes"], fp8["decode_by_batch"][1]["bytes"] = 24e9, 16e9   # weights + bf16 KV
    assert fp8_speedups(bf16, fp8)["byte_ceiling"] == {"decode_b64": 1.5}


def test_fp8_perplexity_reports_both_paths_on_the_fixed_text():
    """The default model on the CPU (float32 for `auto` there: the GGUF's blocks; fp8 dequantizes and quantizes
    again): both perplexities finite and near each other. 256 tokens: over 64 the ratio is a small sample's (1.11 on
    one CPU, under 1.1 on another; 1.05 over 256 on the first)."""
    from bench.engine import fp8_perplexity
    got = fp8_perplexity(tokens=256, device="cpu")
    assert got["tokens"] == 256 and got["text"].endswith("LICENSE.txt")
    assert 1 < got["bf16"] < 1000 and 0.9 < got["ratio"] < 1.1, got


def test_update_replaces_the_measured_rows_and_names_where_every_row_came_from():
    from bench.engine import merge_results
    old = {"provenance": {"commit": "a"}, "shapes": {"qwen3-0.6b": {"x": 1}, "llama3-8b": {"x": 2}},
           "attention": {"y": 3}, "fp8_vs_bf16": {"smollm2": {"decode_b1": 1.5}}}
    new = {"provenance": {"commit": "b"}, "shapes": {"llama3-8b": {"x": 4}, "llama3-8b:fp8": {"x": 5}},
           "fp8_vs_bf16": {"llama3-8b": {"decode_b1": 1.8}}}
    merged = merge_results(old, new)
    assert merged["shapes"] == {"qwen3-0.6b": {"x": 1}, "llama3-8b": {"x": 4}, "llama3-8b:fp8": {"x": 5}}
    assert merged["attention"] == {"y": 3} and merged["provenance"] == {"commit": "b"}
    assert set(merged["fp8_vs_bf16"]) == {"smollm2", "llama3-8b"}
    assert merged["rows_from"] == {"qwen3-0.6b": {"commit": "a"}, "llama3-8b": {"commit": "b"},
                                   "llama3-8b:fp8": {"commit": "b"}}
    again = merge_results(merged, {"provenance": {"commit": "c"}, "shapes": {"smollm2": {}}})
    assert again["rows_from"]["qwen3-0.6b"] == {"commit": "a"} and again["rows_from"]["smollm2"] == {"commit": "c"}
