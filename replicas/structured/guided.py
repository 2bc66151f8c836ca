"""The engine's grammar state: one matcher per constrained sequence, each step's bitmask, accept and resync.

Per step (replicas/engine.py, `LLMEngine._sample`), for the constrained sequences that sample in it, all on the
engine's thread:
  1. `token_mask(seqs, rows, broken)`, once the forward is launched: each matcher catches up with its sequence's
     tokens (the last step's sampled tokens, accepted here in one backend call), the step's bitmask rows are
     filled into a host buffer and copied to the logits' device (from pinned memory, asynchronously, on CUDA);
     the sampler applies them (replicas/structured/bitmask.py). On CUDA `runner.execute` returns once the
     forward is enqueued, so the accept and the fill run while the device computes; on the CPU the forward has
     already run and they (a few microseconds a row) follow it.
  2. `refused(seqs, tokens)`, right after sampling: each sampled token checked against its row of the host
     bitmask (one vectorised read, no grammar call), so the sequences whose token the grammar does not allow (a
     state that allows no token of the vocabulary) fail before that token reaches a client. Accepting the
     tokens waits for the next step's `token_mask`: between the step's sync and the next launch the device is
     idle, so nothing that can wait for the next forward runs there.

Why not a worker thread: the fill and the accept are short calls that release the GIL, and a thread that must
take the GIL back from the busy step loop waits for it up to the interpreter's switch interval (5 ms), every
time; so a fill on a worker ends up serialised with the loop, plus the hand-offs. On the engine's thread it costs
its own few microseconds a row and nothing else.

Invariant: a matcher has accepted a prefix of its sequence's output tokens, `state.num_tokens` of them. A
sequence's output only grows at its end or is cut back to a prefix; a preempted sequence recomputes its KV and
keeps its tokens, so its matcher stands. `catch_up` rolls a matcher back to its sequence's tokens or accepts the
ones it has not seen (the common case: one token, in one backend call for the step's sequences), so whatever
changed a sequence's tokens leaves its grammar state right before its next row is filled.

One host bitmask buffer serves every step: a step's copy to the device is complete before the next step fills the
buffer again, since the engine reads the step's sampled tokens back (a sync) in between.
"""
from __future__ import annotations

import os
import time
from collections import deque
from concurrent.futures import Future
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

    def _buffer(self) -> torch.Tensor:
        if self._host is None:
            host = torch.zeros(self.max_rows, bitmask_words(self.vocab_size), dtype=torch.int32)
            self._host = host.pin_memory() if self.device.type == "cuda" else host
        return self._host

    def fill(self, seqs: Seq["Sequence"], broken: list) -> torch.Tensor:
        """The host bitmask rows of `seqs`, in order, after each matcher caught up with its sequence; a sequence
        whose tokens its grammar refuses goes to `broken` (its request must fail; its row is filled all the same)."""
        self.catch_up(seqs, broken)
        rows = self._buffer()[:len(seqs)]
        start = time.perf_counter()
        self.cache.backend.fill_bitmask([seq.grammar.matcher for seq in seqs], rows)
        self.mask_seconds.append(time.perf_counter() - start)
        self.mask_steps += 1
        return rows

    def token_mask(self, seqs: Seq["Sequence"], rows: Seq[int], broken: list) -> TokenMask:
        """The bitmask of `seqs` on the engine's device; `rows` are their rows in the sampler batch, ascending."""
        host = self.fill(seqs, broken)
        leading = rows[-1] == len(rows) - 1          # ascending: the last is C - 1 iff 0..C-1
        return TokenMask(None if leading else to_device(np.asarray(rows, dtype=np.int64), self.device),
                         host.to(self.device, non_blocking=True), leading=leading)

    def refused(self, seqs: Seq["Sequence"], tokens: Seq[int]) -> list[tuple["Sequence", int]]:
        """(sequence, token) for each sampled token its row of the last fill does not allow; `seqs` in that fill's
        order. The matchers are untouched: the next fill accepts the tokens."""
        n = len(tokens)
        words = self._buffer()[:n].numpy()[np.arange(n), np.asarray(tokens, dtype=np.int64) >> 5].tolist()
        return [(seq, token) for seq, token, word in zip(seqs, tokens, words) if not (word >> (token & 31)) & 1]

    def catch_up(self, seqs: Seq["Sequence"], broken: list) -> None:
        """Bring every matcher in line with its sequence's output tokens: the ones one token behind in one backend
        `accept` call, the others one by one (`sync`); a sequence whose tokens do not match goes to `broken`."""
        behind, tokens = [], []
        for seq in seqs:
            lag = len(seq.token_ids) - seq.num_prompt_tokens - seq.grammar.num_tokens
            if lag == 1:
                behind.append(seq)
                tokens.append(seq.token_ids[-1])
            elif lag:
                try:
                    self.sync(seq)
                except GrammarError as e:
                    broken.append((seq, e))
        if behind:
            accepted = self.cache.backend.accept([seq.grammar.matcher for seq in behind], tokens)
            for seq, token, ok in zip(behind, tokens, accepted):
                if ok:
                    seq.grammar.num_tokens += 1
                else:
                    broken.append((seq, GrammarError(f"token {token} of the output does not match the grammar")))

    def sync(self, seq: "Sequence") -> None:
        """Bring the matcher in line with the sequence's output tokens (GrammarError if they do not match)."""
        state, n = seq.grammar, seq.num_output_tokens
        if state.num_tokens == n:
            return
        if state.num_tokens > n:
            self.cache.backend.rollback(state.matcher, state.num_tokens - n)
            state.num_tokens = n
        for token in seq.token_ids[seq.num_prompt_tokens + state.num_tokens:]:
            if not self.cache.backend.accept([state.matcher], [token])[0]:
                raise GrammarError(f"token {token} of the output does not match the grammar")
            state.num_tokens += 1

    def shutdown(self) -> None:
        self.cache.shutdown()
