"""Elastic KV: lend the prefill-activation reserve to the KV pool during decode, take it back before a
prefill that needs it.

Two halves. `RankKV` (memory/rank_kv.py) lives on every TP rank and owns that rank's KV memory (a
`VmmKVPool` on CUDA, a `LogicalReserve` elsewhere); it applies `KVAction`s. `ElasticKV` lives on rank 0 beside the
scheduler: the policy and the block-level protocol; it sends each action to every rank through `dispatch`
(with TP: `runner.call_all("apply_kv_action", action)`, one control broadcast, only on steps that act). The
engine builds both when its config asks for elastic KV (`EngineConfig.elastic`).

Modes: "off" (reserve never lent), "elastic", "static" (reserve committed at start for good: the unsafe
baseline that runs out of memory on a burst of large prefills).

Apart from the mode, `fit_reserve` shrinks the reserve for good while the step budget is below the one it was
sized for (the controller's chunk knob): the blocks a smaller step's activations no longer need become base KV,
and come back (live K/V moved below them) when the budget rises again.
"""
from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass
from typing import Callable, Optional

import numpy as np

from memory.block_manager import BlockManager
from memory.kv_host import ScheduleView
from memory.rank_kv import GRANT, LEND, MODES, RECLAIM, UNGRANT, KVAction

LATENCY_SAMPLES = 1024


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

    def __init__(self, mode: str, block_manager: BlockManager, scheduler: ScheduleView,
                 dispatch: Callable[[KVAction], bool],
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
        self.block_bytes = reserve_bytes / max(1, block_manager.num_reserve)   # one reserve block, all layers
        self.grants: list[int] = []         # blocks of each grant, bottom first (as every rank's RankKV holds them)
        self.grant_refused = 0
        self.mode = "off"
        self.lend_total = self.reclaim_total = self.lend_refused = 0
        self.blocks_migrated = self.preemptions = self.cache_evictions = 0
        self.lend_latencies: deque[float] = deque(maxlen=LATENCY_SAMPLES)      # newest samples, never drained:
        self.reclaim_latencies: deque[float] = deque(maxlen=LATENCY_SAMPLES)   # readers take the last (total - seen)
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

    def fit_reserve(self, target: int) -> None:
        """Make `target` of the reserve's blocks base KV for good: a grant on top of the stack, or whole grants
        given back from its top (then a smaller one granted). A lent reserve is reclaimed first."""
        if self.mode == "static" or target == sum(self.grants):
            return
        if self.bm.reserve_lent:
            self.reclaim()
        while self.grants and sum(self.grants) > target:
            self._ungrant()
        more = target - sum(self.grants)
        if more <= 0:
            return
        if not self.dispatch(KVAction(GRANT, blocks=more)):
            self.grant_refused += 1
            return
        self.bm.grant(more)
        self.grants.append(more)

    def _ungrant(self) -> None:
        """Give the last grant back to the reserve: preempt the newest sequences holding its blocks until the
        live ones fit in the free blocks below it, move them there, and have every rank copy and unmap."""
        bm, n = self.bm, self.grants[-1]
        start = bm.num_base - n
        for seq in reversed(list(self.scheduler.running)):
            live = bm.live_blocks_in(start, bm.num_base)
            if live <= len(bm.free_base) - (n - live):
                break
            if any(b >= start for b in seq.block_table):
                self.scheduler.preempt(seq)
                self.preemptions += 1
        plan = bm.begin_ungrant(n)
        bm.end_ungrant(n, plan, self.scheduler.running)
        self.dispatch(KVAction(UNGRANT, np.fromiter(plan.keys(), np.int64, len(plan)),
                               np.fromiter(plan.values(), np.int64, len(plan))))
        self.grants.pop()
        self.blocks_migrated += len(plan)

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
                sched.preempt(seq)
                n += 1
        return n

    # ---- stats ------------------------------------------------------------------------------
    def fill_stats(self, stats) -> None:
        """Counters and gauges into EngineStats, with the newest latency samples (reading consumes nothing)."""
        stats.elastic_mode = self.mode
        stats.reserve_bytes = int(self.block_bytes * self.bm.num_reserve)
        stats.reserve_lent_bytes = stats.reserve_bytes if self.bm.reserve_lent else 0
        stats.reserve_blocks_total = self.bm.num_reserve
        stats.reserve_granted_blocks = sum(self.grants)
        stats.reserve_blocks_used = len(self.bm.reserve_blocks_in_use())
        stats.lend_total, stats.reclaim_total, stats.lend_refused = \
            self.lend_total, self.reclaim_total, self.lend_refused
        stats.blocks_migrated, stats.elastic_preemptions = self.blocks_migrated, self.preemptions
        stats.reserve_cache_evictions = self.cache_evictions
        stats.lend_latencies, stats.reclaim_latencies = list(self.lend_latencies), list(self.reclaim_latencies)
