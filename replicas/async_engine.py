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
                for out in outputs:
                    self._publish(out)
        except BaseException as e:  # noqa: BLE001 - the loop must report, not vanish
            log.error("engine loop died: %s", traceback.format_exc())
            self._error = e
            for rid in list(self._streams):
                self._publish_error(rid, EngineDeadError(f"engine loop died: {e!r}"))

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
                        self._publish_error(rid, e)
                elif cmd == "abort":
                    self.engine.abort(args[0])
                elif cmd == "call":
                    fn, fut_loop, fut = args
                    try:
                        res = fn()
                        fut_loop.call_soon_threadsafe(_set_result, fut, res)
                    except BaseException as e:  # noqa: BLE001
                        fut_loop.call_soon_threadsafe(_set_exception, fut, e)

    def _publish(self, out: RequestOutput) -> None:
        entry = self._streams.get(out.request_id)
        if entry is not None:
            loop, q = entry
            loop.call_soon_threadsafe(q.put_nowait, out)

    def _publish_error(self, rid: str, err: BaseException) -> None:
        entry = self._streams.get(rid)
        if entry is not None:
            loop, q = entry
            loop.call_soon_threadsafe(q.put_nowait, err)

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

    async def call_in_loop(self, fn):
        """Run `fn()` on the engine thread between steps (runtime knobs, stats)."""
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        self._commands.put(("call", fn, loop, fut))
        self._wake.set()
        return await fut

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


def _set_result(fut: asyncio.Future, res) -> None:
    if not fut.done():
        fut.set_result(res)


def _set_exception(fut: asyncio.Future, e: BaseException) -> None:
    if not fut.done():
        fut.set_exception(e)
