"""The engine for the server. The step loop runs in an engine core process (replicas/engine_core.py); this
side sends requests and hands each step's outputs to the callers' asyncio queues from one reader thread.
Cancelling a caller aborts its request and frees its blocks."""
from __future__ import annotations

import asyncio
import itertools
import logging
import multiprocessing as mp
import threading
from concurrent.futures import Future
from typing import AsyncIterator, Optional

from replicas.config import EngineConfig
from replicas.distributed.launch import ProcessLauncher, WorkerLauncher, free_port
from replicas.engine_core import run_engine_core
from replicas.engine_messages import (AbortRequest, AddRequest, ChatPrompt, ClientMessage, CoreDied,
                                      DrainFinishedTimings, EngineCall, EngineInfo, GetStats, Outputs, Prompt,
                                      Ready, Reconfigure, Reply, RequestFailed, Shutdown)
from replicas.outputs import RequestOutput
from replicas.request import RequestError
from replicas.sampling_params import SamplingParams
from replicas.stats import EngineStats, RequestTimings

log = logging.getLogger(__name__)

__all__ = ["AsyncLLMEngine", "ChatPrompt", "EngineDeadError", "RequestError"]

START_TIMEOUT_S = 1800.0      # loading and profiling a large model
CALL_TIMEOUT_S = 300.0        # answered between two steps


class EngineDeadError(RuntimeError):
    pass


class AsyncLLMEngine:
    def __init__(self, config: EngineConfig, worker_launcher: Optional[WorkerLauncher] = None):
        self.config = config
        tp = config.tensor_parallel_size
        init_method = f"tcp://127.0.0.1:{free_port()}" if tp > 1 else None
        # Ranks 1..TP-1 are started from here: the Ray launcher needs this (Ray worker) process.
        self.launcher = worker_launcher or (ProcessLauncher() if tp > 1 else None)
        for rank in range(1, tp):
            self.launcher.launch(config, rank, tp, init_method)
        ctx = mp.get_context("spawn")
        core_in, self._to_core = ctx.Pipe(duplex=False)            # Pipe(duplex=False) is (reader, writer)
        self._from_core, core_out = ctx.Pipe(duplex=False)
        self._proc = ctx.Process(target=run_engine_core, args=(config, init_method, core_in, core_out),
                                 name="tidal-engine-core", daemon=True)
        self._proc.start()
        core_in.close()
        core_out.close()
        self.info = self._wait_ready()
        self.model_name, self.max_model_len = self.info.model_name, self.info.max_model_len
        self._send_lock = threading.Lock()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._prompts: dict[str, tuple[Optional[str], list[int]]] = {}
        self._calls: dict[int, Future] = {}
        self._call_ids = itertools.count()
        self._error: Optional[BaseException] = None
        self._stopping = False
        self._reader = threading.Thread(target=self._read, name="tidal-engine-reader", daemon=True)
        self._reader.start()

    def _wait_ready(self) -> EngineInfo:
        if not self._from_core.poll(START_TIMEOUT_S):
            self._proc.kill()
            raise RuntimeError(f"the engine core did not start within {START_TIMEOUT_S:.0f} s")
        try:
            msg = self._from_core.recv()
        except EOFError:
            self._proc.join(5)
            raise RuntimeError(f"the engine core exited while starting (exit code {self._proc.exitcode})") from None
        match msg:
            case Ready(info=info):
                return info
            case CoreDied(traceback=tb):
                self._proc.join(30)
                raise RuntimeError(f"the engine core failed to start:\n{tb}")
            case _:
                self._proc.kill()
                raise RuntimeError(f"the engine core sent {type(msg).__name__} before Ready")

    # ---- the reader thread --------------------------------------------------------------------
    def _read(self) -> None:
        try:
            while True:
                match self._from_core.recv():
                    case Outputs(outputs=outputs):
                        self._publish([(out.request_id, self._with_prompt(out)) for out in outputs])
                    case RequestFailed(request_id=rid, error=error):
                        self._publish([(rid, error)])
                    case Reply(call_id=call_id, ok=ok, value=value):
                        fut = self._calls.pop(call_id, None)
                        if fut is not None:
                            fut.set_result(value) if ok else fut.set_exception(value)
                    case CoreDied(traceback=tb):
                        raise EngineDeadError(f"engine core died:\n{tb}")
        except (EOFError, OSError, EngineDeadError) as e:
            if self._stopping and not isinstance(e, EngineDeadError):
                return                                  # the core closed its end after a shutdown
            reason = e if isinstance(e, EngineDeadError) else EngineDeadError(
                f"the engine core process exited (exit code {self._proc.exitcode})")
            log.error("%s", reason)
            self._error = reason
            self._publish([(rid, reason) for rid in list(self._streams)])
            for fut in list(self._calls.values()):
                fut.set_exception(reason)
            self._calls.clear()

    def _with_prompt(self, out: RequestOutput) -> RequestOutput:
        """Prompt ids come with a request's first output only (engine_core.EngineCore.compact)."""
        if out.prompt_token_ids is None:
            out.prompt, out.prompt_token_ids = self._prompts.get(out.request_id, (None, []))
        elif not out.finished:
            self._prompts[out.request_id] = (out.prompt, out.prompt_token_ids)
        if out.finished:
            self._prompts.pop(out.request_id, None)
        return out

    def _publish(self, items: list[tuple[str, object]]) -> None:
        """Hand outputs (or errors) to their streams: one wake-up per event loop per step, not per output."""
        by_loop: dict[asyncio.AbstractEventLoop, list] = {}
        for rid, item in items:
            entry = self._streams.get(rid)
            if entry is not None:
                by_loop.setdefault(entry[0], []).append((entry[1], item))
        for loop, batch in by_loop.items():
            loop.call_soon_threadsafe(_put_all, batch)

    def _send(self, msg: ClientMessage) -> None:
        with self._send_lock:
            self._to_core.send(msg)

    def _call(self, call: type[EngineCall], **fields):
        if self._error is not None:
            raise self._error
        fut: Future = Future()
        call_id = next(self._call_ids)
        self._calls[call_id] = fut
        self._send(call(call_id, **fields))
        return fut.result(CALL_TIMEOUT_S)

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
        slower than the engine (a network hop per item) gets fewer, larger items instead of falling behind.
        `prompt` may be a `ChatPrompt`: the core applies the chat template (ValueError if it refuses)."""
        if self._error is not None:
            raise self._error
        if request_id in self._streams:
            raise RequestError("request_id", f"request id {request_id!r} is already in use")
        q: asyncio.Queue = asyncio.Queue()
        self._streams[request_id] = (asyncio.get_running_loop(), q)
        self._send(AddRequest(request_id, prompt, params))
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
        self._prompts.pop(request_id, None)
        try:
            self._send(AbortRequest(request_id))
        except OSError:                 # the core is gone: nothing left to abort (the reader reports why)
            pass

    def stats(self) -> EngineStats:
        return self._call(GetStats)

    def drain_finished_timings(self) -> list[RequestTimings]:
        return self._call(DrainFinishedTimings)

    def reconfigure(self, max_num_batched_tokens: Optional[int] = None, elastic: Optional[str] = None,
                    speculation: Optional[bool] = None) -> dict:
        return self._call(Reconfigure, max_num_batched_tokens=max_num_batched_tokens, elastic=elastic,
                          speculation=speculation)

    def is_alive(self) -> bool:
        return self._proc.is_alive() and self._error is None

    def shutdown(self) -> None:
        """Stop the core (it shuts its ranks' group down), then the ranks' launcher."""
        if self._proc.is_alive() and self._error is None:
            self._stopping = True
            try:
                self._send(Shutdown())
            except OSError:
                pass
        self._proc.join(60)
        if self._proc.is_alive():
            log.warning("the engine core did not stop within 60 s; killing it")
            self._proc.kill()
            self._proc.join(5)
        self._reader.join(5)
        self._to_core.close()
        if self.launcher is not None:
            self.launcher.shutdown()


def _put_all(batch: list[tuple[asyncio.Queue, object]]) -> None:
    for q, item in batch:
        q.put_nowait(item)
