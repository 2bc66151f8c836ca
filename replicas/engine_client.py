"""A serving process's side of an engine core (replicas/engine_core.py): it tokenizes prompts (in worker threads,
off the event loop), sends requests and hands each step's outputs to the callers' asyncio queues from one reader
thread. Cancelling a caller aborts its request and frees its blocks.

Two kinds of client share this: `AsyncLLMEngine` (replicas/async_engine.py) starts the core and owns it (its pipes,
its heartbeat, its TP ranks); `RemoteEngine` (replicas/remote_engine.py) is another process's connection to a core
that some AsyncLLMEngine started (an ingress process of a replica). A core that exits, is stuck or goes away makes
the engine dead: every open stream ends with EngineDeadError, and so does every later request. A request past its
deadline is aborted and its stream raises RequestTimeout."""
from __future__ import annotations

import asyncio
import itertools
import logging
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import AsyncIterator, Callable, Optional

from replicas.config import EngineConfig
from replicas.engine_messages import (AbortRequest, AddRequest, ChatPrompt, ClientMessage, CoreDied,
                                      DrainFinishedTimings, EngineCall, EngineInfo, GetStats, Outputs, Prompt,
                                      Reconfigure, Reply, RequestFailed, decode_core_message)
from replicas.outputs import RequestOutput
from replicas.request import EngineStepError, RequestError, check_logit_bias, check_params, check_prompt
from replicas.sampling_params import SamplingParams
from replicas.stats import EngineStats, RequestTimings

log = logging.getLogger(__name__)

__all__ = ["ChatPrompt", "EngineClient", "EngineDeadError", "EngineDraining", "EngineHealth", "EngineStepError",
           "RequestError", "RequestTimeout", "load_tokenizer"]

CALL_TIMEOUT_S = 300.0        # answered between two steps
TOKENIZER_THREADS = 2


class EngineDeadError(RuntimeError):
    """The engine core exited or is stuck: the request cannot be served by this engine."""


class RequestTimeout(TimeoutError):
    """The request passed its deadline; the engine aborted it."""


class EngineDraining(RuntimeError):
    """The server is stopping and its drain period ended before the request did; the engine aborted it."""


@dataclass(frozen=True)
class EngineHealth:
    alive: bool                       # the core runs and serves (not exited, not stuck, not declared dead)
    stuck: bool                       # no sign of life for longer than the watchdog period
    seconds_since_heartbeat: float
    detail: str


class EngineClient:
    """The client's state and its async API. A subclass connects (`_attach`), watches the core's liveness
    (`_watch`, run in a thread), says why the connection ended (`_gone`) and answers `health()` and `shutdown()`."""

    def _attach(self, config: EngineConfig, tokenizer, info: EngineInfo, to_core: Connection,
                from_core: Connection) -> None:
        self.config = config
        self.watchdog_s = config.serving.watchdog_s
        self.tokenizer = tokenizer
        self.info = info
        self.model_name, self.max_model_len = info.model_name, info.max_model_len
        self._to_core, self._from_core = to_core, from_core
        self._send_lock = threading.Lock()
        self._dead_lock = threading.Lock()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._prompts: dict[str, tuple[Optional[str], list[int]]] = {}
        self._calls: dict[int, Future] = {}
        self._call_ids = itertools.count()
        self._error: Optional[EngineDeadError] = None
        self._stuck = False
        self._stopping = False
        self._tokenize_pool = ThreadPoolExecutor(TOKENIZER_THREADS, thread_name_prefix="tidal-tokenize")
        self._stop_watch = threading.Event()
        self._reader = threading.Thread(target=self._read, name="tidal-engine-reader", daemon=True)
        self._reader.start()
        self._watchdog = threading.Thread(target=self._watch, name="tidal-engine-watchdog", daemon=True)
        self._watchdog.start()

    # ---- what a kind of client adds ---------------------------------------------------------------
    def _watch(self) -> None:
        raise NotImplementedError

    def _gone(self) -> EngineDeadError:
        """Why the core's end of the connection closed."""
        raise NotImplementedError

    def _reader_failed(self) -> None:
        """The reader thread failed: nobody reads the core's outputs any more."""
        raise NotImplementedError

    def health(self) -> EngineHealth:
        raise NotImplementedError

    def shutdown(self) -> None:
        raise NotImplementedError

    # ---- the reader thread ----------------------------------------------------------------------------
    def _read(self) -> None:
        try:
            while True:
                match decode_core_message(self._from_core.recv_bytes()):
                    case Outputs(outputs=outputs):
                        self._publish([(out.request_id, self._with_prompt(out)) for out in outputs])
                    case RequestFailed(request_id=rid, error=error):
                        self._publish([(rid, error)])
                    case Reply(call_id=call_id, ok=ok, value=value):
                        fut = self._calls.pop(call_id, None)
                        if fut is not None:
                            fut.set_result(value) if ok else fut.set_exception(value)
                    case CoreDied(reason=reason):
                        self._declare_dead(EngineDeadError(f"the engine core died: {reason}"))
                        return
        except (EOFError, OSError):
            self._declare_dead(EngineDeadError("the engine was shut down") if self._stopping else self._gone())
        except BaseException as e:  # noqa: BLE001 - without this thread no stream would ever end
            log.exception("the engine's reader thread failed")
            self._declare_dead(EngineDeadError(f"the engine's reader failed: {type(e).__name__}: {e}"))
            self._reader_failed()

    def _declare_dead(self, reason: EngineDeadError) -> None:
        """From now on the engine serves nothing: every open stream and pending call ends with `reason`."""
        with self._dead_lock:
            if self._error is not None:
                return
            self._error = reason                # set before the streams are read: a new stream checks it after
        if not self._stopping:                  # registering, so none is missed
            log.error("%s", reason)
        self.fail_streams(reason)
        for call_id in list(self._calls):
            fut = self._calls.pop(call_id, None)
            if fut is not None:
                fut.set_exception(reason)
        self._stop_watch.set()

    def _with_prompt(self, out: RequestOutput) -> RequestOutput:
        """The core sends outputs without their prompt (engine_core.EngineCore.compact): this side kept it."""
        out.prompt, out.prompt_token_ids = self._prompts.get(out.request_id, (None, []))
        return out

    def _publish(self, items: list[tuple[str, object]]) -> None:
        """Hand outputs (or errors) to their streams: one wake-up per event loop per step, not per output."""
        by_loop: dict[asyncio.AbstractEventLoop, list] = {}
        for rid, item in items:
            entry = self._streams.get(rid)
            if entry is not None:
                by_loop.setdefault(entry[0], []).append((entry[1], item))
        for loop, batch in by_loop.items():
            try:
                loop.call_soon_threadsafe(_put_all, batch)
            except RuntimeError:                # that loop was closed; its streams are gone with it
                pass

    def _send(self, msg: ClientMessage) -> None:
        with self._send_lock:
            self._to_core.send(msg)

    def _call(self, call: type[EngineCall], **fields):
        self._check_alive()
        fut: Future = Future()
        call_id = next(self._call_ids)
        self._calls[call_id] = fut
        self._check_alive()                     # died while registering: _declare_dead may have missed it
        try:
            self._send(call(call_id, **fields))
            return fut.result(CALL_TIMEOUT_S)
        finally:
            self._calls.pop(call_id, None)

    def _check_alive(self) -> None:
        if self._error is not None:
            raise self._error

    # ---- tokenization (worker threads) ----------------------------------------------------------
    def _tokenize(self, prompt: Prompt) -> tuple[Optional[str], list[int]]:
        if isinstance(prompt, ChatPrompt):
            return None, self.tokenizer.encode_chat(prompt.messages, add_generation_prompt=True, tools=prompt.tools)
        if isinstance(prompt, str):
            if not prompt:
                raise RequestError("prompt", "the prompt is empty", "empty_prompt")
            return prompt, self.tokenizer.encode(prompt)
        return None, list(prompt)

    # ---- the async API ----------------------------------------------------------------------
    async def generate(self, prompt: Prompt, params: SamplingParams, request_id: str, *,
                       deadline: Optional[float] = None) -> AsyncIterator[RequestOutput]:
        """Every output of the request, one per engine step that touched it."""
        batches = self.generate_batches(prompt, params, request_id, deadline=deadline)
        try:
            async for batch in batches:
                for out in batch:
                    yield out
        finally:
            await batches.aclose()

    async def generate_batches(self, prompt: Prompt, params: SamplingParams, request_id: str, *,
                               deadline: Optional[float] = None,
                               admit: Optional[Callable[[list[int]], None]] = None
                               ) -> AsyncIterator[list[RequestOutput]]:
        """The request's outputs in order, as lists of all that arrived while the consumer was busy: a consumer
        slower than the engine (a network hop per item) gets fewer, larger items instead of falling behind.
        `prompt`: text, token ids, or a `ChatPrompt` (ValueError if the chat template refuses it); it is tokenized
        in a worker thread. `deadline`: an absolute `loop.time()`; past it the request is aborted and the stream
        raises RequestTimeout. `admit`: called with the checked prompt ids right before the request goes to the core,
        on the event loop with no await before the send; what it raises refuses the request (a server's admission
        control). Refusals: RequestError (a 400), EngineDeadError (the engine is down)."""
        self._check_alive()
        if request_id in self._streams:
            raise RequestError("request_id", f"request id {request_id!r} is already in use")
        loop = asyncio.get_running_loop()
        q: asyncio.Queue = asyncio.Queue()
        self._streams[request_id] = (loop, q)
        timer = None
        sent = finished = False
        try:
            self._check_alive()                 # died while registering: _declare_dead may have missed it
            if deadline is not None:
                timer = loop.call_at(deadline, q.put_nowait, RequestTimeout(
                    f"request {request_id!r} passed its deadline"))
            check_params(params, self.config.limits)
            check_logit_bias(params, self.info.vocab_size)
            text, ids = await loop.run_in_executor(self._tokenize_pool, self._tokenize, prompt)
            check_prompt(ids, params, self.max_model_len)
            if deadline is not None and loop.time() >= deadline:
                raise RequestTimeout(f"request {request_id!r} passed its deadline")
            self._check_alive()
            if admit is not None:
                admit(ids)
            self._prompts[request_id] = (text, ids)
            self._send(AddRequest(request_id, ids, params))
            sent = True
            while not finished:
                items = [await q.get()]
                while not q.empty():
                    items.append(q.get_nowait())
                error = next((i for i in items if isinstance(i, BaseException)), None)
                if error is not None:
                    items = items[:items.index(error)]
                if items:
                    finished = items[-1].finished
                    yield items
                if error is not None and not finished:
                    raise error
        finally:
            if timer is not None:
                timer.cancel()
            self._streams.pop(request_id, None)
            self._prompts.pop(request_id, None)
            if sent and not finished:
                self.abort(request_id)

    def fail_streams(self, error: BaseException) -> None:
        """End every open stream with `error` (each generator raises it and aborts its request); by itself this
        leaves the engine serving new requests."""
        self._publish([(rid, error) for rid in list(self._streams)])

    def abort(self, request_id: str) -> None:
        try:
            self._send(AbortRequest(request_id))
        except OSError:                 # the core is gone: nothing left to abort (the reader reports why)
            pass

    def stats(self) -> EngineStats:
        stats = self._call(GetStats)
        stats.bookkeeping.update(client_streams=len(self._streams), client_prompts=len(self._prompts),
                                 client_calls=len(self._calls))
        return stats

    def drain_finished_timings(self) -> list[RequestTimings]:
        return self._call(DrainFinishedTimings)

    def reconfigure(self, max_num_batched_tokens: Optional[int] = None, elastic: Optional[str] = None,
                    speculation: Optional[bool] = None) -> dict:
        return self._call(Reconfigure, max_num_batched_tokens=max_num_batched_tokens, elastic=elastic,
                          speculation=speculation)

    def is_alive(self) -> bool:
        return self.health().alive


def load_tokenizer(config: EngineConfig):
    from replicas.loaders import load_checkpoint
    return load_checkpoint(config.model, config.load_format).tokenizer


def _put_all(batch: list[tuple[asyncio.Queue, object]]) -> None:
    for q, item in batch:
        q.put_nowait(item)
