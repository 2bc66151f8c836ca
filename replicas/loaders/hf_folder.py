"""Hugging Face model folders: config.json, generation_config.json, tokenizer files and *.safetensors."""
from __future__ import annotations

import glob
import json
import os

import torch
from safetensors import safe_open

from replicas.layers.fp8_linear import Fp8Weight
from replicas.loaders.checkpoint import Checkpoint, model_config_from_hf
from replicas.loaders.fp8_checkpoint import SAFETENSORS_FP8, companions, load_fp8_weight
from replicas.tokenizer import Tokenizer

_INDEX = "model.safetensors.index.json"
_SKIPPED_SUFFIXES = ("rotary_emb.inv_freq",)   # buffers some old checkpoints saved


class SafetensorsSource:
    """Tensors of one or several .safetensors files, read lazily through memory maps. Linear weights stored in
    FP8 come with their scales (replicas/loaders/fp8_checkpoint.py), which are not listed as tensors of their own."""

    def __init__(self, folder: str, tie_word_embeddings: bool, fp8_block: tuple[int, int] = (128, 128)):
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
        self._fp8 = {name for name, f in self._file_of.items() if name.endswith(".weight")
                     and self._handles[f].get_slice(name).get_dtype() == SAFETENSORS_FP8}
        self._scales = {c for name in self._fp8 for c in companions(name) if c in self._file_of}
        self._fp8_block = fp8_block

    @property
    def quantized_format(self) -> str | None:
        return "fp8" if self._fp8 else None

    def names(self) -> list[str]:
        return [name for name in self._file_of if name not in self._scales]

    def _tensor(self, name: str) -> torch.Tensor | None:
        f = self._file_of.get(name)
        return None if f is None else self._handles[f].get_tensor(name)

    def read(self, name: str, keep_quantized: bool = False) -> torch.Tensor | Fp8Weight:
        """The tensor; an FP8 linear weight as Fp8Weight with `keep_quantized` where its scales allow, else
        dequantized to float32."""
        tensor = self._tensor(name)
        if name in self._fp8:
            return load_fp8_weight(name, tensor, self._tensor, self._fp8_block, keep_quantized)
        return tensor


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
                      source=SafetensorsSource(folder, model_config.tie_word_embeddings, _fp8_block(hf_config)))


def _fp8_block(hf_config: dict) -> tuple[int, int]:
    block = (hf_config.get("quantization_config") or {}).get("weight_block_size") or (128, 128)
    return int(block[0]), int(block[1])
