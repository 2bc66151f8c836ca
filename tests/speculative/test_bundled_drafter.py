"""The drafter shipped for the embedded SmolLM2 is found from the served model's shape and loads; a model of
another shape gets none (and speculation then asks for `drafter=`)."""
import dataclasses
import json
import os

import pytest

from replicas.loaders import load_checkpoint
from speculative.drafter import DominoDrafter
from speculative.drafters import bundled_drafter


@pytest.fixture(scope="module")
def smollm2_config():
    return load_checkpoint(None).model_config


def test_smollm2_gets_its_bundled_drafter(smollm2_config):
    folder = bundled_drafter(smollm2_config)
    assert folder is not None and os.path.basename(folder) == "smollm2-135m-instruct"
    drafter = DominoDrafter.load(folder)
    assert (drafter.cfg.vocab_size, drafter.cfg.hidden_size) == (smollm2_config.vocab_size, smollm2_config.hidden_size)
    assert max(drafter.cfg.target_layer_ids) < smollm2_config.num_hidden_layers
    with open(os.path.join(folder, "target.json")) as f:
        training = json.load(f)["training"]
    assert training["steps"] > 0 and "seq_tokens_per_s" in training and "mfu" in training


def test_another_shape_gets_none(smollm2_config):
    assert bundled_drafter(dataclasses.replace(smollm2_config, num_hidden_layers=31)) is None


def test_int8_weights_round_trip(tmp_path):
    torch = pytest.importorskip("torch")
    from speculative.drafter import DrafterConfig
    cfg = DrafterConfig(vocab_size=300, hidden_size=64, intermediate_size=96, num_layers=1, num_heads=4,
                        num_kv_heads=2, head_dim=16, target_layer_ids=(0, 1), block_size=4, gru_hidden=16,
                        correction_rank=8)
    torch.manual_seed(0)
    drafter = DominoDrafter(cfg)
    drafter.save(str(tmp_path / "plain"))
    drafter.save(str(tmp_path / "int8"), int8=True)
    assert sorted(os.listdir(tmp_path / "int8")) == ["config.json", "model.int8.safetensors.xz"]
    plain, packed = DominoDrafter.load(str(tmp_path / "plain")), DominoDrafter.load(str(tmp_path / "int8"))
    for (name, a), (_, b) in zip(plain.named_parameters(), packed.named_parameters()):
        assert torch.equal(a, b) if a.dim() < 2 or a.numel() < 4096 else \
            (a - b).abs().max() <= a.abs().amax(dim=1).max() / 127 * 0.51, name
