"""What the draft side's CUDA graphs share (speculative/drafter_graphs.py, speculative/context_graphs.py): the
capture itself, arenas their static buffers are carved from, and a reused pinned buffer for their host inputs."""
from __future__ import annotations

import math
from typing import Callable, Optional

import numpy as np
import torch
from torch import Tensor

WARMUP_RUNS = 2                           # before a capture, on a side stream (lazy cuBLAS / attention set-up)


def capture_graph(body: Callable[[], object], device: torch.device, pool) -> torch.cuda.CUDAGraph:
    """`body` run WARMUP_RUNS times on a side stream (lazy cuBLAS / attention set-up), then captured into `pool`."""
    current = torch.cuda.current_stream(device)
    side = torch.cuda.Stream(device)
    side.wait_stream(current)
    with torch.cuda.stream(side):
        for _ in range(WARMUP_RUNS):
            body()
    current.wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        body()
    return graph


class Arena:
    """Flat buffers (one per dtype) that keys carve their tensors from, each from offset 0. A buffer too small is
    replaced by one at least twice its size; keys carved earlier keep theirs, so all generations together hold at
    most twice the newest."""

    def __init__(self, device: torch.device):
        self.device = device
        self.buffers: dict[torch.dtype, Tensor] = {}

    def take(self, shapes: list[tuple[int, ...]], dtype: torch.dtype) -> list[Tensor]:
        sizes = [math.prod(s) for s in shapes]
        need = sum(sizes)
        buf = self.buffers.get(dtype)
        if buf is None or buf.numel() < need:
            size = max(need, 2 * buf.numel()) if buf is not None else need
            buf = self.buffers[dtype] = torch.zeros(size, dtype=dtype, device=self.device)
        return [part.view(shape) for part, shape in zip(buf[:need].split(sizes), shapes)]


class HostStaging:
    """A host buffer for one host->device copy per use, reused while its last copy is done; pinned on CUDA, where
    the copy is asynchronous. A buffer whose copy may still be pending is dropped for a new one, never waited for
    (the caching host allocator keeps it until the copy has read it)."""

    def __init__(self, device: torch.device):
        self.pinned = device.type == "cuda"
        self.buffer = torch.zeros(0, dtype=torch.long)
        self.copied: Optional[torch.cuda.Event] = None

    def take(self, n: int) -> np.ndarray:
        """n zeroed int64 entries to fill, then `upload`."""
        if self.buffer.numel() < n or (self.copied is not None and not self.copied.query()):
            self.buffer = torch.empty(max(n, self.buffer.numel()), dtype=torch.long, pin_memory=self.pinned)
        host = self.buffer[:n].numpy()
        host.fill(0)
        return host

    def upload(self, dst: Tensor) -> None:
        """dst (int64, contiguous) <- the first dst.numel() entries."""
        dst.copy_(self.buffer[:dst.numel()], non_blocking=self.pinned)
        if self.pinned:
            self.copied = self.copied or torch.cuda.Event()
            self.copied.record()
