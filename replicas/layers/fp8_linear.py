"""A linear layer's weight in FP8 (E4M3) with one float32 scale per output channel (`quantization=fp8`).

`Fp8Weight` takes the place of a LinearBase's float `weight`, either loaded from a checkpoint published in FP8
with per-tensor or per-channel scales (replicas/loaders/fp8_checkpoint.py) or made from the loaded float weight
(`LinearBase.to_fp8`): w[n, :] ~ scale[n] * q[n, :], with scale[n] = max|w[n, :]| / 448 when tidal quantizes.
Activations are quantized per token at run time (dynamic: the same rule over each input row), and the product
runs in `torch._scaled_mm` with the row scales of both sides, accumulating in float32 and writing the activation
dtype:

    y[m, n] = xs[m] * scale[n] * sum_k xq[m, k] * q[n, k]

On the GPU one Triton kernel quantizes the activations (replicas/kernels/fp8_quant.py), and a decode batch runs
the FP8 skinny GEMM instead (`Fp8Weight.skinny`, replicas/kernels/skinny_gemm.py: weight-only, or on FP8 tensor
cores with the activations quantized per tile inside the GEMM or per token in front of it) where start-up
timing picked it for the layer's shape (replicas/layers/gemm_select.py). Decode reads the weight at one byte per
element, half of bf16's. `torch._scaled_mm` wants K and N multiples of 16 (`fits`); a layer that is not stays in
its float dtype. The LM head, embeddings and norms are not linear layers here and stay as they are. Calibrated
static activation scales are not used: dynamic per-token scales need no calibration data and bound each row's
error by its own range.
"""
from __future__ import annotations

import torch
from torch import nn

from replicas.kernels.fp8_quant import quantize_rows_fp8
from replicas.kernels.skinny_gemm import SkinnyConfig, skinny_gemm

FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max
MIN_SCALE = 1e-12          # an all-zero row gets this scale (its quants are 0 either way)


def quantize_rows(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(q FP8 [R, K], scale float32 [R]) with t[r] ~ scale[r] * q[r]: each row scaled so its largest magnitude is
    FP8_MAX, rounded to nearest."""
    t = t.float()
    scale = (t.abs().amax(dim=-1) / FP8_MAX).clamp_min(MIN_SCALE)
    q = (t / scale.unsqueeze(-1)).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return q, scale


def quantize_activations(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x's rows ([..., K] -> [R, K]) quantized per token by the `quantize_rows` rule: one kernel on the GPU."""
    rows = x.reshape(-1, x.shape[-1])
    if rows.is_cuda and rows.stride(-1) == 1:
        return quantize_rows_fp8(rows, FP8_MAX, MIN_SCALE, FP8)
    return quantize_rows(rows)


def fits(out_features: int, in_features: int) -> bool:
    return out_features % 16 == 0 and in_features % 16 == 0


class Fp8Weight(nn.Module):
    """q FP8 [N, K] and scale float32 [N]. Like QuantizedWeight it answers the slicing the TP weight loaders use
    (`narrow`, `copy_`, `shape`), so a checkpoint published in FP8 loads its fused and sharded layers through
    the same `weight_loader`s as float weights: a slice of input columns keeps its rows' scales."""

    def __init__(self, q: torch.Tensor, scale: torch.Tensor):
        super().__init__()
        if q.dtype != FP8 or q.dim() != 2 or scale.shape != q.shape[:1] or scale.dtype != torch.float32:
            raise ValueError(f"not an FP8 weight with row scales: q {tuple(q.shape)} {q.dtype}, "
                             f"scale {tuple(scale.shape)} {scale.dtype}")
        self.register_buffer("q", q, persistent=True)
        self.register_buffer("scale", scale, persistent=True)

    @classmethod
    def from_float(cls, weight: torch.Tensor) -> "Fp8Weight":
        return cls(*quantize_rows(weight))

    @classmethod
    def empty(cls, out_features: int, in_features: int, device: torch.device | None = None) -> "Fp8Weight":
        return cls(torch.empty(out_features, in_features, dtype=FP8, device=device),
                   torch.empty(out_features, device=device))

    # ---- the tensor surface the TP weight loaders use ----------------------------------------------------
    @property
    def shape(self) -> torch.Size:
        return self.q.shape

    @property
    def data(self) -> "Fp8Weight":
        return self

    def dim(self) -> int:
        return 2

    def narrow(self, dim: int, start: int, length: int) -> "Fp8Weight":
        """A view of rows (dim 0: with their scales) or of input columns (dim 1: the rows' scales unchanged)."""
        return Fp8Weight(self.q.narrow(dim, start, length), self.scale.narrow(0, start, length) if dim == 0
                         else self.scale)

    def copy_(self, other: "Fp8Weight") -> "Fp8Weight":
        if not isinstance(other, Fp8Weight) or other.shape != self.shape:
            raise ValueError(f"an FP8 weight {tuple(self.shape)} cannot take "
                             f"{'an FP8' if isinstance(other, Fp8Weight) else 'a float'} tensor "
                             f"{tuple(other.shape)} (a fused layer whose parts differ in format)")
        self.q.copy_(other.q)
        self.scale.copy_(other.scale)
        return self

    def dequantize(self) -> torch.Tensor:
        return self.q.float() * self.scale.unsqueeze(1)

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        xq, xs = quantize_activations(x)
        y = torch._scaled_mm(xq, self.q.t(), scale_a=xs.unsqueeze(1), scale_b=self.scale.unsqueeze(0),
                             out_dtype=x.dtype, bias=None if bias is None else bias.to(x.dtype))
        return y.view(*x.shape[:-1], -1)

    def skinny(self, x: torch.Tensor, bias: torch.Tensor | None, cfg: SkinnyConfig) -> torch.Tensor:
        """The product through the FP8 skinny GEMM with `cfg`, quantizing x per token first where the config
        multiplies FP8 activations (`token_scales`)."""
        if not cfg.token_scales:
            return skinny_gemm(x, self.q, bias, cfg, self.scale)
        xq, xs = quantize_activations(x)
        return skinny_gemm(xq, self.q, bias, cfg, self.scale, xs, x.dtype).view(*x.shape[:-1], -1)
