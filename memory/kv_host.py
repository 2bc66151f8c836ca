"""What the KV memory layer needs from the engine above it, as protocols the engine's classes satisfy.

memory/ imports nothing from replicas/: the block manager sees sequences as `BlockOwner`s, elastic KV sees the
scheduler as a `ScheduleView`, and the reserve profiling and rank KV set-up see the model runner as a `KVHost`.
"""
from __future__ import annotations

from typing import Any, Protocol, Sequence

import torch


class BlockOwner(Protocol):
    """A sequence as the block manager sees it: its tokens and the blocks that hold their K/V."""
    block_table: list[int]          # logical block i -> physical block id
    num_computed_tokens: int        # tokens whose K/V is in the cache
    token_ids: list[int]            # prompt and output, in order

    @property
    def num_tokens(self) -> int: ...

    @property
    def num_uncomputed_tokens(self) -> int: ...


class ScheduleView(Protocol):
    """The scheduler as elastic KV sees it: the queues, the limits, the next step's shape, and preemption."""
    running: Sequence[BlockOwner]
    waiting: Sequence[BlockOwner]
    max_num_seqs: int
    max_num_batched_tokens: int

    def lookahead(self) -> Any:
        """The next step's token counts (decodes and prefill), without scheduling it."""

    def preempt(self, seq: BlockOwner) -> None:
        """Free the sequence's blocks and put it back at the head of the waiting queue (recompute)."""


class KVHost(Protocol):
    """One rank's model runner as the KV layer sees it: the KV geometry, the tensors, and probe steps."""
    device: torch.device
    dtype: torch.dtype
    block_size: int
    world_size: int
    model_config: Any               # num_key_value_heads, head_dim, num_hidden_layers
    config: Any                     # the engine config: scheduling limits and gpu_memory_utilization
    kv_storages: list[torch.Tensor]

    def kv_block_bytes(self) -> int:
        """One block over all layers on this rank."""

    def allocate_kv_cache(self, num_blocks: int) -> None:
        """Plain KV tensors of num_blocks blocks, bound to the attention layers."""

    def bind_kv_caches(self, storages: list[torch.Tensor]) -> None:
        """Bind range tensors allocated elsewhere (the VMM pool) to the attention layers."""

    def release_kv_caches(self) -> None:
        """Drop every reference to the KV memory."""

    def profile_peak_activation_bytes(self) -> int:
        """Peak activation bytes of one full max_num_batched_tokens step."""

    def measure_graph_pool_bytes(self) -> int:
        """Bytes the step graphs will hold once captured (0 without graphs). Called before the KV pool exists."""

    def run_probe_step(self, num_tokens: int, num_rows: int) -> None:
        """One real prefill-shaped step (forward, logits, the sampler's sort) that writes no K/V and reads only
        block 0."""
