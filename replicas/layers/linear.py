"""Tensor-parallel linear layers. Each parameter carries a `weight_loader` that copies its shard.

Column parallel splits the output dimension across ranks (no communication); row parallel splits
the input dimension and all-reduces the partial outputs. Fused qkv and gate_up take their parts
by shard id so HF checkpoints load without a rewrite.

Every layer's matmul goes through `_matmul`: `skinny` maps a decode batch size M to the Triton skinny GEMM
config that beat cuBLAS for this weight shape (filled at start-up by replicas/layers/gemm_select.py); any
other M (prefill, non-bucket batches, no table) goes to F.linear. A weight in FP8 (`to_fp8`,
replicas/layers/fp8_linear.py) takes the skinny GEMM the same way and otherwise computes its own matmul; one kept
GGUF-quantized (`quantize_weight`, replicas/layers/quantized_linear.py) always computes its own.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from replicas.distributed.parallel_state import get_tp_group, tp_size
from replicas.kernels.skinny_gemm import SkinnyConfig, skinny_gemm
from replicas.layers.fp8_linear import Fp8Weight, fits
from replicas.layers.quantized_linear import QuantizedWeight


def _divide(a: int, b: int) -> int:
    if a % b:
        raise ValueError(f"{a} is not divisible by the tensor-parallel size {b}")
    return a // b


class LinearBase(nn.Module):
    def __init__(self, in_features: int, out_features: int, bias: bool):
        super().__init__()
        self.tp = get_tp_group()       # bound at construction: several engines may share a process
        self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
        self.weight.weight_loader = self.weight_loader
        if bias:
            self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False)
            self.bias.weight_loader = self.weight_loader
        else:
            self.register_parameter("bias", None)
        self.skinny: dict[int, SkinnyConfig] = {}

    def _replace_weight(self, weight: QuantizedWeight | Fp8Weight) -> QuantizedWeight | Fp8Weight:
        del self.weight                    # a registered parameter: only deleted can it become a module
        self.weight = weight
        weight.weight_loader = self.weight_loader
        return weight

    def quantize_weight(self, bits: int) -> QuantizedWeight:
        """Replace the float weight by an empty quantized one of the same (local) shape; the weight loaders then
        copy quantized checkpoint tensors into it."""
        return self._replace_weight(QuantizedWeight.empty(*self.weight.shape, bits))

    def fp8_weight(self) -> Fp8Weight:
        """Replace the float weight by an empty FP8 one of the same (local) shape, on its device; the weight loaders
        then copy the parts of a checkpoint published in FP8 into it."""
        return self._replace_weight(Fp8Weight.empty(*self.weight.shape, device=self.weight.device))

    def to_fp8(self) -> bool:
        """Replace the loaded float weight by its FP8 form (replicas/layers/fp8_linear.py); False where the shape
        does not fit FP8 GEMMs and the weight stays as it is."""
        if not isinstance(self.weight, nn.Parameter) or not fits(*self.weight.shape):
            return False
        self._replace_weight(Fp8Weight.from_float(self.weight.data))
        return True

    def _matmul(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        weight = self.weight
        if isinstance(weight, QuantizedWeight):
            return weight.linear(x, bias)
        cfg = self.skinny.get(x.shape[0]) if x.dim() == 2 else None
        if isinstance(weight, Fp8Weight):
            return weight.linear(x, bias) if cfg is None else weight.skinny(x, bias, cfg)
        if cfg is None:
            return F.linear(x, weight, bias)
        return skinny_gemm(x, weight, bias, cfg)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, *args) -> None:
        param.data.copy_(loaded)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._matmul(x, self.bias)


class ColumnParallelLinear(LinearBase):
    """y = x W^T with W split by output rows; rank r holds rows [r*n/tp, (r+1)*n/tp)."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False):
        super().__init__(in_features, _divide(out_features, tp_size()), bias)

    def weight_loader(self, param, loaded, *args):
        n = param.shape[0]
        param.data.copy_(loaded.narrow(0, self.tp.rank * n, n))


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel outputs fused into one matmul (gate_up); shard id = part index."""

    def __init__(self, in_features: int, out_sizes: list[int], bias: bool = False):
        self.out_sizes = out_sizes
        super().__init__(in_features, sum(out_sizes), bias)

    def weight_loader(self, param, loaded, shard_id: int):
        tp = self.tp.world_size
        offset = sum(self.out_sizes[:shard_id]) // tp
        size = self.out_sizes[shard_id] // tp
        param.data.narrow(0, offset, size).copy_(loaded.narrow(0, self.tp.rank * size, size))


class QKVParallelLinear(ColumnParallelLinear):
    """q, k and v projections fused; each rank holds its query heads and its key/value heads."""

    def __init__(self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int, bias: bool = False):
        tp = tp_size()
        self.head_dim = head_dim
        self.num_heads = _divide(num_heads, tp)
        self.num_kv_heads = _divide(num_kv_heads, tp)
        super().__init__(hidden_size, (num_heads + 2 * num_kv_heads) * head_dim, bias)

    def weight_loader(self, param, loaded, shard_id: str):
        q = self.num_heads * self.head_dim
        kv = self.num_kv_heads * self.head_dim
        offset, size = {"q": (0, q), "k": (q, kv), "v": (q + kv, kv)}[shard_id]
        param.data.narrow(0, offset, size).copy_(loaded.narrow(0, self.tp.rank * size, size))


class RowParallelLinear(LinearBase):
    """y = sum_r x_r W_r^T: input features split across ranks, partial sums all-reduced.

    The bias is added once, after the reduction."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False):
        super().__init__(_divide(in_features, tp_size()), out_features, bias)

    def weight_loader(self, param, loaded, *args):
        if param.dim() == 1:
            param.data.copy_(loaded)
            return
        n = param.shape[1]
        param.data.copy_(loaded.narrow(1, self.tp.rank * n, n))

    def forward(self, x):
        y = self._matmul(x, None)
        if self.tp.world_size > 1:
            y = self.tp.all_reduce(y)
        return y if self.bias is None else y + self.bias
