"""The engine for the server: the step loop runs on its own thread; async callers add requests and
await a per-request queue of outputs. Cancelling a caller aborts its request and frees its blocks."""
from __future__ import annotations

import asyncio
import logging
import queue
import threading
import traceback
from typing import AsyncIterator, Optional

from replicas.config import EngineConfig
from replicas.engine import LLMEngine, Prompt
from replicas.outputs import RequestOutput
from replicas.request import RequestError
from replicas.sampling_params import SamplingParams
from replicas.stats import EngineStats, RequestTimings

log = logging.getLogger(__name__)

__all__ = ["AsyncLLMEngine", "RequestError"]


class EngineDeadError(RuntimeError):
    pass


class AsyncLLMEngine:
    def __init__(self, config: EngineConfig, worker_launcher=None):
        self.engine = LLMEngine(config, worker_launcher)
        self.tokenizer = self.engine.tokenizer
        self.model_name = self.engine.model_name
        self.max_model_len = self.engine.max_model_len
        self._commands: queue.Queue = queue.Queue()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._wake = threading.Event()
        self._stop = False
        self._error: Optional[BaseException] = None
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._loop, name="tidal-engine", daemon=True)
        self._thread.start()

    # ---- the loop thread --------------------------------------------------------------------
    def _loop(self) -> None:
        try:
            while not self._stop:
                self._drain_commands()
                if not self.engine.has_unfinished:
                    self._wake.wait(timeout=0.5)
                    self._wake.clear()
                    continue
                with self._lock:
                    outputs = self.engine.step()
                self._publish([(out.request_id, out) for out in outputs])
        except BaseException as e:  # noqa: BLE001 - the loop must report, not vanish
            log.error("engine loop died: %s", traceback.format_exc())
            self._error = e
            self._publish([(rid, EngineDeadError(f"engine loop died: {e!r}")) for rid in list(self._streams)])

    def _drain_commands(self) -> None:
        while True:
            try:
                cmd, *args = self._commands.get_nowait()
            except queue.Empty:
                return
            with self._lock:
                if cmd == "add":
                    rid, prompt, params = args
                    try:
                        self.engine.add_request(rid, prompt, params)
                    except RequestError as e:
                        self._publish([(rid, e)])
                elif cmd == "abort":
                    self.engine.abort(args[0])

    def _publish(self, items: list[tuple[str, object]]) -> None:
        """Hand outputs (or errors) to their streams: one wake-up per event loop per step, not per output."""
        by_loop: dict[asyncio.AbstractEventLoop, list] = {}
        for rid, item in items:
            entry = self._streams.get(rid)
            if entry is not None:
                by_loop.setdefault(entry[0], []).append((entry[1], item))
        for loop, batch in by_loop.items():
            loop.call_soon_threadsafe(_put_all, batch)

    # ---- the async API ----------------------------------------------------------------------
    async def generate(self, prompt: Prompt, params: SamplingParams, request_id: str) -> AsyncIterator[RequestOutput]:
        """Every output of the request, one per engine step that touched it."""
        batches = self.generate_batches(prompt, params, request_id)
        try:
            async for batch in batches:
                for out in batch:
                    yield out
        finally:
            await batches.aclose()

    async def generate_batches(self, prompt: Prompt, params: SamplingParams,
                               request_id: str) -> AsyncIterator[list[RequestOutput]]:
        """The request's outputs in order, as lists of all that arrived while the consumer was busy: a consumer
        slower than the engine (a network hop per item) gets fewer, larger items instead of falling behind."""
        if self._error is not None:
            raise EngineDeadError(f"engine loop died: {self._error!r}")
        if request_id in self._streams:
            raise RequestError("request_id", f"request id {request_id!r} is already in use")
        q: asyncio.Queue = asyncio.Queue()
        self._streams[request_id] = (asyncio.get_running_loop(), q)
        self._commands.put(("add", request_id, prompt, params))
        self._wake.set()
        finished = False
        try:
            while not finished:
                items = [await q.get()]
                while not q.empty():
                    items.append(q.get_nowait())
                for item in items:
                    if isinstance(item, BaseException):
                        raise item
                finished = items[-1].finished
                yield items
        finally:
            self._streams.pop(request_id, None)
            if not finished:
                self.abort(request_id)

    def abort(self, request_id: str) -> None:
        self._commands.put(("abort", request_id))
        self._wake.set()

    def stats(self) -> EngineStats:
        with self._lock:
            return self.engine.get_stats()

    def drain_finished_timings(self) -> list[RequestTimings]:
        with self._lock:
            out, self.engine.finished_timings = self.engine.finished_timings, []
            return out

    def reconfigure(self, max_num_batched_tokens: Optional[int] = None, elastic: Optional[str] = None,
                    speculation: Optional[bool] = None) -> dict:
        with self._lock:
            return self.engine.reconfigure(max_num_batched_tokens=max_num_batched_tokens, elastic=elastic,
                                           speculation=speculation)

    def is_alive(self) -> bool:
        return self._thread.is_alive() and self._error is None

    def shutdown(self) -> None:
        self._stop = True
        self._wake.set()
        self._thread.join(timeout=30)
        self.engine.shutdown()


def _put_all(batch: list[tuple[asyncio.Queue, object]]) -> None:
    for q, item in batch:
        q.put_nowait(item)
