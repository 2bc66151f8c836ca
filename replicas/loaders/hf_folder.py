"""Hugging Face model folders: config.json, generation_config.json, tokenizer files and *.safetensors."""
from __future__ import annotations

import glob
import json
import os

import torch
from safetensors import safe_open

from replicas.loaders.checkpoint import Checkpoint, model_config_from_hf
from replicas.tokenizer import Tokenizer

_INDEX = "model.safetensors.index.json"
_SKIPPED_SUFFIXES = ("rotary_emb.inv_freq",)   # buffers some old checkpoints saved


class SafetensorsSource:
    """Tensors of one or several .safetensors files, read lazily through memory maps."""

    def __init__(self, folder: str, tie_word_embeddings: bool):
        index = os.path.join(folder, _INDEX)
        if os.path.isfile(index):
            with open(index) as f:
                weight_map = json.load(f)["weight_map"]
            files = sorted(set(weight_map.values()))
        else:
            files = sorted(os.path.basename(p) for p in glob.glob(os.path.join(folder, "*.safetensors")))
        if not files:
            bins = glob.glob(os.path.join(folder, "*.bin")) + glob.glob(os.path.join(folder, "*.pt"))
            hint = " (PyTorch .bin checkpoints are not supported; save the model with safetensors)" if bins else ""
            raise FileNotFoundError(f"no *.safetensors weights in {folder}{hint}")
        self._handles = {f: safe_open(os.path.join(folder, f), framework="pt") for f in files}
        self._file_of: dict[str, str] = {}
        for f, handle in self._handles.items():
            for name in handle.keys():
                if name.endswith(_SKIPPED_SUFFIXES) or (tie_word_embeddings and name == "lm_head.weight"):
                    continue
                self._file_of[name] = f

    def names(self) -> list[str]:
        return list(self._file_of)

    def read(self, name: str, keep_quantized: bool = False) -> torch.Tensor:
        return self._handles[self._file_of[name]].get_tensor(name)


def _read_json(path: str) -> dict:
    if not os.path.isfile(path):
        return {}
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def load_hf_folder(folder: str) -> Checkpoint:
    config_file = os.path.join(folder, "config.json")
    if not os.path.isfile(config_file):
        raise FileNotFoundError(f"no config.json in {folder}: not a Hugging Face model folder")
    hf_config = _read_json(config_file)
    generation_config = _read_json(os.path.join(folder, "generation_config.json"))
    try:
        model_config = model_config_from_hf(hf_config, generation_config)
    except KeyError as e:
        raise ValueError(f"{config_file} lacks {e}") from e
    except ValueError as e:
        raise ValueError(f"{config_file}: {e}") from e
    return Checkpoint(path=folder, hf_config=hf_config, model_config=model_config,
                      tokenizer=Tokenizer.from_hf_folder(folder), generation_config=generation_config,
                      source=SafetensorsSource(folder, model_config.tie_word_embeddings))
