"""The engine core: `LLMEngine`'s step loop in a process of its own, fed and drained over two pipes.

A serving process spends its CPU on HTTP, Ray messages and asyncio. Run in the same process, the step loop and
that work share one GIL: every engine step delays the token stream, and every streamed token delays the next
step (bench.serve_overhead measures what that costs). Here the loop owns its interpreter; the serving process
(`replicas.async_engine.AsyncLLMEngine`) only sends requests and fans the step outputs out to its streams.

Messages (replicas/engine_messages.py), one class per kind; client -> core pickled, core -> client as
`encode_core_message` bytes (a step's Outputs as msgpack):
  client -> core:  AddRequest | AbortRequest | GetStats | DrainFinishedTimings | Reconfigure | OpenEndpoint | Ping |
                   Shutdown
  core -> client:  Ready(EngineInfo) | Outputs([RequestOutput]) | RequestFailed(request_id, error) |
                   Reply(call_id, ok, value) | CoreDied(reason)
The core answers each call (GetStats, DrainFinishedTimings, Reconfigure, OpenEndpoint, Ping) with one Reply between
two steps, to the client that made it. After `OpenEndpoint` it also serves clients over TCP
(replicas/core_endpoint.py, replicas/remote_engine.py): each gets Ready, then the outputs of its own requests; one
that leaves has its requests aborted. The owner's pipe closing ends the core.
Prompts arrive as token ids (the client tokenizes them) and outputs leave without them (the client keeps them).
With `EngineConfig.serving.stream_item_ms` set, each of the n requests a step touched reports at most every (n - 1) x
that, an output carrying everything new (replicas/stream_coalescer.py); its first and last outputs go at once.

Liveness: the core writes the monotonic time into the shared `heartbeat` before and after every step and at least
every IDLE_BEAT_S while it waits for input; the client's watchdog reads it. Failures: a request the engine cannot
take, or that the engine ended with an error (its own failure, or a failed step: replicas/engine.py), gets a
RequestFailed and the core goes on. Any other error ends the core: CoreDied carries a one-line reason, and the
traceback goes to this process's log.
"""
from __future__ import annotations

import logging
import multiprocessing.util
import os
import sys
import time
from multiprocessing.connection import Connection, wait
from typing import Optional

from replicas.config import EngineConfig
from replicas.core_endpoint import CoreEndpoint, PipeClient, SocketClient
from replicas.distributed.launch import LaunchedRanks
from replicas.engine_messages import (AbortRequest, AddRequest, ChatPrompt, ClientMessage, CoreAddress, CoreDied,
                                      DrainFinishedTimings, EngineInfo, GetStats, OpenEndpoint, Outputs, Ping,
                                      Prompt, Ready, Reconfigure, Reply, RequestFailed, Shutdown,
                                      encode_core_message)
from replicas.outputs import RequestOutput
from replicas.request import RequestError
from replicas.startup_heap import freeze_startup_heap

__all__ = ["ChatPrompt", "EngineCore", "EngineInfo", "IDLE_BEAT_S", "Prompt", "portable_error", "run_engine_core"]

log = logging.getLogger(__name__)

IDLE_BEAT_S = 0.5             # the longest the heartbeat goes unwritten while the core waits for input
PENDING_RETRY_S = 0.002       # while a client has unsent output, the idle core retries at least this often


def portable_error(e: BaseException) -> BaseException:
    """An exception the client can unpickle, with no traceback in its text: RequestError pickles itself and
    EngineStepError and plain ValueError / RuntimeError pickle as they are; other ValueErrors keep their message and
    type family (the replica maps ValueError to HTTP 400); anything else becomes a RuntimeError naming it."""
    from replicas.request import EngineStepError, RequestError
    if isinstance(e, (RequestError, EngineStepError)) or type(e) in (ValueError, RuntimeError):
        return e
    if isinstance(e, ValueError):
        return ValueError(str(e))
    return RuntimeError(f"{type(e).__name__}: {e}")


class EngineCore:
    def __init__(self, engine, inputs: Connection, outputs: Connection, heartbeat=None, info: EngineInfo = None):
        """heartbeat: a shared double (multiprocessing.Value("d")) the core keeps at the monotonic time of its
        last sign of life. info: what every client learns first (Ready)."""
        self.engine = engine
        self.owner = PipeClient(inputs, outputs)
        self.heartbeat = heartbeat
        self.info = info
        self.stopping = False
        self.endpoint: Optional[CoreEndpoint] = None
        self.remotes: list[SocketClient] = []
        self.remote_requests: dict[str, SocketClient] = {}     # requests of clients other than the owner

    def beat(self) -> None:
        if self.heartbeat is not None:
            self.heartbeat.value = time.monotonic()

    def run(self) -> None:
        engine = self.engine
        while not self.stopping:
            self.beat()
            if not engine.has_unfinished:
                # Idle: wait for a message (or a client's end closing), beating while nothing comes.
                while not self.wait_input(IDLE_BEAT_S):
                    self.beat()
            self.receive()
            if self.stopping:
                return
            if engine.has_unfinished:
                self.beat()
                outputs = engine.step()
                self.beat()
                if outputs:
                    self.deliver(self.compact(outputs))
            for rid, error in engine.take_failed():
                self.send(self.client_of(rid, forget=True), RequestFailed(rid, portable_error(error)))

    # ---- clients ----------------------------------------------------------------------------------
    def wait_input(self, timeout: float) -> bool:
        if self.endpoint is None:
            return self.owner.conn.poll(timeout)
        if any(c.pending for c in self.remotes):        # idle with unsent output: retry it every few ms
            timeout = min(timeout, PENDING_RETRY_S)
            for c in self.remotes:
                c.flush()
        return bool(wait([self.owner.conn, self.endpoint, *(c.conn for c in self.remotes)], timeout))

    def receive(self) -> None:
        """Handle every message that has arrived, the owner's first; take clients that connected."""
        if self.endpoint is None:
            while self.owner.conn.poll(0):
                self.handle(self.owner, self.owner.conn.recv())
                if self.stopping:
                    return
            return
        ready = set(wait([self.owner.conn, self.endpoint, *(c.conn for c in self.remotes)], 0))
        while self.owner.conn.poll(0):
            self.handle(self.owner, self.owner.conn.recv())
            if self.stopping:
                return
        if self.endpoint in ready:
            for client in self.endpoint.take():
                self.remotes.append(client)
                self.send(client, Ready(self.info))
        for client in [c for c in self.remotes if c.conn in ready]:
            try:
                while client.conn.poll(0):
                    self.handle(client, client.conn.recv())
                    if client.closed:
                        break
            except (EOFError, OSError):
                self.drop(client)
            except Exception:  # noqa: BLE001 - a client that sends what the core cannot read leaves, the core stays
                log.exception("engine client %s sent a message the core cannot handle; dropping it", client.name)
                self.drop(client)

    def drop(self, client: SocketClient) -> None:
        """A client left (or fell behind): its requests are aborted, their blocks freed at once."""
        if client in self.remotes:
            self.remotes.remove(client)
        for rid in [rid for rid, c in self.remote_requests.items() if c is client]:
            del self.remote_requests[rid]
            self.engine.abort(rid)
        client.close()

    def client_of(self, request_id: str, forget: bool = False):
        if not self.remote_requests:
            return self.owner
        return (self.remote_requests.pop(request_id, self.owner) if forget else
                self.remote_requests.get(request_id, self.owner))

    def send(self, client, msg) -> None:
        client.send(encode_core_message(msg))

    def deliver(self, outputs: list[RequestOutput]) -> None:
        """One Outputs message per client that has outputs in this step."""
        remote = self.remote_requests
        if not remote:
            self.owner.send(encode_core_message(Outputs(outputs)))
            return
        groups: dict[int, tuple] = {}
        for out in outputs:
            rid = out.request_id
            client = (remote.pop(rid, None) if out.finished else remote.get(rid)) or self.owner
            group = groups.get(id(client))
            if group is None:
                groups[id(client)] = group = (client, [])
            group[1].append(out)
        for client, outs in groups.values():
            client.send(encode_core_message(Outputs(outs)))
        for client in self.remotes:
            if client.pending:                              # behind: what it did not take goes out now if it can
                client.flush()
        for client in [c for c in self.remotes if c.closed]:
            self.drop(client)

    # ---- messages ---------------------------------------------------------------------------------
    def handle(self, client, msg: ClientMessage) -> None:
        match msg:
            case AddRequest():
                self.add(client, msg)
            case AbortRequest(request_id=rid):
                if self.client_of(rid) is client:           # a client aborts only its own requests
                    self.remote_requests.pop(rid, None)
                    self.engine.abort(rid)
            case GetStats(call_id=call_id):
                self.answer(client, call_id, self.engine.get_stats)
            case DrainFinishedTimings(call_id=call_id):
                self.answer(client, call_id, self.engine.drain_finished_timings)
            case Reconfigure(call_id=call_id):
                self.answer(client, call_id, lambda: self.engine.reconfigure(
                    max_num_batched_tokens=msg.max_num_batched_tokens, elastic=msg.elastic,
                    speculation=msg.speculation))
            case OpenEndpoint(call_id=call_id, host=host):
                self.answer(client, call_id, lambda: self.open_endpoint(host))
            case Ping(call_id=call_id):
                self.answer(client, call_id, lambda: True)
            case Shutdown() if client.remote:
                self.drop(client)
            case Shutdown():
                self.stopping = True
            case _:
                raise TypeError(f"unknown engine core message {msg!r}")

    def add(self, client, msg: AddRequest) -> None:
        rid = msg.request_id
        try:
            if client.remote:
                if rid in self.remote_requests or rid in self.engine.requests:
                    raise RequestError("request_id", f"request id {rid!r} is already running")
                self.remote_requests[rid] = client
            self.engine.add_request(rid, msg.prompt_token_ids, msg.params)
        except Exception as e:  # noqa: BLE001 - one request's failure is that request's, never the core's
            if client.remote and self.remote_requests.get(rid) is client and rid not in self.engine.requests:
                del self.remote_requests[rid]
            if not isinstance(e, ValueError):
                log.error("request %s could not be added", rid, exc_info=True)
            self.send(client, RequestFailed(rid, portable_error(e)))

    def answer(self, client, call_id: int, call) -> None:
        try:
            self.send(client, Reply(call_id, True, call()))
        except Exception as e:  # noqa: BLE001 - a failed call (or an unpicklable value) is the caller's error
            self.send(client, Reply(call_id, False, portable_error(e)))

    def open_endpoint(self, host: str) -> CoreAddress:
        if self.endpoint is None:
            self.endpoint = CoreEndpoint(host)
            log.info("engine core accepts clients at %s:%d", host, self.endpoint.address.port)
        return self.endpoint.address

    def close(self) -> None:
        for client in list(self.remotes):
            self.drop(client)
        if self.endpoint is not None:
            self.endpoint.close()

    @staticmethod
    def compact(outputs: list[RequestOutput]) -> list[RequestOutput]:
        """The client has every request's prompt: outputs cross the pipe without it."""
        for out in outputs:
            out.prompt, out.prompt_token_ids = None, None
        return outputs


def run_engine_core(config: EngineConfig, init_method: Optional[str], inputs: Connection,
                    outputs: Connection, heartbeat=None) -> None:
    """The core process's whole life, which ends in here. Ranks 1..TP-1, if any, were started by the client at
    `init_method`."""
    from replicas.engine import LLMEngine
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    engine = core = None
    exit_code = 0
    try:
        launcher = LaunchedRanks(init_method) if config.tensor_parallel_size > 1 else None
        engine = LLMEngine(config, worker_launcher=launcher)
        bm = engine.block_manager
        info = EngineInfo(engine.model_name, engine.max_model_len, engine.vocab_size, bm.num_base * bm.block_size,
                          engine.elastic is not None)
        core = EngineCore(engine, inputs, outputs, heartbeat, info)
        core.beat()
        freeze_startup_heap()
        core.send(core.owner, Ready(info))
        core.run()
    except (EOFError, BrokenPipeError, ConnectionResetError):
        log.warning("the serving process went away; the engine core stops")
    except BaseException as e:  # noqa: BLE001 - the client must learn why, not just see the pipe close
        exit_code = 1
        log.error("engine core died", exc_info=True)
        try:
            outputs.send_bytes(encode_core_message(CoreDied(f"{type(e).__name__}: {e}")))
        except OSError:
            pass
    finally:
        if core is not None:
            core.close()
        if engine is not None:
            engine.shutdown()
        outputs.close()
    # Nothing of the core outlives it, so the interpreter's own exit is skipped: its final garbage collection over
    # the model's objects takes seconds, which a stopping replica (and `tidal serve`'s shutdown) would wait out.
    # What multiprocessing's exit would do still runs (its finalizers unlink shared semaphores, e.g. tqdm's).
    multiprocessing.util._exit_function()
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(exit_code)

