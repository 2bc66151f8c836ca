"""Elastic KV: lend the prefill-activation reserve to the KV pool during decode, take it back before a
prefill that needs it.

Two halves. `RankKV` lives on every TP rank and owns that rank's KV memory (a `VmmKVPool` on CUDA, a
`LogicalReserve` elsewhere); it applies `KVAction`s. `ElasticKV` lives on rank 0 beside the scheduler:
the policy and the block-level protocol; it sends each action to every rank through `dispatch`
(with TP: `runner.call_all("apply_kv_action", action)`, one control broadcast, only on steps that act).

Modes: "off" (reserve never lent), "elastic", "static" (reserve committed at start for good: the unsafe
baseline that runs out of memory on a burst of large prefills).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Optional

import numpy as np
import torch

from memory.block_manager import BlockManager
from memory.reserve import ReserveSizing, default_lend_step_tokens, plan_kv_blocks, profile_reserve

MODES = ("off", "elastic", "static")
LEND, RECLAIM = "lend", "reclaim"


@dataclass(frozen=True)
class KVAction:
    kind: str                                   # "lend" | "reclaim"
    src: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))   # reclaim: reserve blocks ...
    dst: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))   # ... copied to these base blocks


class LogicalReserve:
    """The reserve without VMM (CPU, CI): the blocks live in ordinary tensors and map/unmap only flip
    `mapped`. Both scribble over the reserve blocks, as memory that was unmapped and mapped again holds
    garbage, so a read of stale reserve KV changes outputs instead of passing silently."""

    def __init__(self, caches: list[torch.Tensor], num_base: int, num_reserve: int):
        self.caches, self.num_base, self.num_reserve = caches, num_base, num_reserve
        self.reserve_bytes = sum(c[num_base:].numel() * c.element_size() for c in caches)
        self.mapped = False
        self.timings: dict[str, float] = {}
        self._gen = torch.Generator(caches[0].device).manual_seed(1234)

    def _scribble(self) -> None:
        for c in self.caches:
            c[self.num_base:].normal_(0.0, 8.0, generator=self._gen)

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
        self.caches = []


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

    def apply(self, action: KVAction) -> bool:
        if action.kind == LEND:
            return self._lend()
        if action.kind == RECLAIM:
            self._reclaim(action.src, action.dst)
            return True
        raise ValueError(f"unknown KV action {action.kind!r}")

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
        if len(src):
            s = torch.as_tensor(src, dtype=torch.long).to(self.device, non_blocking=True)
            d = torch.as_tensor(dst, dtype=torch.long).to(self.device, non_blocking=True)
            for cache in self.memory.caches:
                cache.index_copy_(0, d, cache.index_select(0, s))
        for hook in self.before_unmap:
            hook()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # every stream: cuMemUnmap does not wait for kernels
        self.memory.unmap_reserve()

    def close(self) -> None:
        self.memory.close()


def build_rank_kv(runner, mode: str, num_base_blocks: Optional[int] = None, num_reserve_blocks: Optional[int] = None,
                  lend_step_tokens: Optional[int] = None, slack_bytes: Optional[int] = None,
                  release_after_map: bool = True) -> RankKV:
    """Every rank calls this in place of `runner.allocate_kv_cache(...)` (collectively when TP > 1) and binds
    the caches. Block counts default to measured sizing on CUDA; on CPU they must be given."""
    if mode not in MODES:
        raise ValueError(f"elastic mode must be one of {MODES}, got {mode!r}")
    cfg, mc = runner.config, runner.model_config
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
        layout = VmmLayout.fit(runner.kv_block_bytes() // layers,
                               allocation_granularity(runner.device.index or 0),
                               num_base_blocks, num_reserve_blocks)
        memory = VmmKVPool(runner.device, layout, layers, block_shape, runner.dtype, release_after_map)
        num_base_blocks, num_reserve_blocks = layout.num_base_blocks, layout.num_reserve_blocks
    else:
        runner.allocate_kv_cache(num_base_blocks + num_reserve_blocks)
        memory = LogicalReserve(runner.kv_caches, num_base_blocks, num_reserve_blocks)
    if mode != "off" and num_reserve_blocks == 0:
        memory.close()
        raise ValueError("the reserve rounds to zero blocks: elastic KV has nothing to lend")
    runner.bind_kv_caches(memory.caches)
    kept = sizing.kept_bytes if sizing is not None else 0
    return RankKV(memory, runner.device, num_base_blocks, num_reserve_blocks, lend_tokens, kept,
                  runner.world_size, sizing)


@dataclass(frozen=True)
class ElasticPolicy:
    lend_step_tokens: int            # a step of more tokens than this needs the reserve back
    lend_after_steps: int = 4        # consecutive steps with no large step ahead before lending
    min_lend_steps: int = 16         # a lend reclaimed sooner was thrash: the wait before the next doubles
    max_lend_after_steps: int = 1024


class LendGate:
    """Hysteresis over the scheduler's one-step lookahead. Reclaiming is never delayed (safety first); lending
    waits for `wait` quiet steps, a wait that doubles after each short lend and resets after a long one."""

    def __init__(self, policy: ElasticPolicy):
        self.policy = policy
        self.wait = policy.lend_after_steps
        self.quiet = 0
        self.lent_steps = 0

    def decide(self, lent: bool, needs_reserve: bool) -> Optional[str]:
        p = self.policy
        if lent:
            if not needs_reserve:
                self.lent_steps += 1
                return None
            short = self.lent_steps < p.min_lend_steps
            self.wait = min(self.wait * 2, p.max_lend_after_steps) if short else p.lend_after_steps
            self.quiet = 0
            return RECLAIM
        self.quiet = 0 if needs_reserve else self.quiet + 1
        if self.quiet < self.wait:
            return None
        self.quiet, self.lent_steps = 0, 0
        return LEND

    def refused(self) -> None:
        self.wait = min(self.wait * 2, self.policy.max_lend_after_steps)


class ElasticKV:
    """Rank 0: decides before each schedule whether to lend or reclaim, and runs the block-level protocol."""

    def __init__(self, mode: str, block_manager: BlockManager, scheduler, dispatch: Callable[[KVAction], bool],
                 policy: ElasticPolicy, reserve_bytes: int, max_model_len: int):
        if mode not in MODES:
            raise ValueError(f"elastic mode must be one of {MODES}, got {mode!r}")
        if mode != "off" and block_manager.num_reserve == 0:
            raise ValueError(f"elastic mode {mode!r} needs a reserve region")
        if block_manager.num_base * block_manager.block_size < max_model_len:
            # A preempted sequence is recomputed with the reserve reclaimed: it must fit in the base alone.
            raise ValueError(f"the base region ({block_manager.num_base} blocks) cannot hold one sequence of "
                             f"max_model_len={max_model_len} tokens")
        self.bm, self.scheduler, self.dispatch = block_manager, scheduler, dispatch
        self.policy, self.gate = policy, LendGate(policy)
        self.reserve_bytes = reserve_bytes
        self.mode = "off"
        self.lend_total = self.reclaim_total = self.lend_refused = 0
        self.blocks_migrated = self.preemptions = self.cache_evictions = 0
        self.lend_latencies: list[float] = []
        self.reclaim_latencies: list[float] = []
        block_manager.set_reserve_mapped(False)
        self.set_mode(mode)

    # ---- knobs ------------------------------------------------------------------------------
    def set_mode(self, mode: str) -> None:
        if mode == self.mode:
            return
        if mode not in MODES or (self.bm.num_reserve == 0 and mode != "off"):
            raise ValueError(f"elastic mode {mode!r} is not available on this engine")
        if "static" in (mode, self.mode) and self.lend_total + self.reclaim_total > 0:
            raise ValueError("the static reserve is committed at start-up only")
        if self.bm.reserve_lent:
            self.reclaim()
        self.mode = mode
        if mode == "static" and not self.lend():
            raise RuntimeError("could not commit the static reserve")

    # ---- per step ---------------------------------------------------------------------------
    def before_schedule(self) -> None:
        """Call right before `scheduler.schedule()`: reclaims before a step that needs the reserve."""
        if self.mode != "elastic":
            return
        ahead = self.scheduler.lookahead()
        needs = ahead.prefill_tokens + ahead.decode_seqs > self.policy.lend_step_tokens
        if needs and self.bm.reserve_lent and not self._large_step_possible(ahead.decode_seqs):
            needs = False          # the waiting prompt cannot be admitted even with the reserve: stay lent
        action = self.gate.decide(self.bm.reserve_lent, needs)
        if action == RECLAIM:
            self.reclaim()
        elif action == LEND:
            self.lend()

    def lend(self) -> bool:
        t0 = time.perf_counter()
        if not self.dispatch(KVAction(LEND)):
            self.lend_refused += 1
            self.gate.refused()
            return False
        self.bm.set_reserve_mapped(True)
        self.bm.lend_reserve()
        self.lend_total += 1
        self.lend_latencies.append(time.perf_counter() - t0)
        return True

    def reclaim(self) -> None:
        t0 = time.perf_counter()
        bm = self.bm
        bm.begin_reclaim()
        self.preemptions += self._make_room()
        plan = bm.plan_migration()
        bm.apply_migration(plan, self.scheduler.running)
        self.cache_evictions += bm.reclaim_reserve()
        self.dispatch(KVAction(RECLAIM, np.fromiter(plan.keys(), np.int64, len(plan)),
                               np.fromiter(plan.values(), np.int64, len(plan))))
        bm.set_reserve_mapped(False)
        self.blocks_migrated += len(plan)
        self.reclaim_total += 1
        self.reclaim_latencies.append(time.perf_counter() - t0)

    def _large_step_possible(self, decodes: int) -> bool:
        """Whether the next step could exceed `lend_step_tokens` with the reserve lent. Only the head of the
        queue can be admitted (the scheduler stops at the first prompt that does not fit), so when even all
        free blocks, reserve included, cannot hold its first chunk, the step is decodes only."""
        sched, bm = self.scheduler, self.bm
        if decodes > self.policy.lend_step_tokens or any(s.num_uncomputed_tokens > 1 for s in sched.running):
            return True
        if not sched.waiting or len(sched.running) >= sched.max_num_seqs:
            return False
        head = sched.waiting[0]
        cached = len(bm.cached_prefix(head)) * bm.block_size
        chunk = min(head.num_tokens - cached, sched.max_num_batched_tokens - decodes)
        return -(-(cached + chunk) // bm.block_size) - cached // bm.block_size <= bm.num_free_blocks

    def _make_room(self) -> int:
        """Preempt the newest sequences holding reserve blocks until the live ones fit in free base blocks."""
        bm, sched = self.bm, self.scheduler
        assert not any(s.block_table for s in sched.waiting), "a waiting sequence holds blocks"
        n = 0
        for seq in reversed(list(sched.running)):
            if len(bm.reserve_blocks_in_use()) <= len(bm.free_base):
                break
            if any(bm.is_reserve(b) for b in seq.block_table):
                sched.running.remove(seq)
                sched._preempt(seq)
                n += 1
        return n

    # ---- stats ------------------------------------------------------------------------------
    def fill_stats(self, stats) -> None:
        """Counters and gauges into EngineStats; latency samples are drained (only new ones each call)."""
        stats.elastic_mode = self.mode
        stats.reserve_bytes = self.reserve_bytes
        stats.reserve_lent_bytes = self.reserve_bytes if self.bm.reserve_lent else 0
        stats.reserve_blocks_total = self.bm.num_reserve
        stats.reserve_blocks_used = len(self.bm.reserve_blocks_in_use())
        stats.lend_total, stats.reclaim_total, stats.lend_refused = \
            self.lend_total, self.reclaim_total, self.lend_refused
        stats.blocks_migrated, stats.elastic_preemptions = self.blocks_migrated, self.preemptions
        stats.reserve_cache_evictions = self.cache_evictions
        stats.lend_latencies, self.lend_latencies = self.lend_latencies, []
        stats.reclaim_latencies, self.reclaim_latencies = self.reclaim_latencies, []


def attach_elastic(engine, mode: str, policy: Optional[ElasticPolicy] = None, **build_kw) -> ElasticKV:
    """Rebuild a fresh, idle TP=1 engine's KV memory for elastic KV (tests and benchmarks, until the engine
    wires it natively). The caller then runs `elastic.before_schedule()` before each `engine.step()`."""
    runner = engine.runner
    assert runner.world_size == 1 and not engine.has_unfinished
    runner.graphs = None
    runner.bind_kv_caches([None] * len(runner.kv_caches))
    runner.kv_caches = []
    if runner.device.type == "cuda":
        torch.cuda.synchronize(runner.device)
        torch.cuda.empty_cache()
    rank = build_rank_kv(runner, mode, **build_kw)
    runner.capture_graphs()
    if runner.graphs is not None:
        rank.before_unmap.append(runner.graphs.block_tables.zero_)
    bm = BlockManager(rank.num_base, rank.num_reserve, engine.config.block_size,
                      engine.config.enable_prefix_caching)
    engine.block_manager = engine.scheduler.block_manager = bm
    engine.rank_kv = rank
    policy = policy or ElasticPolicy(rank.lend_step_tokens)
    engine.elastic = ElasticKV(mode, bm, engine.scheduler, rank.apply, policy, rank.reserve_bytes,
                               engine.max_model_len)
    return engine.elastic
