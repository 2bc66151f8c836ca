"""What `--drafter PATH` takes: a folder saved by `DominoDrafter.save`, or a published DFlash / Domino checkpoint
(speculative/drafters/public.py), told apart by its config.json."""
from __future__ import annotations

import json
import os
from typing import Optional

import torch

from replicas.config import ModelConfig
from speculative.drafter import DominoDrafter
from speculative.drafters.public import load_public_drafter, published_layout


def load_drafter(folder: str, device="cpu", dtype: torch.dtype = torch.float32,
                 target: Optional[ModelConfig] = None) -> DominoDrafter:
    """The drafter in `folder`; `target`, when given, is checked against a published checkpoint's shapes."""
    with open(os.path.join(folder, "config.json")) as f:
        config = json.load(f)
    if published_layout(config) is not None:
        return load_public_drafter(folder, device, dtype, target)
    return DominoDrafter.load(folder, device, dtype)
