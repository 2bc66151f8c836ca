"""Random weights for an architecture given only its config.json: benchmarks of model shapes
(Qwen3-0.6B, Llama-3-8B) without their checkpoints. The model runner fills the parameters in place
on the device; the tokenizer is the embedded default's (benchmarks send token ids)."""
from __future__ import annotations

import json
import os

from replicas.loaders.checkpoint import Checkpoint, model_config_from_hf
from replicas.loaders.default_model import default_model_path
from replicas.tokenizer import Tokenizer


class _NoTensors:
    def names(self) -> list[str]:
        return []

    def read(self, name: str):
        raise KeyError(name)


def load_dummy(folder: str) -> Checkpoint:
    with open(os.path.join(folder, "config.json")) as f:
        hf_config = json.load(f)
    return Checkpoint(path=folder, hf_config=hf_config, model_config=model_config_from_hf(hf_config, {}),
                      tokenizer=Tokenizer.from_gguf(default_model_path()), generation_config={},
                      source=_NoTensors())
