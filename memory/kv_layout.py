"""How the K/V of all layers lie in memory: layers grouped into ranges, block-major inside a range.

A range holds `g` consecutive layers as one tensor [num_blocks, g, 2, block_size, Hkv, D], so block b of
every layer of the group is one contiguous span and the reserve (the tail blocks) of a whole group is one
contiguous span too: the elastic reserve is one VMM handle and one mapping per range, not per layer.
Unmapping costs mostly per handle (bench/elastic.py times per-layer, per-range and single handles), hence the
ranges. Groups stay small so one layer's blocks still
share 2 MiB pages (a layer's block stride is g x its block bytes) and the attention kernels' TLB reach is
not spread over the whole pool. Every consumer takes a layer's view with its strides.
"""
from __future__ import annotations

import torch

LAYERS_PER_RANGE = 4


def layers_per_range(num_layers: int, most: int = LAYERS_PER_RANGE) -> int:
    """The largest divisor of `num_layers` not above `most` (every range holds the same number of layers)."""
    return max(g for g in range(1, min(most, num_layers) + 1) if num_layers % g == 0)


def layer_views(storages: list[torch.Tensor]) -> list[torch.Tensor]:
    """Per-layer caches [num_blocks, *block_shape] over range tensors [num_blocks, g, *block_shape]."""
    return [s[:, j] for s in storages for j in range(s.shape[1])]


def allocate_ranges(num_layers: int, num_blocks: int, block_shape: tuple[int, ...], dtype: torch.dtype,
                    device: torch.device) -> list[torch.Tensor]:
    g = layers_per_range(num_layers)
    return [torch.zeros((num_blocks, g, *block_shape), dtype=dtype, device=device) for _ in range(num_layers // g)]
