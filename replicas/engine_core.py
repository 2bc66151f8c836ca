"""The engine core: `LLMEngine`'s step loop in a process of its own, fed and drained over two pipes.

A serving process spends its CPU on HTTP, Ray messages and asyncio. Run in the same process, the step loop and
that work share one GIL: every engine step delays the token stream, and every streamed token delays the next
step (measured on the H200: +19 ms TTFT at one stream, a sixth of the engine's throughput at 64 streams). Here
the loop owns its interpreter; the serving process (`replicas.async_engine.AsyncLLMEngine`) only sends requests
and fans the step outputs out to its streams.

Messages (replicas/engine_messages.py), one class per kind, pickled over the pipes:
  client -> core:  AddRequest | AbortRequest | GetStats | DrainFinishedTimings | Reconfigure | Shutdown
  core -> client:  Ready(EngineInfo) | Outputs([RequestOutput]) | RequestFailed(request_id, error) |
                   Reply(call_id, ok, value) | CoreDied(traceback)
The core answers each call (GetStats, DrainFinishedTimings, Reconfigure) with one Reply between two steps.
A request's prompt ids travel with its first output only (the client keeps them for the later ones). With
`EngineConfig.serving.stream_item_ms` set, each of n requests reports at most every (n - 1) x that, an output
carrying everything new (replicas/stream_coalescer.py); its first and last outputs go at once.
"""
from __future__ import annotations

import logging
import traceback
from multiprocessing.connection import Connection
from typing import Optional

from replicas.config import EngineConfig
from replicas.distributed.launch import LaunchedRanks
from replicas.engine_messages import (AbortRequest, AddRequest, ChatPrompt, ClientMessage, CoreDied,
                                      DrainFinishedTimings, EngineInfo, GetStats, Outputs, Prompt, Ready,
                                      Reconfigure, Reply, RequestFailed, Shutdown)
from replicas.outputs import RequestOutput

__all__ = ["ChatPrompt", "EngineCore", "EngineInfo", "Prompt", "portable_error", "run_engine_core"]

log = logging.getLogger(__name__)


def portable_error(e: BaseException) -> BaseException:
    """An exception the client can unpickle: RequestError pickles itself; other ValueErrors keep their message and
    type family (the replica maps ValueError to HTTP 400); anything else becomes a RuntimeError naming it."""
    from replicas.request import RequestError
    if isinstance(e, RequestError) or type(e) is ValueError:
        return e
    if isinstance(e, ValueError):
        return ValueError(str(e))
    return RuntimeError(f"{type(e).__name__}: {e}")


class EngineCore:
    def __init__(self, engine, inputs: Connection, outputs: Connection):
        self.engine = engine
        self.inputs, self.outputs = inputs, outputs
        self.prompt_sent: set[str] = set()
        self.stopping = False

    def run(self) -> None:
        engine = self.engine
        while not self.stopping:
            busy = engine.has_unfinished
            # Idle: block until a message (or the client's end closing) arrives; busy: take what is there.
            while self.inputs.poll(0 if busy else None):
                self.handle(self.inputs.recv())
                if self.stopping:
                    return
                busy = True
            if engine.has_unfinished:
                outputs = engine.step()
                if outputs:
                    self.outputs.send(Outputs(self.compact(outputs)))

    def handle(self, msg: ClientMessage) -> None:
        match msg:
            case AddRequest():
                self.add(msg)
            case AbortRequest(request_id=rid):
                self.engine.abort(rid)
                self.prompt_sent.discard(rid)
            case GetStats(call_id=call_id):
                self.answer(call_id, self.engine.get_stats)
            case DrainFinishedTimings(call_id=call_id):
                self.answer(call_id, self.engine.drain_finished_timings)
            case Reconfigure(call_id=call_id):
                self.answer(call_id, lambda: self.engine.reconfigure(
                    max_num_batched_tokens=msg.max_num_batched_tokens, elastic=msg.elastic,
                    speculation=msg.speculation))
            case Shutdown():
                self.stopping = True
            case _:
                raise TypeError(f"unknown engine core message {msg!r}")

    def add(self, msg: AddRequest) -> None:
        prompt = msg.prompt
        try:
            if isinstance(prompt, ChatPrompt):
                prompt = self.engine.tokenizer.encode_chat(prompt.messages, add_generation_prompt=True)
            self.engine.add_request(msg.request_id, prompt, msg.params)
        except ValueError as e:                   # RequestError, or the chat template refused the messages
            self.outputs.send(RequestFailed(msg.request_id, portable_error(e)))

    def answer(self, call_id: int, call) -> None:
        try:
            self.outputs.send(Reply(call_id, True, call()))
        except Exception as e:  # noqa: BLE001 - a failed call (or an unpicklable value) is the caller's error
            self.outputs.send(Reply(call_id, False, portable_error(e)))

    def compact(self, outputs: list[RequestOutput]) -> list[RequestOutput]:
        for out in outputs:
            if out.request_id in self.prompt_sent:
                out.prompt, out.prompt_token_ids = None, None
            elif not out.finished:
                self.prompt_sent.add(out.request_id)
            if out.finished:
                self.prompt_sent.discard(out.request_id)
        return outputs


def run_engine_core(config: EngineConfig, init_method: Optional[str], inputs: Connection,
                    outputs: Connection) -> None:
    """The core process's whole life. Ranks 1..TP-1, if any, were started by the client at `init_method`."""
    from replicas.engine import LLMEngine
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    engine = None
    try:
        launcher = LaunchedRanks(init_method) if config.tensor_parallel_size > 1 else None
        engine = LLMEngine(config, worker_launcher=launcher)
        vocab = min(engine.model_config.vocab_size, engine.tokenizer.vocab_size)
        outputs.send(Ready(EngineInfo(engine.model_name, engine.max_model_len, vocab, engine.elastic is not None)))
        EngineCore(engine, inputs, outputs).run()
    except (EOFError, BrokenPipeError, ConnectionResetError):
        log.warning("the serving process went away; the engine core stops")
    except BaseException:  # noqa: BLE001 - the client must learn why, not just see the pipe close
        log.error("engine core died: %s", traceback.format_exc())
        try:
            outputs.send(CoreDied(traceback.format_exc()))
        except OSError:
            pass
    finally:
        if engine is not None:
            engine.shutdown()
        outputs.close()

