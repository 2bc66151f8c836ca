"""Random weights for an architecture given only its config.json: benchmarks of model shapes
(Qwen3-0.6B, Llama-3-8B) without their checkpoints. The model runner fills the parameters in place
on the device. Benchmarks send token ids; the tokenizer (for text and logprob strings) is the embedded
default's, or a plain byte-level one where that is not installed."""
from __future__ import annotations

import json
import os

from replicas.loaders.checkpoint import Checkpoint, model_config_from_hf
from replicas.loaders.default_model import default_model_path
from replicas.tokenizer import Tokenizer


class _NoTensors:
    quantized_format = None

    def names(self) -> list[str]:
        return []

    def read(self, name: str, keep_quantized: bool = False):
        raise KeyError(name)


def _byte_tokenizer() -> Tokenizer:
    from tokenizers import Tokenizer as BackendTokenizer, decoders, pre_tokenizers
    from tokenizers.models import BPE

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    backend = BackendTokenizer(BPE({c: i for i, c in enumerate(sorted(alphabet))}, []))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    return Tokenizer(backend, {})


def load_dummy(folder: str) -> Checkpoint:
    with open(os.path.join(folder, "config.json")) as f:
        hf_config = json.load(f)
    try:
        tokenizer = Tokenizer.from_gguf(default_model_path())
    except (FileNotFoundError, ImportError):
        tokenizer = _byte_tokenizer()
    return Checkpoint(path=folder, hf_config=hf_config, model_config=model_config_from_hf(hf_config, {}),
                      tokenizer=tokenizer, generation_config={}, source=_NoTensors())
