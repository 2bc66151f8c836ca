"""One rank's KV memory for elastic KV: a `VmmKVPool` on CUDA (fixed virtual ranges, the reserve handle
mapped only while lent) or a `LogicalReserve` elsewhere, and the `KVAction`s rank 0 sends it.
Every rank applies each action (with TP: `runner.call_all("apply_kv_action", action)`).

Besides lending, the reserve shrinks for good while the step budget is below the one it was sized for: a
GRANT maps the reserve's first blocks as base KV, an UNGRANT moves live K/V out of the last grant and unmaps
it (grants are a stack; each is released whole)."""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, Optional

import numpy as np
import torch

from memory.kv_host import KVHost
from memory.kv_layout import layer_views, layers_per_range
from memory.reserve import ReserveSizing, default_lend_step_tokens, plan_kv_blocks, profile_reserve

MODES = ("off", "elastic", "static")
LEND, RECLAIM, GRANT, UNGRANT = "lend", "reclaim", "grant", "ungrant"


@dataclass(frozen=True)
class KVAction:
    kind: str                                   # LEND | RECLAIM | GRANT | UNGRANT
    src: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))   # reclaim/ungrant: blocks ...
    dst: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))   # ... copied to these base blocks
    blocks: int = 0                             # grant: how many of the reserve's first blocks


class LogicalReserve:
    """The reserve without VMM (CPU, CI): the blocks live in ordinary tensors and map/unmap only flip
    `mapped`. Both scribble over the reserve blocks, as memory that was unmapped and mapped again holds
    garbage, so a read of stale reserve KV changes outputs instead of passing silently."""

    def __init__(self, storages: list[torch.Tensor], num_base: int, num_reserve: int):
        self.storages, self.num_base, self.num_reserve = storages, num_base, num_reserve
        self.caches = layer_views(storages)
        self.mapped = False
        self.grants: list[int] = []              # blocks of each grant, bottom first
        self._gen = torch.Generator(storages[0].device).manual_seed(1234)

    @property
    def reserve_bytes(self) -> int:
        return sum(s[self.num_base:].numel() * s.element_size() for s in self.storages)

    def _scribble(self, start: Optional[int] = None, stop: Optional[int] = None) -> None:
        for s in self.storages:
            s[self.num_base if start is None else start:stop].normal_(0.0, 8.0, generator=self._gen)

    def map_grant(self, blocks: int) -> None:
        assert not self.mapped and 0 < blocks <= self.num_reserve
        self._scribble(self.num_base, self.num_base + blocks)
        self.grants.append(blocks)
        self.num_base, self.num_reserve = self.num_base + blocks, self.num_reserve - blocks

    def unmap_grant(self) -> int:
        assert not self.mapped and self.grants
        blocks = self.grants.pop()
        self.num_base, self.num_reserve = self.num_base - blocks, self.num_reserve + blocks
        self._scribble(self.num_base, self.num_base + blocks)
        return blocks

    def map_reserve(self) -> None:
        assert not self.mapped
        self._scribble()
        self.mapped = True

    def unmap_reserve(self) -> None:
        assert self.mapped
        self._scribble()
        self.mapped = False

    def mem_get_info(self) -> Optional[tuple[int, int]]:
        return None

    def close(self) -> None:
        self.caches, self.storages = [], []


def _all_ranks_ok(ok: bool) -> bool:
    import torch.distributed as dist
    flag = torch.tensor([1 if ok else 0])
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)      # the gloo control group
    return bool(flag.item())


class RankKV:
    """One rank's KV memory and the device side of the protocol."""

    def __init__(self, memory, device: torch.device, num_base: int, num_reserve: int, lend_step_tokens: int,
                 kept_free_bytes: int = 0, world_size: int = 1, sizing: Optional[ReserveSizing] = None):
        self.memory, self.device = memory, device
        self.num_base, self.num_reserve = num_base, num_reserve
        self.lend_step_tokens, self.kept_free_bytes = lend_step_tokens, kept_free_bytes
        self.world_size, self.sizing = world_size, sizing
        self.reserve_blocks_built = num_reserve      # before any grant
        self.grants: list[int] = []                  # blocks of each grant mapped, bottom first
        self.before_unmap: list[Callable[[], None]] = []   # e.g. clear stale block ids in graph buffers

    @property
    def caches(self) -> list[torch.Tensor]:
        return self.memory.caches

    @property
    def reserve_bytes(self) -> int:
        return self.memory.reserve_bytes

    @property
    def reserve_fraction(self) -> float:
        """Reserve blocks per base block: what lending adds to this rank's KV pool."""
        return self.num_reserve / self.num_base

    @property
    def grant_step_blocks(self) -> int:
        """Grants come in multiples of this many blocks (whole granules of every range on CUDA)."""
        layout = getattr(self.memory, "layout", None)
        if layout is None:
            return 1
        return layout.granularity // math.gcd(layout.granularity, layout.block_bytes)

    def grant_target(self, budget: int, sized_budget: int) -> int:
        """Reserve blocks that a step budget of `budget` tokens leaves unused (the reserve was sized for
        `sized_budget`), in whole grant steps. A step's activation peak grows linearly with its tokens between
        the two measured points, the largest step that runs lent (`kept`) and the full budget (`headroom`);
        without a measurement (CPU) the logical reserve scales the same way."""
        lend = self.lend_step_tokens
        if budget >= sized_budget:
            return 0
        share = min(1.0, (sized_budget - budget) / max(1, sized_budget - lend))
        if self.sizing is not None:
            s = self.sizing
            free = share * (s.headroom_bytes - s.kept_bytes)
            blocks = int(min(free, s.lendable_bytes) // s.kv_block_bytes)
        else:
            blocks = int(share * self.reserve_blocks_built)
        step = self.grant_step_blocks
        return min(blocks, self.reserve_blocks_built) // step * step

    def apply(self, action: KVAction) -> bool:
        if action.kind == LEND:
            return self._lend()
        if action.kind == RECLAIM:
            self._reclaim(action.src, action.dst)
            return True
        if action.kind == GRANT:
            return self._grant(action.blocks)
        if action.kind == UNGRANT:
            self._ungrant(action.src, action.dst)
            return True
        raise ValueError(f"unknown KV action {action.kind!r}")

    def _grant(self, blocks: int) -> bool:
        held = len(self.memory.grants)
        ok = True
        try:
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
                torch.cuda.empty_cache()          # the memory comes from what the allocator holds free
                self.memory.map_grant(blocks * self.memory.layout.block_bytes)
            else:
                self.memory.map_grant(blocks)
        except RuntimeError:                     # VmmError (out of memory, driver refusal): not granted
            ok = False
        if self.world_size > 1:
            ok = _all_ranks_ok(ok)               # a rank that failed to map fails the grant everywhere
            if not ok and len(self.memory.grants) > held:
                self.memory.unmap_grant()
        if ok:
            self.grants.append(blocks)
            self.num_base, self.num_reserve = self.num_base + blocks, self.num_reserve - blocks
        return ok

    def _ungrant(self, src: np.ndarray, dst: np.ndarray) -> None:
        self._copy_blocks(src, dst)
        for hook in self.before_unmap:
            hook()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # every stream: cuMemUnmap does not wait for kernels
        self.memory.unmap_grant()
        blocks = self.grants.pop()
        self.num_base, self.num_reserve = self.num_base - blocks, self.num_reserve + blocks

    def _copy_blocks(self, src: np.ndarray, dst: np.ndarray) -> None:
        if len(src):
            s = torch.as_tensor(src, dtype=torch.long).to(self.device, non_blocking=True)
            d = torch.as_tensor(dst, dtype=torch.long).to(self.device, non_blocking=True)
            for storage in self.memory.storages:        # every layer of a range in one copy
                storage.index_copy_(0, d, storage.index_select(0, s))

    def _lend(self) -> bool:
        ok = True
        if self.device.type == "cuda":
            # The prefill's peak must really be back with the driver before its memory is lent.
            torch.cuda.synchronize(self.device)
            torch.cuda.empty_cache()
            free, _ = self.memory.mem_get_info()
            ok = free >= self.memory.reserve_bytes + self.kept_free_bytes
        if ok:
            try:
                self.memory.map_reserve()
            except RuntimeError:                 # VmmError (out of memory, driver refusal): not lent
                ok = False
        if self.world_size > 1:
            ok = _all_ranks_ok(ok)               # a rank that failed to map fails the lend everywhere
            if not ok and self.memory.mapped:
                self.memory.unmap_reserve()
        return ok

    def _reclaim(self, src: np.ndarray, dst: np.ndarray) -> None:
        self._copy_blocks(src, dst)
        for hook in self.before_unmap:
            hook()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # every stream: cuMemUnmap does not wait for kernels
        self.memory.unmap_reserve()

    def close(self) -> None:
        self.memory.close()


def build_rank_kv(runner: KVHost, mode: str, num_base_blocks: Optional[int] = None,
                  num_reserve_blocks: Optional[int] = None, lend_step_tokens: Optional[int] = None,
                  slack_bytes: Optional[int] = None, release_after_map: bool = True) -> RankKV:
    """Every rank calls this in place of `runner.allocate_kv_cache(...)` (collectively when TP > 1) and binds
    the caches. Block counts default to measured sizing on CUDA; on CPU they must be given."""
    if mode not in MODES:
        raise ValueError(f"elastic mode must be one of {MODES}, got {mode!r}")
    cfg, mc = runner.config.scheduling, runner.model_config
    layers = mc.num_hidden_layers
    block_shape = (2, runner.block_size, mc.num_key_value_heads // runner.world_size, mc.head_dim)
    lend_tokens = lend_step_tokens or default_lend_step_tokens(cfg.max_num_batched_tokens, cfg.max_num_seqs)
    sizing = None
    if runner.device.type == "cuda" and (num_base_blocks is None or num_reserve_blocks is None):
        sizing = profile_reserve(runner, lend_tokens)
        base, reserve = plan_kv_blocks(runner, sizing, slack_bytes)
        num_base_blocks = base if num_base_blocks is None else num_base_blocks
        num_reserve_blocks = reserve if num_reserve_blocks is None else num_reserve_blocks
    if num_base_blocks is None or num_reserve_blocks is None:
        raise ValueError("give num_base_blocks and num_reserve_blocks off CUDA")
    if mode == "off":
        num_reserve_blocks = 0
    if runner.world_size > 1:
        import torch.distributed as dist
        counts = torch.tensor([num_base_blocks, num_reserve_blocks])
        dist.all_reduce(counts, op=dist.ReduceOp.MIN)
        num_base_blocks, num_reserve_blocks = (int(x) for x in counts.tolist())
    if runner.device.type == "cuda":
        from memory.vmm import VmmKVPool, VmmLayout, allocation_granularity
        layout = VmmLayout.fit(runner.kv_block_bytes() // layers * layers_per_range(layers),
                               allocation_granularity(runner.device.index or 0),
                               num_base_blocks, num_reserve_blocks)
        memory = VmmKVPool(runner.device, layout, layers, block_shape, runner.dtype, release_after_map)
        num_base_blocks, num_reserve_blocks = layout.num_base_blocks, layout.num_reserve_blocks
    else:
        runner.allocate_kv_cache(num_base_blocks + num_reserve_blocks)
        memory = LogicalReserve(runner.kv_storages, num_base_blocks, num_reserve_blocks)
    if mode != "off" and num_reserve_blocks == 0:
        memory.close()
        raise ValueError("the reserve rounds to zero blocks: elastic KV has nothing to lend (on CPU the logical "
                         "reserve is sized by reserve_blocks, `tidal serve --reserve-blocks N`)")
    runner.bind_kv_caches(memory.storages)
    kept = sizing.kept_bytes if sizing is not None else 0
    return RankKV(memory, runner.device, num_base_blocks, num_reserve_blocks, lend_tokens, kept,
                  runner.world_size, sizing)
