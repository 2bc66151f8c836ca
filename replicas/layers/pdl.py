"""Programmatic dependent launch (PDL, Hopper and later) for the decode path's Triton kernels.

A kernel launched with PDL may start while the kernel before it in the stream is still running: its programs
become resident in that kernel's tail, so the launch and the prologue overlap the tail instead of following
it. Inside CUDA graphs this is what is left between two kernels of a decode step (about 4-7 us per GEMM on
the H200, bench/results/engine.json).

The contract every kernel launched with `launch_kwargs` keeps, by calling `pdl_wait` first:
- before `pdl_wait` it reads only what no kernel of the step writes (weights), and writes nothing;
- `pdl_wait` returns once the previous kernel has finished and its writes are visible; only then does the
  kernel allow its own dependents to launch (`gdc_launch_dependents`), so at most two kernels overlap;
- it calls `pdl_wait` on every path, early exits included: a kernel that finished without waiting would let
  the kernel after it run ahead of the one before it.
Kernels launched without PDL (cuBLAS, torch) are ordered as usual, before and after.
`TIDAL_PDL=0` launches everything plainly.
"""
from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

try:
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:                       # a Triton without grid dependency control: PDL stays off
    gdc_launch_dependents = gdc_wait = None

PDL_SWITCH = "TIDAL_PDL"


@functools.cache
def _device_supports_pdl(index: int) -> bool:
    if gdc_wait is None or os.environ.get("TRITON_INTERPRET") == "1":
        return False
    try:
        from triton.backends.nvidia.compiler import CUDAOptions
    except ImportError:
        return False
    return "launch_pdl" in CUDAOptions.__dataclass_fields__ and torch.cuda.get_device_capability(index) >= (9, 0)


def pdl_enabled(device: torch.device) -> bool:
    if device.type != "cuda" or os.environ.get(PDL_SWITCH, "1") == "0":
        return False
    return _device_supports_pdl(device.index if device.index is not None else torch.cuda.current_device())


def launch_kwargs(device: torch.device) -> dict:
    """The launch options and the USE_PDL constexpr for a kernel that calls `pdl_wait`."""
    return {"USE_PDL": True, "launch_pdl": True} if pdl_enabled(device) else {"USE_PDL": False}


@triton.jit
def pdl_wait(USE_PDL: tl.constexpr):
    if USE_PDL:
        gdc_wait()
        gdc_launch_dependents()


@triton.jit
def prefetch_l2(ptrs):
    """Ask L2 for the 128-byte lines at `ptrs` (valid addresses: callers clamp them), without waiting."""
    tl.inline_asm_elementwise("prefetch.global.L2 [$1];\nmov.u32 $0, 0;", "=r,l", [ptrs], dtype=tl.int32,
                              is_pure=False, pack=1)
