"""Drafters shipped with tidal, each a folder saved by `DominoDrafter.save` plus `target.json`: the shape of
the target it was trained for, and its training figures. `bundled_drafter` picks the one whose target shape
matches the served model, so speculation needs no `drafter=` for those models."""
from __future__ import annotations

import json
import os
from typing import Optional

from replicas.config import ModelConfig

HERE = os.path.dirname(os.path.abspath(__file__))
TARGET_KEYS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
               "num_key_value_heads", "head_dim")


def target_signature(model: ModelConfig) -> dict:
    return {k: getattr(model, k) for k in TARGET_KEYS}


def bundled_drafter(model: ModelConfig) -> Optional[str]:
    """The folder of the shipped drafter trained for a target of `model`'s shape, if there is one."""
    want = target_signature(model)
    for name in sorted(os.listdir(HERE)):
        meta = os.path.join(HERE, name, "target.json")
        if os.path.isfile(meta):
            with open(meta) as f:
                shape = json.load(f)["shape"]
            if {k: shape.get(k) for k in TARGET_KEYS} == want:
                return os.path.join(HERE, name)
    return None
