"""The engine's grammar state: one matcher per constrained sequence, each step's bitmask, accept and resync.

Per step (replicas/engine.py, `LLMEngine._run`):
  1. `sync(seq)` for each constrained sequence that samples in the step, then `fill(seqs)`, before the forward
     is launched: a worker thread fills the host bitmask rows of those sequences. The backend's fill releases the
     GIL, so it runs while the forward does: on CUDA `runner.execute` returns once the forward is enqueued (the
     fill overlaps the GPU's work), on CPU torch's kernels run without the GIL (the fill takes the other cores).
  2. `token_mask(pending, rows, device)`, after the forward: waits for the fill (by then usually done) and copies
     the rows to the logits' device (from pinned memory, asynchronously, on CUDA); the sampler applies it
     (replicas/structured/bitmask.py).
  3. `accept(seqs, tokens)`, after sampling: one batched call advances every matcher by its sampled token.

Invariant: when a step starts, each matcher has accepted exactly its sequence's output tokens. A sequence's output
only grows at its end or is cut back to a prefix; a preempted sequence recomputes its KV and keeps its tokens, so
its matcher stands. `sync` checks the count before every fill and rolls the matcher back to the sequence's tokens
(or accepts the ones it has not seen), so whatever changed a sequence's tokens leaves its grammar state right.

The host bitmask buffer is reused every step: the previous step's copy out of it has completed by the time the
next fill starts, because the engine reads the sampled tokens back to the host (a sync) in between.
"""
from __future__ import annotations

import os
import time
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
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


class GuidedDecoding:
    def __init__(self, backend: str, cache_size: int, tokenizer, vocab_size: int, stop_token_ids: Seq[int],
                 max_rows: int, device: torch.device):
        threads = max(1, min(8, (os.cpu_count() or 2) // 2))
        self.cache = GrammarCache(lambda: load_backend(backend, tokenizer, vocab_size, stop_token_ids, threads),
                                  cache_size)
        self.vocab_size, self.max_rows, self.device = vocab_size, max_rows, torch.device(device)
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="tidal-bitmask")
        self._host: Optional[torch.Tensor] = None
        self.mask_steps = 0
        self.mask_seconds: deque[float] = deque(maxlen=SAMPLES)

    def compile(self, spec: GrammarSpec) -> Future:
        return self.cache.get(spec)

    def attach(self, seqs: Seq["Sequence"], compiled: Any) -> None:
        """Give each (new) sequence a matcher at the grammar's start."""
        backend = self.cache.backend
        for seq in seqs:
            seq.grammar = GrammarState(backend.new_matcher(compiled))

    def fill(self, seqs: Seq["Sequence"]) -> Future:
        """Start filling the bitmask rows of `seqs` (in order, each synced) on the worker; `token_mask` collects
        them."""
        if self._host is None:
            host = torch.zeros(self.max_rows, bitmask_words(self.vocab_size), dtype=torch.int32)
            self._host = host.pin_memory() if self.device.type == "cuda" else host
        return self._pool.submit(self._fill, [seq.grammar.matcher for seq in seqs])

    def _fill(self, matchers: list) -> torch.Tensor:
        start = time.perf_counter()
        rows = self._host[:len(matchers)]
        self.cache.backend.fill_bitmask(matchers, rows)
        self.mask_seconds.append(time.perf_counter() - start)
        self.mask_steps += 1
        return rows

    def token_mask(self, pending: Future, rows: Seq[int], device) -> TokenMask:
        """The filled bitmask on `device`; `rows` are the sampler batch's rows of the filled sequences."""
        host = pending.result()
        return TokenMask(to_device(np.asarray(rows, dtype=np.int64), device), host.to(device, non_blocking=True))

    def accept(self, seqs: Seq["Sequence"], tokens: Seq[int]) -> list[bool]:
        """Advance each sequence's matcher by its sampled token; False where the grammar refused it."""
        states = [seq.grammar for seq in seqs]
        accepted = self.cache.backend.accept([s.matcher for s in states], tokens)
        for state, ok in zip(states, accepted):
            state.num_tokens += ok
        return accepted

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
