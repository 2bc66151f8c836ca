"""A drafter's weights on disk: plain safetensors, or int8 (per-row absmax scales) compressed with xz for a
drafter shipped in the repository, where every byte travels with each GPU call (the bundled SmolLM2 drafter:
22.8 MB in bf16, 10.5 MB this way; the largest per-row error is 0.7% of the row's largest weight, and a
drafter's error costs acceptance only: verification keeps the output exact)."""
from __future__ import annotations

import lzma
import os

import torch
from safetensors.torch import load, load_file, save, save_file
from torch import Tensor

PLAIN = "model.safetensors"
INT8_XZ = "model.int8.safetensors.xz"
SCALE = ".int8_scale"
MIN_QUANTIZED = 4096          # smaller tensors (norms, the mask embedding) stay as they are


def quantize_int8(state: dict[str, Tensor]) -> dict[str, Tensor]:
    out = {}
    for name, w in state.items():
        if w.dim() == 2 and w.numel() >= MIN_QUANTIZED:
            scale = (w.float().abs().amax(dim=1) / 127.0).clamp(min=1e-12)
            out[name] = torch.round(w.float() / scale[:, None]).clamp(-127, 127).to(torch.int8)
            out[name + SCALE] = scale
        else:
            out[name] = w
    return out


def dequantize_int8(state: dict[str, Tensor]) -> dict[str, Tensor]:
    return {name: (w.float() * state[name + SCALE][:, None] if name + SCALE in state else w)
            for name, w in state.items() if not name.endswith(SCALE)}


def save_weights(state: dict[str, Tensor], folder: str, int8: bool = False) -> None:
    state = {k: v.detach().contiguous().cpu() for k, v in state.items()}
    if not int8:
        save_file(state, os.path.join(folder, PLAIN))
        return
    with lzma.open(os.path.join(folder, INT8_XZ), "wb", preset=6) as f:
        f.write(save(quantize_int8(state)))


def load_weights(folder: str) -> dict[str, Tensor]:
    if os.path.exists(os.path.join(folder, PLAIN)):
        return load_file(os.path.join(folder, PLAIN))
    with lzma.open(os.path.join(folder, INT8_XZ), "rb") as f:
        return dequantize_int8(load(f.read()))
