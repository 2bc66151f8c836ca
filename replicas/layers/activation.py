import torch
import torch.nn.functional as F
from torch import nn

from replicas.kernels import elementwise_cpu


class SiluAndMul(nn.Module):
    """[.., 2I] -> [.., I]: silu(gate) * up, the gate_up projection split in half."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.is_cuda:
            from replicas.kernels.elementwise import silu_and_mul
            return silu_and_mul(x)
        if x.dim() == 2 and elementwise_cpu.supports(x):
            return elementwise_cpu.silu_and_mul(x)
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up
