"""An engine core that another process started, used over TCP: several serving processes stream one engine's
requests (the ingress processes of a replica, cluster/ingress_replica.py), each paying the CPU of its own streams.

The owner (`AsyncLLMEngine.open_endpoint`) hands out the core's `CoreAddress`; `RemoteEngine(address, config)` connects,
loads the tokenizer and waits for the core's Ready. Requests, outputs and calls are those of the owner's client
(replicas/engine_client.py). Liveness without the owner's shared heartbeat: the watchdog pings the core every
period, and a core that answers no ping for `EngineConfig.serving.watchdog_s` is stuck; a closed connection means the
core (or its replica) is gone. The core aborts the requests of a client that disconnects. Engine-wide calls
(`reconfigure`) belong to the owner, which runs the replica's controller and metrics.
"""
from __future__ import annotations

import logging
import os
import socket
import time
from concurrent.futures import Future

from replicas.config import EngineConfig
from replicas.core_endpoint import connect
from replicas.engine_client import EngineClient, EngineDeadError, EngineHealth, load_tokenizer
from replicas.engine_messages import CoreAddress, CoreDied, Ping, Ready, Shutdown, decode_core_message

log = logging.getLogger(__name__)

__all__ = ["RemoteEngine"]

READY_TIMEOUT_S = 60.0        # the core answers a new client between two steps


class RemoteEngine(EngineClient):
    def __init__(self, address: CoreAddress, config: EngineConfig):
        """config: the owner's (the tokenizer, limits and watchdog period come from it)."""
        self.address = address
        tokenizer = load_tokenizer(config)
        conn = connect(address)
        try:
            if not conn.poll(READY_TIMEOUT_S):
                raise RuntimeError(f"the engine core at {address.host}:{address.port} did not answer within "
                                   f"{READY_TIMEOUT_S:.0f} s")
            msg = decode_core_message(conn.recv_bytes())
            if isinstance(msg, CoreDied):
                raise RuntimeError(f"the engine core died: {msg.reason}")
            if not isinstance(msg, Ready):
                raise RuntimeError(f"the engine core sent {type(msg).__name__} before Ready")
        except BaseException:
            conn.close()
            raise
        self._last_answer = time.monotonic()
        self._attach(config, tokenizer, msg.info, conn, conn)

    def _watch(self) -> None:
        period = min(1.0, self.watchdog_s / 4)
        while not self._stop_watch.wait(period):
            if self._stopping or self._error is not None:
                return
            fut: Future = Future()
            call_id = next(self._call_ids)
            self._calls[call_id] = fut
            try:
                self._send(Ping(call_id))
            except OSError:
                return                          # the reader sees the connection close
            deadline = self._last_answer + self.watchdog_s
            while not fut.done() and time.monotonic() < deadline:
                if self._stop_watch.wait(min(period, max(0.0, deadline - time.monotonic()))):
                    return
            self._calls.pop(call_id, None)
            if fut.done():
                self._last_answer = time.monotonic()
                continue
            self._stuck = True
            self._declare_dead(EngineDeadError(
                f"the engine core is stuck: no answer for {time.monotonic() - self._last_answer:.1f} s "
                f"(engine_watchdog_s={self.watchdog_s:g})"))
            return

    def _gone(self) -> EngineDeadError:
        return EngineDeadError(f"the connection to the engine core at {self.address.host}:{self.address.port} "
                               "closed (its replica stopped or failed)")

    def _reader_failed(self) -> None:
        self._to_core.close()

    def health(self) -> EngineHealth:
        silent = max(0.0, time.monotonic() - self._last_answer)
        if self._error is not None:
            detail = str(self._error)
        elif self._stuck:
            detail = f"no answer for {silent:.1f} s (engine_watchdog_s={self.watchdog_s:g})"
        else:
            detail = "ok"
        return EngineHealth(self._error is None and not self._stuck and not self._stopping, self._stuck, silent,
                            detail)

    def shutdown(self) -> None:
        """Leave the core (it aborts this client's requests); the core and its replica go on."""
        self._stopping = True
        self._stop_watch.set()
        try:
            self._send(Shutdown())
        except OSError:
            pass
        try:                                    # wakes the reader (a close alone would leave it blocked)
            with socket.socket(fileno=os.dup(self._to_core.fileno())) as raw:
                raw.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._reader.join(5)
        self._to_core.close()
        self._watchdog.join(5)
        self._declare_dead(EngineDeadError("the engine was shut down"))
        self._tokenize_pool.shutdown(wait=False, cancel_futures=True)
