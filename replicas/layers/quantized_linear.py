"""A linear layer's weight kept in GGUF's Q4_0 / Q4_1 / Q8_0 blocks (CPU, `quantization=auto`).

`QuantizedWeight` takes the place of a LinearBase's float `weight` parameter (`LinearBase.quantize_weight`). It
answers the slicing the TP weight loaders use (`narrow`, `copy_`, `shape`), so fused qkv / gate_up and TP
shards load through the same `weight_loader`s as float weights: output rows slice freely, input columns only at
whole groups of 32. The matmul runs replicas/kernels/quant_cpu.py for batches of up to MAX_ROWS rows and
dequantizes into a float GEMM above that (prefill, where compute dominates).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from replicas.kernels import quant_cpu
from replicas.kernels.quant_cpu import GROUP

BITS = (4, 8)


class QuantizedWeight(nn.Module):
    """w[n, k] = scale[n, g] * q[n, g, j] + zero[n, g] with g, j = divmod(k, 32); 4-bit q packs two inputs a byte
    (uint8 [N, K/32, 16]: j < 16 in the low nibbles), 8-bit q is int8 [N, K/32, 32] with no zero."""

    def __init__(self, q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None):
        super().__init__()
        self.bits = 4 if q.dtype == torch.uint8 else 8
        if q.shape[-1] != GROUP * self.bits // 8 or scale.shape != q.shape[:2] or (zero is None) != (self.bits == 8):
            raise ValueError(f"not a {self.bits}-bit group-{GROUP} weight: q {tuple(q.shape)}, scale "
                             f"{tuple(scale.shape)}, zero {None if zero is None else tuple(zero.shape)}")
        self.register_buffer("q", q, persistent=True)
        self.register_buffer("scale", scale, persistent=True)
        self.register_buffer("zero", zero, persistent=True)

    @classmethod
    def empty(cls, out_features: int, in_features: int, bits: int) -> "QuantizedWeight":
        if bits not in BITS or in_features % GROUP:
            raise ValueError(f"a {bits}-bit weight needs bits in {BITS} and input features divisible by {GROUP} "
                             f"(got {in_features})")
        g = in_features // GROUP
        q = torch.empty(out_features, g, GROUP * bits // 8, dtype=torch.uint8 if bits == 4 else torch.int8)
        zero = torch.empty(out_features, g) if bits == 4 else None
        return cls(q, torch.empty(out_features, g), zero)

    # ---- the tensor surface the TP weight loaders use ----------------------------------------------------
    @property
    def shape(self) -> torch.Size:
        return torch.Size((self.q.shape[0], self.q.shape[1] * GROUP))

    @property
    def data(self) -> "QuantizedWeight":
        return self

    def dim(self) -> int:
        return 2

    def narrow(self, dim: int, start: int, length: int) -> "QuantizedWeight":
        """A view of rows (dim 0) or of input columns (dim 1, whole groups only)."""
        if dim == 1:
            if start % GROUP or length % GROUP:
                raise ValueError(f"a quantized weight splits its inputs only at multiples of {GROUP} (got columns "
                                 f"{start}..{start + length}): use quantization=none with this tensor-parallel size")
            start, length = start // GROUP, length // GROUP
        parts = [t if t is None else t.narrow(dim, start, length) for t in (self.q, self.scale, self.zero)]
        return QuantizedWeight(*parts)

    def copy_(self, other: "QuantizedWeight") -> "QuantizedWeight":
        if not isinstance(other, QuantizedWeight) or other.bits != self.bits or other.shape != self.shape:
            got = f"{other.bits}-bit" if isinstance(other, QuantizedWeight) else "float"
            raise ValueError(f"a {self.bits}-bit quantized weight {tuple(self.shape)} cannot take a {got} tensor "
                             f"{tuple(other.shape)} (a fused layer whose parts differ in format: use "
                             "quantization=none)")
        self.q.copy_(other.q)
        self.scale.copy_(other.scale)
        if self.zero is not None:
            self.zero.copy_(other.zero)
        return self

    # ---- compute -------------------------------------------------------------------------------------------
    def dequantize(self) -> torch.Tensor:
        return quant_cpu.dequantize(self.q, self.scale, self.zero)

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1])
        if rows.shape[0] <= quant_cpu.MAX_ROWS and rows.shape[0] and quant_cpu.available():
            y = quant_cpu.gemm(rows.float(), self.q, self.scale, self.zero).to(x.dtype).view(*x.shape[:-1], -1)
            return y if bias is None else y + bias
        return F.linear(x, self.dequantize().to(x.dtype), bias)
