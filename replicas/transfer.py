"""Host -> device copies on the step path."""
from __future__ import annotations

import numpy as np
import torch


def to_device(host, device) -> torch.Tensor:
    """A host array or tensor on `device` without a stream sync: pinned and asynchronous when it is a GPU."""
    t = host if isinstance(host, torch.Tensor) else torch.from_numpy(np.ascontiguousarray(host))
    return t.pin_memory().to(device, non_blocking=True) if torch.device(device).type == "cuda" else t.to(device)
