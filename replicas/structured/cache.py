"""Compiled grammars by spec: a bounded LRU whose compiles run on a worker thread, never on the step loop.

`get(spec)` returns a Future: done at once on a hit, else the compile's (the first one also builds the backend,
which imports the grammar library: about a second). A failed compile stays cached like a good one, so a bad schema
sent again fails at once. Evicting an entry drops only the cache's reference: matchers keep their grammar alive.
Only the engine thread calls `get`; the worker appends to the compile-time samples, which the engine reads.
"""
from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict, deque
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable, Optional

from replicas.structured.backend import GrammarBackend
from replicas.structured.spec import GrammarSpec

SAMPLES = 1000                  # newest compile times kept for the metrics (the recorder takes the new ones)

log = logging.getLogger(__name__)


class GrammarCache:
    def __init__(self, make_backend: Callable[[], GrammarBackend], capacity: int):
        if capacity < 1:
            raise ValueError("the grammar cache needs a capacity of at least 1")
        self.capacity = capacity
        self._make_backend = make_backend
        self._backend: Optional[GrammarBackend] = None
        self._backend_lock = threading.Lock()
        self._entries: OrderedDict[GrammarSpec, Future] = OrderedDict()
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="tidal-grammar")
        self.hits = 0
        self.misses = 0
        self.compiles = 0                                   # finished compiles, good or failed
        self.compile_seconds: deque[float] = deque(maxlen=SAMPLES)

    @property
    def backend(self) -> GrammarBackend:
        """The backend, built on first use (from the worker's first compile, or from here)."""
        with self._backend_lock:
            if self._backend is None:
                start = time.perf_counter()
                self._backend = self._make_backend()
                log.info("grammar backend ready in %.1f s", time.perf_counter() - start)
            return self._backend

    def get(self, spec: GrammarSpec) -> Future:
        """A Future of the compiled grammar (GrammarError if the backend cannot build it)."""
        entry = self._entries.get(spec)
        if entry is not None:
            self._entries.move_to_end(spec)
            self.hits += 1
            return entry
        self.misses += 1
        entry = self._entries[spec] = self._pool.submit(self._compile, spec)
        while len(self._entries) > self.capacity:
            self._entries.popitem(last=False)
        return entry

    def __len__(self) -> int:
        return len(self._entries)

    def _compile(self, spec: GrammarSpec) -> Any:
        backend = self.backend
        start = time.perf_counter()
        try:
            return backend.compile(spec)
        finally:
            self.compile_seconds.append(time.perf_counter() - start)
            self.compiles += 1

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
