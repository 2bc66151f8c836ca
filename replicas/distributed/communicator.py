"""Tensor-parallel collectives behind one small interface.

`GlooCommunicator` (torch.distributed, CPU) and `NcclCommunicator` (nccl4py, GPU) do the model's
all-reduce / all-gather; the control plane (step inputs from rank 0) always rides a gloo group.
"""
from __future__ import annotations

from typing import Protocol

import torch
import torch.distributed as dist


class Communicator(Protocol):
    rank: int
    world_size: int

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor: ...
    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor: ...
    def gather_to_first(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor | None: ...
    def broadcast_from_first(self, x: torch.Tensor) -> torch.Tensor: ...


class SingleCommunicator:
    rank, world_size = 0, 1

    def all_reduce(self, x):
        return x

    def all_gather(self, x, dim=-1):
        return x

    def gather_to_first(self, x, dim=-1):
        return x

    def broadcast_from_first(self, x):
        return x


class GlooCommunicator:
    """torch.distributed collectives on the default (gloo) group."""

    def __init__(self):
        self.rank = dist.get_rank()
        self.world_size = dist.get_world_size()

    def all_reduce(self, x):
        dist.all_reduce(x)
        return x

    def all_gather(self, x, dim=-1):
        parts = [torch.empty_like(x) for _ in range(self.world_size)]
        dist.all_gather(parts, x.contiguous())
        return torch.cat(parts, dim=dim)

    def gather_to_first(self, x, dim=-1):
        parts = [torch.empty_like(x) for _ in range(self.world_size)] if self.rank == 0 else None
        dist.gather(x.contiguous(), parts, dst=0)
        return torch.cat(parts, dim=dim) if self.rank == 0 else None

    def broadcast_from_first(self, x):
        """x (contiguous) takes rank 0's values on every rank, in place."""
        dist.broadcast(x, src=0)
        return x


class NcclCommunicator:
    """NCCL through nccl4py; the unique id is exchanged over the gloo control group."""

    def __init__(self, device: torch.device):
        from nccl import core as nccl  # nccl4py

        self._nccl = nccl
        self.rank = dist.get_rank()
        self.world_size = dist.get_world_size()
        box = [nccl.get_unique_id() if self.rank == 0 else None]
        dist.broadcast_object_list(box, src=0)
        with torch.cuda.device(device):
            self._comm = nccl.Communicator.init(nranks=self.world_size, rank=self.rank, unique_id=box[0])

    def _stream(self) -> int:
        return torch.cuda.current_stream().cuda_stream

    def all_reduce(self, x):
        self._comm.allreduce(x, x, self._nccl.SUM, stream=self._stream())
        return x

    def all_gather(self, x, dim=-1):
        x = x.contiguous()
        out = torch.empty((self.world_size, *x.shape), dtype=x.dtype, device=x.device)
        self._comm.allgather(x, out, stream=self._stream())
        return torch.cat(out.unbind(0), dim=dim)

    def gather_to_first(self, x, dim=-1):
        full = self.all_gather(x, dim)
        return full if self.rank == 0 else None

    def broadcast_from_first(self, x):
        """x (contiguous, an integer or float dtype NCCL sums) takes rank 0's values on every rank, in place: the
        sum of rank 0's values and the others' zeros, through the all-reduce this class already runs."""
        if self.rank != 0:
            x.zero_()
        return self.all_reduce(x)
