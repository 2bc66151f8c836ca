from __future__ import annotations

import torch
from torch import nn

from replicas.kernels import elementwise_cpu


class RMSNorm(nn.Module):
    """RMSNorm in float32; with `residual`, fuses the residual add: returns (normed, new residual)."""

    def __init__(self, hidden_size: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if x.is_cuda:                       # one fused Triton kernel (add + norm) on the GPU
            from replicas.kernels.elementwise import rms_norm
            out, new_residual = rms_norm(x, self.weight, self.eps, residual)
            return out if residual is None else (out, new_residual)
        if (x.dim() in (2, 3) and elementwise_cpu.supports(x) and self.weight.dtype == torch.float32
                and (residual is None or residual.is_contiguous())):
            out, new_residual = elementwise_cpu.rms_norm(x, self.weight, self.eps, residual)
            return out if residual is None else (out, new_residual)
        if residual is None:
            return self._norm(x)
        residual = x + residual
        return self._norm(residual), residual
