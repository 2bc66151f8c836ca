"""Sizing the elastic reserve from measurements, never from guesses.

The reserve is the memory a full `max_num_batched_tokens` step needs for its activations (logits and
sampler included) beyond what a step small enough to run with the reserve lent needs:

    headroom = activation peak (allocated) + fragmentation margin (caching-allocator segments beyond it)
    reserve  = headroom - kept,   kept = reserved peak of the largest step that runs while lent

The CUDA graphs' private pool is captured after the KV pool exists, so its size is measured beforehand (the
runner captures the graphs over a one-block cache and releases them) and left out of the base, not taken
from the headroom: a lend needs the whole reserve free.

Both peaks come from real forwards of the engine's model. The margin of the first real prefill after
the reserve is returned is measured again once the pool exists (`measure_step_memory` on the live
runner) and reported beside the profiled one.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from memory.kv_host import KVHost


@dataclass(frozen=True)
class StepMemory:
    num_tokens: int
    num_rows: int
    allocated_peak: int     # bytes of live tensors above the step's starting point
    reserved_peak: int      # bytes of allocator segments above it (fragmentation included)

    @property
    def fragmentation(self) -> int:
        return max(0, self.reserved_peak - self.allocated_peak)


@dataclass(frozen=True)
class ReserveSizing:
    max_num_batched_tokens: int
    activation_peak_bytes: int          # ModelRunner.profile_peak_activation_bytes (a full step)
    fragmentation_margin_bytes: int     # reserved minus allocated peak of the same real step
    lend_step_tokens: int               # the largest step that may run while the reserve is lent
    kept_bytes: int                     # its reserved peak: stays outside the reserve
    kv_block_bytes: int                 # one block over all layers (this rank)
    graph_pool_bytes: int = 0           # what the step graphs hold once captured (KVHost.measure_graph_pool_bytes)

    @property
    def headroom_bytes(self) -> int:
        return self.activation_peak_bytes + self.fragmentation_margin_bytes

    @property
    def lendable_bytes(self) -> int:
        return max(0, self.headroom_bytes - self.kept_bytes)

    @property
    def reserve_blocks(self) -> int:
        return self.lendable_bytes // self.kv_block_bytes

    def to_dict(self) -> dict:
        return {**self.__dict__, "headroom_bytes": self.headroom_bytes, "lendable_bytes": self.lendable_bytes,
                "reserve_blocks": self.reserve_blocks}


def default_lend_step_tokens(max_num_batched_tokens: int, max_num_seqs: int) -> int:
    """A full decode batch, or a short prompt, runs with the reserve lent; anything larger reclaims it."""
    return max(1, min(max(max_num_seqs, 256), max_num_batched_tokens // 2))


@torch.inference_mode()
def measure_step_memory(runner: KVHost, num_tokens: int, num_rows: int) -> StepMemory:
    """Run one real step (forward, logits, the sampler's sort) from an emptied allocator cache and record
    its allocated and reserved peaks. The runner must have KV caches bound (block 0 is read)."""
    dev = runner.device
    torch.cuda.synchronize(dev)
    torch.cuda.empty_cache()
    alloc0, res0 = torch.cuda.memory_allocated(dev), torch.cuda.memory_reserved(dev)
    torch.cuda.reset_peak_memory_stats(dev)
    runner.run_probe_step(num_tokens, num_rows)
    torch.cuda.synchronize(dev)
    got = StepMemory(num_tokens, max(1, min(num_rows, num_tokens)), torch.cuda.max_memory_allocated(dev) - alloc0,
                     torch.cuda.max_memory_reserved(dev) - res0)
    torch.cuda.empty_cache()
    return got


def profile_reserve(runner: KVHost, lend_step_tokens: int | None = None) -> ReserveSizing:
    """Measure the full step and the largest lent step on this rank (before its KV pool exists)."""
    cfg = runner.config.scheduling
    n = cfg.max_num_batched_tokens
    lend_tokens = lend_step_tokens or default_lend_step_tokens(n, cfg.max_num_seqs)
    peak = runner.profile_peak_activation_bytes()
    graphs = runner.measure_graph_pool_bytes()
    runner.allocate_kv_cache(1)
    try:
        full = measure_step_memory(runner, n, cfg.max_num_seqs)
        kept = measure_step_memory(runner, lend_tokens, cfg.max_num_seqs)
    finally:
        runner.release_kv_caches()
        torch.cuda.empty_cache()
    margin = max(full.fragmentation, full.reserved_peak - peak, 0)
    return ReserveSizing(n, int(peak), int(margin), lend_tokens, int(kept.reserved_peak),
                         runner.kv_block_bytes(), int(graphs))


def plan_kv_blocks(runner: KVHost, sizing: ReserveSizing, slack_bytes: int | None = None) -> tuple[int, int]:
    """(base blocks, reserve blocks) for this rank: the base fills the memory left after the full step's
    headroom, the graph pool and `slack_bytes` (default: what gpu_memory_utilization leaves free)."""
    free, total = torch.cuda.mem_get_info(runner.device)
    if slack_bytes is None:
        slack_bytes = int(total * (1.0 - runner.config.cache.gpu_memory_utilization))
    base = (free - slack_bytes - sizing.headroom_bytes - sizing.graph_pool_bytes) // sizing.kv_block_bytes
    if base < 2:
        raise RuntimeError(f"not enough memory for the KV cache ({base} blocks) after a {sizing.headroom_bytes}"
                           "-byte activation headroom; lower max_num_batched_tokens")
    return int(base), sizing.reserve_blocks
