"""Checkpoint loading: `load_checkpoint(path)` for an HF safetensors folder or a GGUF file."""
from __future__ import annotations

import glob
import os
from typing import Optional

from replicas.loaders.checkpoint import Checkpoint
from replicas.loaders.default_model import default_model_path
from replicas.loaders.gguf_loader import load_gguf
from replicas.loaders.hf_folder import load_hf_folder

__all__ = ["Checkpoint", "default_model_path", "load_checkpoint"]


def load_checkpoint(model: Optional[str], load_format: str = "auto") -> Checkpoint:
    """None: the embedded SmolLM2 GGUF. A .gguf file, an HF folder (config.json + *.safetensors), or a
    folder holding exactly one .gguf file. Nothing is downloaded. load_format="dummy": a folder with
    only a config.json, random weights."""
    path = os.path.expanduser(os.fspath(model)) if model is not None else default_model_path()
    if load_format == "dummy":
        from replicas.loaders.dummy import load_dummy
        return load_dummy(path)
    if not os.path.exists(path):
        raise FileNotFoundError(f"model path {path!r} does not exist; pass a local Hugging Face model folder or a "
                                ".gguf file (tidal does not download models from a hub)")
    if os.path.isfile(path):
        if not path.endswith(".gguf"):
            raise ValueError(f"{path} is neither a .gguf file nor a model folder")
        return load_gguf(path)
    if os.path.isfile(os.path.join(path, "config.json")):
        return load_hf_folder(path)
    ggufs = sorted(glob.glob(os.path.join(path, "*.gguf")))
    if len(ggufs) == 1:
        return load_gguf(ggufs[0])
    if ggufs:
        raise ValueError(f"{path} holds several .gguf files ({', '.join(map(os.path.basename, ggufs))}); "
                         "pass the file you want")
    raise FileNotFoundError(f"{path} has neither a config.json (Hugging Face folder) nor a .gguf file")
