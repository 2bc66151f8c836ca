"""Linear weights of checkpoints published in FP8 (E4M3), as Hugging Face model folders hold them.

A weight `X.weight` stored as F8_E4M3 comes with its scale, w = q * scale:
- `X.weight_scale` (compressed-tensors "FP8" / "FP8-dynamic", FBGEMM FP8): one scale per tensor ([] or [1]) or per
  output channel ([N, 1] or [N]); it loads as `Fp8Weight` (per-tensor scales repeated over the rows) where the
  engine keeps FP8, and dequantized otherwise;
- `X.weight_scale_inv` (Transformers' fine-grained FP8): one scale per block of `weight_block_size` (the config's
  `quantization_config`, default 128 x 128); the rows of a block share no single scale, so it always loads
  dequantized (with `quantization=fp8` tidal then quantizes it again, per row).
`X.input_scale` (a calibrated static activation scale) is read by nobody: tidal quantizes activations per token.
"""
from __future__ import annotations

import torch

from replicas.layers.fp8_linear import FP8, Fp8Weight

SAFETENSORS_FP8 = "F8_E4M3"
SCALE_SUFFIXES = ("weight_scale", "weight_scale_inv", "input_scale")


def companions(weight_name: str) -> list[str]:
    """The tensor names that may accompany an FP8 `X.weight`."""
    base = weight_name[: -len("weight")]
    return [base + suffix for suffix in SCALE_SUFFIXES]


def row_scales(scale: torch.Tensor, rows: int) -> torch.Tensor:
    """float32 [rows] from a per-tensor ([] or [1]) or per-channel ([rows] or [rows, 1]) scale."""
    scale = scale.float()
    if scale.numel() == 1:
        return scale.reshape(1).expand(rows).contiguous()
    if scale.numel() == rows and (scale.dim() == 1 or scale.shape == (rows, 1)):
        return scale.reshape(rows).contiguous()
    raise ValueError(f"an FP8 weight of {rows} rows has a weight_scale of shape {tuple(scale.shape)}: neither per "
                     "tensor nor per output channel")


def block_dequantize(q: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    n, k = q.shape
    bn, bk = block
    if scale_inv.shape != (-(-n // bn), -(-k // bk)):
        raise ValueError(f"an FP8 weight {tuple(q.shape)} with {bn} x {bk} blocks needs a weight_scale_inv of "
                         f"{(-(-n // bn), -(-k // bk))}, not {tuple(scale_inv.shape)}")
    s = scale_inv.float().repeat_interleave(bn, 0)[:n].repeat_interleave(bk, 1)[:, :k]
    return q.float() * s


def load_fp8_weight(name: str, q: torch.Tensor, read, block: tuple[int, int],
                    keep: bool) -> torch.Tensor | Fp8Weight:
    """The weight `name` (q FP8 [N, K]) with its scale read through `read(scale name)` (None when absent): an
    Fp8Weight where `keep` and the scale is per tensor or per channel, else the float32 weight."""
    if q.dtype != FP8 or q.dim() != 2:
        raise ValueError(f"{name}: an FP8 linear weight must be a 2-D E4M3 tensor, got {tuple(q.shape)} {q.dtype}")
    scale_name, inv_name, _ = companions(name)
    scale = read(scale_name)
    if scale is not None:
        rows = row_scales(scale, q.shape[0])
        return Fp8Weight(q.contiguous(), rows) if keep else q.float() * rows.unsqueeze(1)
    scale_inv = read(inv_name)
    if scale_inv is not None:
        return block_dequantize(q, scale_inv, block)
    raise ValueError(f"{name} is stored in FP8 without a weight_scale or weight_scale_inv")
