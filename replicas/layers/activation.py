import torch
import torch.nn.functional as F
from torch import nn


class SiluAndMul(nn.Module):
    """[.., 2I] -> [.., I]: silu(gate) * up, the gate_up projection split in half."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.is_cuda:
            from replicas.kernels.elementwise import silu_and_mul
            return silu_and_mul(x)
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up
