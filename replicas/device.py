"""Where the engine runs and in which dtype: the one place that turns "auto" into a device or a dtype.

Every "auto" device of the project resolves here: the model runner (its rank's device), `tidal serve` (the
local machine before a cluster exists), the Serve app (the Ray cluster's GPUs, which it passes as `has_gpu`),
and the benchmarks' `--device` defaults. torch is imported when a function runs, so `replicas.config` can name
the choices without importing it.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Optional

if TYPE_CHECKING:
    import torch

DEVICES = ("auto", "cpu", "cuda")
DTYPES = ("auto", "bfloat16", "float16", "float32")


def cuda_available() -> bool:
    import torch
    return torch.cuda.is_available()


def resolve_device(name: str = "auto", index: Optional[int] = None, *,
                   has_gpu: Optional[bool] = None) -> "torch.device":
    """`name` ("auto" | "cpu" | "cuda") as a torch.device; "auto" is cuda when a GPU is there (`has_gpu`, by
    default this process's `torch.cuda.is_available()`). A cuda device gets `index` (default 0)."""
    import torch

    if name not in DEVICES:
        raise ValueError(f"device {name!r}: choose one of {', '.join(DEVICES)}")
    if name == "auto":
        name = "cuda" if (cuda_available() if has_gpu is None else has_gpu) else "cpu"
    if name == "cuda":
        return torch.device("cuda", index if index is not None else 0)
    return torch.device("cpu")


def resolve_dtype(name: str, device: "torch.device") -> "torch.dtype":
    """`name` ("auto" | "bfloat16" | "float16" | "float32") as a torch.dtype; "auto" is bfloat16 on a GPU,
    float32 on the CPU."""
    import torch

    if name not in DTYPES:
        raise ValueError(f"dtype {name!r}: choose one of {', '.join(DTYPES)}")
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return getattr(torch, name)
