import torch
import torch.nn.functional as F
from torch import nn


class SiluAndMul(nn.Module):
    """[.., 2I] -> [.., I]: silu(gate) * up, the gate_up projection split in half."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up
