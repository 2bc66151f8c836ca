"""Token-budget scheduler: each step, running sequences then waiting ones share one budget.

A sequence asks for `num_tokens - num_computed_tokens` tokens (capped by the budget): a decode
asks for one, a prefill for a chunk, a recompute after preemption for everything. A waiting sequence is
admitted only when the blocks of its whole prompt (or recompute) are free, and takes them all at admission, so
its later chunks never need a block. Preemption is by recompute, the newest decoding sequence first (a
sequence still prefilling only when no decoding one is left), and a step that preempted admits nobody new.
A sequence whose logits are processed beyond plain sampling's (a grammar or logit_bias) decodes plainly even
when the others draft. With async scheduling, `schedule_ahead` plans the next step before the last one's tokens
reach the host: each running sequence decodes the token still on the device, then waiting ones are admitted.
"""
from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from typing import Optional

from memory.block_manager import BlockManager
from replicas.sequence import Sequence, SequenceStatus


@dataclass
class ScheduledBatch:
    seqs: list[Sequence]
    num_new_tokens: list[int]
    preempted: list[Sequence] = field(default_factory=list)
    drafts: list[int] = field(default_factory=list)   # per sequence: draft-tree nodes verified (0 = plain row)
    ahead: int = 0      # the first rows decode a token still on the device (Scheduler.schedule_ahead)

    def num_drafts(self, i: int) -> int:
        return self.drafts[i] if self.drafts else 0

    @property
    def num_tokens(self) -> int:
        return sum(self.num_new_tokens)

    @property
    def has_prefill(self) -> bool:
        """A row takes more tokens than a decode (one) or a verify (one plus its draft nodes) would."""
        return self.num_tokens > len(self.seqs) + sum(self.drafts)

    @property
    def is_empty(self) -> bool:
        return not self.seqs

    def sampling_rows(self) -> list[int]:
        """The rows whose sequence reaches the end of its known tokens in this step, so it samples one
        (speculative rows sample per tree node instead; rows decoding ahead always sample)."""
        drafts = self.drafts or [0] * len(self.seqs)
        return [i for i, (seq, n, d) in enumerate(zip(self.seqs, self.num_new_tokens, drafts))
                if not d and (i < self.ahead or seq.num_computed_tokens + n == len(seq.token_ids))]


@dataclass(frozen=True)
class Lookahead:
    """What the next step will likely hold, for the elastic KV planner."""
    prefill_tokens: int       # tokens of prompts/recomputes that the next step would take
    num_seqs: int
    decode_seqs: int


class Scheduler:
    def __init__(self, block_manager: BlockManager, max_num_batched_tokens: int, max_num_seqs: int,
                 max_model_len: int):
        self.block_manager = block_manager
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_num_seqs = max_num_seqs
        self.max_model_len = max_model_len
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        self.num_kv_admission_waits = 0   # admissions stopped because the queue's head did not fit in free blocks
        self.spec_budget = 0          # draft nodes per decoding sequence this step (set by the engine)
        self.num_constrained_plain = 0    # decode rows of constrained sequences that would have drafted

    def set_budget(self, max_num_batched_tokens: int) -> None:
        """Takes effect at the next step."""
        if max_num_batched_tokens < 1:
            raise ValueError("max_num_batched_tokens must be >= 1")
        self.max_num_batched_tokens = max_num_batched_tokens

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def preempt(self, seq: Sequence) -> None:
        """A running sequence back to the head of the queue, its blocks freed (it recomputes when readmitted)."""
        self.running.remove(seq)
        self.block_manager.free(seq)
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)

    def schedule(self) -> ScheduledBatch:
        budget = self.max_num_batched_tokens
        seqs: list[Sequence] = []
        counts: list[int] = []
        preempted: list[Sequence] = []
        drafts: list[int] = []
        bm = self.block_manager

        running = list(self.running)
        i = 0
        while i < len(running) and budget > 0:
            seq = running[i]
            d = self._drafts(seq, budget)
            n = 1 + d if d else min(seq.num_uncomputed_tokens, budget)
            needed = bm.blocks_needed(seq, n)       # 0 on most decode steps, and on every prefill chunk
            while needed > bm.num_free_blocks:
                victim = self._victim(running, i)
                running.remove(victim)
                self.preempt(victim)
                preempted.append(victim)
                if victim is seq:
                    break
            else:
                if needed:
                    bm.allocate(seq, n)
                seqs.append(seq)
                counts.append(n)
                drafts.append(d)
                budget -= n
                i += 1

        if not preempted:
            self._admit(seqs, counts, budget)
        return ScheduledBatch(seqs, counts, preempted, drafts + [0] * (len(seqs) - len(drafts)))

    def _admit(self, seqs: list[Sequence], counts: list[int], budget: int, leaving: int = 0) -> None:
        """Waiting sequences join the step (appended to `seqs`, `counts`) while the budget, the sequence limit and
        the blocks of their whole prompts allow. `leaving`: running sequences certain to finish before the step
        runs (not in it), whose places it may already fill."""
        bm = self.block_manager
        while self.waiting and budget > 0 and len(self.running) - leaving < self.max_num_seqs:
            seq = self.waiting[0]
            fresh = not seq.block_table
            if fresh:
                bm.match_prefix(seq)
            n = min(seq.num_uncomputed_tokens, budget)
            if not bm.can_allocate(seq, seq.num_uncomputed_tokens):     # the whole prompt, not just this chunk
                if fresh:
                    bm.unmatch_prefix(seq)             # give back the cache hits; retry next step
                self.num_kv_admission_waits += 1
                break
            self.waiting.popleft()
            if seq.first_scheduled_time is None:
                seq.first_scheduled_time = time.monotonic()
                seq.num_cached_tokens = seq.num_computed_tokens
            bm.allocate(seq, seq.num_uncomputed_tokens)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            seqs.append(seq)
            counts.append(n)
            budget -= n

    def schedule_ahead(self, sampling: set[int]) -> Optional[ScheduledBatch]:
        """The next step while the last one's sampled tokens are still on the device (async scheduling): its first
        `ScheduledBatch.ahead` rows decode, for every running sequence, the token the last step samples for it, at
        position `num_tokens`, whose block it gets here; waiting sequences are admitted after them as in
        `schedule`. `sampling`: id() of each sequence that step samples. None where only a step that knows its
        tokens may follow: a running sequence did not sample (it is prefilling), the budget cannot take every
        decode, or blocks are short (preemption). A sequence whose sampled token will end it by length sits this
        step out, so no row is spent on a token that cannot follow, and a waiting sequence may take its place here
        (its blocks come back only when it finishes: admission counts on the free ones)."""
        if self.spec_budget or len(self.running) > self.max_num_batched_tokens:
            return None
        bm = self.block_manager
        seqs, needed, leaving = [], 0, 0
        for seq in self.running:
            if id(seq) not in sampling:
                return None
            if seq.ends_by_length(self.max_model_len, more=1):
                leaving += 1
                continue
            seqs.append(seq)
            needed += bm.blocks_needed(seq, seq.num_tokens + 1 - seq.num_computed_tokens)
        if needed > bm.num_free_blocks:
            return None
        for seq in seqs:
            bm.allocate(seq, seq.num_tokens + 1 - seq.num_computed_tokens)
        ahead, counts = len(seqs), [1] * len(seqs)
        self._admit(seqs, counts, self.max_num_batched_tokens - ahead, leaving)
        if not seqs:
            return None
        return ScheduledBatch(seqs, counts, drafts=[0] * len(seqs), ahead=ahead)

    @staticmethod
    def _victim(running: list[Sequence], i: int) -> Sequence:
        """Whom to preempt so that running[i] gets its blocks: the newest decoding sequence after it; only when
        there is none, the newest of all (a sequence still prefilling, or running[i] itself). A prefill holds its
        whole prompt's blocks from admission, so preempting it would free much and throw away work that the
        decode's one block does not need: under KV pressure a chunked long prompt preempted by every decode that
        grows would restart without end."""
        for j in range(len(running) - 1, i, -1):
            if running[j].num_uncomputed_tokens <= 1:
                return running[j]
        return running[-1]

    def _drafts(self, seq: Sequence, budget: int) -> int:
        """A decoding sequence (past its first sampled token) verifies `spec_budget` draft nodes after its root,
        in slots root .. root + spec_budget of its own table, if the token budget, free blocks and the context
        length allow all of them; otherwise it decodes plainly."""
        d = self.spec_budget
        if (d == 0 or seq.num_uncomputed_tokens != 1 or seq.num_output_tokens < 1 or 1 + d > budget
                or seq.num_tokens + d > self.max_model_len or not self.block_manager.can_allocate(seq, 1 + d)):
            return 0
        if seq.params.constrained:
            self.num_constrained_plain += 1
            return 0
        return d

    def lookahead(self) -> Lookahead:
        """The next step's prefill demand: unfinished prompts/recomputes of running and waiting sequences."""
        budget = self.max_num_batched_tokens
        decodes = sum(1 for s in self.running if s.num_uncomputed_tokens <= 1)
        prefill = sum(s.num_uncomputed_tokens for s in self.running if s.num_uncomputed_tokens > 1)
        prefill += sum(s.num_uncomputed_tokens for s in self.waiting)
        prefill = min(prefill, max(0, budget - decodes))
        return Lookahead(prefill, len(self.running) + len(self.waiting), decodes)

    def finish(self, seq: Sequence, reason: str, stop_reason=None) -> None:
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason, seq.stop_reason = reason, stop_reason
        if seq in self.running:
            self.running.remove(seq)
        else:
            try:
                self.waiting.remove(seq)
            except ValueError:
                pass
        self.block_manager.free(seq)
