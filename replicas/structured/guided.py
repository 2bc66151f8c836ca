"""The engine's grammar state: one matcher per constrained sequence, each step's bitmask, accept and resync.

Per step (replicas/engine.py, `LLMEngine._run`), for the constrained sequences that sample in it:
  1. `start(seqs, broken)`, before the forward is launched: the step's bitmask rows. A row the previous step filled
     ahead for the same sequence at the same output length is reused; the other sequences are synced and their
     rows filled on a worker thread. The backend's fill releases the GIL, so it runs while the forward does: on
     CUDA `runner.execute` returns once the forward is enqueued, on CPU torch's kernels run without the GIL.
  2. `token_mask(pending, rows, device)`, after the forward: waits for the rows (by then usually ready) and copies
     them to the logits' device (from pinned memory, asynchronously, on CUDA); the sampler applies it
     (replicas/structured/bitmask.py).
  3. `advance(seqs, tokens)`, right after sampling: on the worker, one batched call advances every matcher by its
     sampled token, then the same matchers' rows are filled ahead into the other host buffer (in a steady decode
     the next step's constrained rows are mostly the same sequences). The fill runs on while the engine appends
     the tokens, emits the outputs, schedules the next step and launches its forward; the next step's
     `token_mask` waits for it.
  4. `finish_advance()`, before the step's outputs leave: waits for the accepts of 3 (not the fill) and returns the
     sequences whose sampled token the grammar refused (their requests fail before that token reaches a client).

Invariant: when a step starts, each matcher has accepted exactly `state.num_tokens` of its sequence's output
tokens. A sequence's output only grows at its end or is cut back to a prefix; a preempted sequence recomputes its KV
and keeps its tokens, so its matcher stands. `sync` rolls a matcher back to its sequence's tokens (or accepts the
ones it has not seen), so whatever changed a sequence's tokens leaves its grammar state right; a row filled ahead
is used only when the count it was filled at is still the sequence's output length. Matchers are touched by one
thread at a time: the worker from `advance` until its fill ahead is done; the engine's thread touches them only in
`start`, after waiting for that fill (the worker is one thread: its tasks run in the order they were submitted).

Two host bitmask buffers alternate: the step's rows are copied to the device from one while the rows of the next
step are filled ahead into the other; a buffer is written again only after the engine read the sampled tokens back
(a sync), so its copy to the device has completed.
"""
from __future__ import annotations

import os
import time
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Optional, Sequence as Seq

import numpy as np
import torch

from replicas.structured.backend import GrammarError, load_backend
from replicas.structured.bitmask import TokenMask, bitmask_words
from replicas.structured.cache import SAMPLES, GrammarCache
from replicas.structured.spec import GrammarSpec
from replicas.transfer import to_device

if TYPE_CHECKING:
    from replicas.sequence import Sequence


class GrammarState:
    """A sequence's matcher and how many of its output tokens the matcher has accepted."""
    __slots__ = ("matcher", "num_tokens")

    def __init__(self, matcher: Any):
        self.matcher, self.num_tokens = matcher, 0


@dataclass
class _Ahead:
    """Rows filled after a step's sampling for the next one: row i of `buffer` is seqs[i]'s (valid where counts[i],
    the output length it was filled at, is not None)."""
    seqs: list
    tokens: list[int]
    buffer: torch.Tensor
    accepted: Future                # (accepted, live) per sequence
    filled: Future                  # the buffer, once its rows are filled
    counts: Optional[list] = None


class GuidedDecoding:
    def __init__(self, backend: str, cache_size: int, tokenizer, vocab_size: int, stop_token_ids: Seq[int],
                 max_rows: int, device: torch.device):
        threads = max(1, min(8, (os.cpu_count() or 2) // 2))
        self.cache = GrammarCache(lambda: load_backend(backend, tokenizer, vocab_size, stop_token_ids, threads),
                                  cache_size)
        self.vocab_size, self.max_rows, self.device = vocab_size, max_rows, torch.device(device)
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="tidal-bitmask")
        self._buffers: list[torch.Tensor] = []
        self._step_buffer = 0                        # index of the buffer the current step's rows are in
        self._ahead: Optional[_Ahead] = None
        self.mask_steps = 0
        self.mask_seconds: deque[float] = deque(maxlen=SAMPLES)

    def compile(self, spec: GrammarSpec) -> Future:
        return self.cache.get(spec)

    def attach(self, seqs: Seq["Sequence"], compiled: Any) -> None:
        """Give each (new) sequence a matcher at the grammar's start."""
        backend = self.cache.backend
        for seq in seqs:
            seq.grammar = GrammarState(backend.new_matcher(compiled))

    def _buffer(self, i: int) -> torch.Tensor:
        if not self._buffers:
            for _ in range(2):
                host = torch.zeros(self.max_rows, bitmask_words(self.vocab_size), dtype=torch.int32)
                self._buffers.append(host.pin_memory() if self.device.type == "cuda" else host)
        return self._buffers[i]

    def start(self, seqs: Seq["Sequence"], broken: list) -> Future:
        """The bitmask rows of `seqs` (the step's constrained sampling sequences, in row order), as a future for
        `token_mask`; a sequence whose tokens its grammar refuses goes to `broken` (its request must fail)."""
        ahead = self._ahead
        if ahead is not None and ahead.counts is None:
            self.finish_advance()                    # a step that raised before finishing: sync checks its tokens
        self._ahead = None
        filled = {} if ahead is None else {id(seq): (row, n) for row, (seq, n) in
                                           enumerate(zip(ahead.seqs, ahead.counts)) if n is not None}
        reuse_src, reuse_dst, fresh_rows = [], [], []
        for row, seq in enumerate(seqs):
            hit = filled.get(id(seq))
            if hit is not None and hit[1] == seq.grammar.num_tokens == seq.num_output_tokens:
                reuse_src.append(hit[0])
                reuse_dst.append(row)
            else:
                fresh_rows.append(row)
        if not fresh_rows and reuse_src == reuse_dst:     # the steady decode: the rows filled ahead, in place
            self._step_buffer = 1 - self._step_buffer
            return ahead.filled
        if ahead is not None:
            ahead.filled.result()                # the worker is done with the matchers
        fresh = []
        for row in fresh_rows:
            seq = seqs[row]
            try:
                self.sync(seq)
            except GrammarError as e:
                broken.append((seq, e))
            fresh.append(seq.grammar.matcher)
        buffer = self._buffer(self._step_buffer)         # the previous step's: not the one holding rows to reuse
        return self._pool.submit(self._fill_step, buffer, len(seqs), ahead.buffer if reuse_src else None,
                                 reuse_src, reuse_dst, fresh, fresh_rows)

    def _fill_step(self, buffer: torch.Tensor, n: int, ahead: Optional[torch.Tensor], reuse_src: list,
                   reuse_dst: list, fresh: list, fresh_rows: list) -> torch.Tensor:
        if reuse_src:
            buffer.index_copy_(0, torch.tensor(reuse_dst), ahead.index_select(0, torch.tensor(reuse_src)))
        if fresh:
            self._fill(fresh, buffer, fresh_rows)
        return buffer[:n]

    def _fill(self, matchers: list, buffer: torch.Tensor, rows: Optional[list] = None) -> None:
        start = time.perf_counter()
        self.cache.backend.fill_bitmask(matchers, buffer, rows)
        self.mask_seconds.append(time.perf_counter() - start)
        self.mask_steps += 1

    def token_mask(self, pending: Future, rows: Seq[int], device) -> TokenMask:
        """The filled bitmask on `device`; `rows` are the sampler batch's rows of the filled sequences."""
        host = pending.result()[:len(rows)]
        return TokenMask(to_device(np.asarray(rows, dtype=np.int64), device), host.to(device, non_blocking=True))

    def advance(self, seqs: Seq["Sequence"], tokens: Seq[int]) -> None:
        """Start advancing each sequence's matcher by its sampled token and filling its next row ahead (on the
        worker); `finish_advance` collects it."""
        matchers, tokens = [seq.grammar.matcher for seq in seqs], list(tokens)
        buffer = self._buffer(1 - self._step_buffer)
        accepted = self._pool.submit(self._accept, matchers, tokens)
        self._ahead = _Ahead(list(seqs), tokens, buffer, accepted,
                             self._pool.submit(self._fill_ahead, matchers, accepted, buffer))

    def _accept(self, matchers: list, tokens: list) -> tuple[list[bool], list[bool]]:
        backend = self.cache.backend
        accepted = backend.accept(matchers, tokens)
        return accepted, [not backend.is_terminated(m) for m in matchers]     # a finished grammar has no next row

    def _fill_ahead(self, matchers: list, accepted: Future, buffer: torch.Tensor) -> torch.Tensor:
        rows = [i for i, on in enumerate(accepted.result()[1]) if on]         # done: submitted before this task
        if rows:
            self._fill([matchers[i] for i in rows], buffer, rows)
        return buffer

    def finish_advance(self) -> list[tuple["Sequence", int]]:
        """Wait for `advance`; (sequence, token) where the grammar refused the sampled token (its matcher
        unchanged)."""
        ahead = self._ahead
        accepted, filled = ahead.accepted.result()
        ahead.counts, refused = [], []
        for seq, token, ok, row in zip(ahead.seqs, ahead.tokens, accepted, filled):
            state = seq.grammar
            state.num_tokens += ok
            ahead.counts.append(state.num_tokens if ok and row else None)
            if not ok:
                refused.append((seq, token))
        return refused

    def sync(self, seq: "Sequence") -> None:
        """Bring the matcher in line with the sequence's output tokens (GrammarError if they do not match)."""
        state, n = seq.grammar, seq.num_output_tokens
        if state.num_tokens > n:
            self.cache.backend.rollback(state.matcher, state.num_tokens - n)
            state.num_tokens = n
        for token in seq.token_ids[seq.num_prompt_tokens + state.num_tokens:]:
            if not self.cache.backend.accept([state.matcher], [token])[0]:
                raise GrammarError(f"token {token} of the output does not match the grammar")
            state.num_tokens += 1

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        self.cache.shutdown()
