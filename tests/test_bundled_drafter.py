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
