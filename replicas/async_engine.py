"""The engine for the server: an `EngineClient` (replicas/engine_client.py) that starts its engine core process
(replicas/engine_core.py) and owns it, with the core's TP ranks. A watchdog thread reads the core's heartbeat: a core
that exits, or writes no heartbeat for `EngineConfig.serving.watchdog_s` (stuck), makes the engine dead.
`open_endpoint` lets other processes' `RemoteEngine`s use the same core."""
from __future__ import annotations

import logging
import multiprocessing as mp
import time
from typing import Optional

from replicas.config import EngineConfig
from replicas.distributed.launch import ProcessLauncher, WorkerLauncher, free_port
from replicas.engine_client import (ChatPrompt, EngineClient, EngineDeadError, EngineDraining, EngineHealth,
                                    EngineStepError, RequestError, RequestTimeout, load_tokenizer)
from replicas.engine_core import run_engine_core
from replicas.engine_messages import CoreAddress, CoreDied, EngineInfo, OpenEndpoint, Ready, Shutdown, \
    decode_core_message

log = logging.getLogger(__name__)

__all__ = ["AsyncLLMEngine", "ChatPrompt", "EngineDeadError", "EngineDraining", "EngineHealth", "EngineStepError",
           "RequestError", "RequestTimeout"]

START_TIMEOUT_S = 1800.0      # loading and profiling a large model


class AsyncLLMEngine(EngineClient):
    def __init__(self, config: EngineConfig, worker_launcher: Optional[WorkerLauncher] = None):
        tp = config.tensor_parallel_size
        init_method = f"tcp://127.0.0.1:{free_port()}" if tp > 1 else None
        # Ranks 1..TP-1 are started from here: the Ray launcher needs this (Ray worker) process.
        self.launcher = worker_launcher or (ProcessLauncher() if tp > 1 else None)
        for rank in range(1, tp):
            self.launcher.launch(config, rank, tp, init_method)
        ctx = mp.get_context("spawn")
        core_in, to_core = ctx.Pipe(duplex=False)                  # Pipe(duplex=False) is (reader, writer)
        from_core, core_out = ctx.Pipe(duplex=False)
        self._heartbeat = ctx.Value("d", time.monotonic(), lock=False)
        self._proc = ctx.Process(target=run_engine_core,
                                 args=(config, init_method, core_in, core_out, self._heartbeat),
                                 name="tidal-engine-core", daemon=True)
        self._proc.start()
        core_in.close()
        core_out.close()
        try:
            tokenizer = load_tokenizer(config)                     # while the core loads the model
        except BaseException:
            self._proc.kill()
            raise
        self._attach(config, tokenizer, self._wait_ready(from_core), to_core, from_core)
        self._endpoint: Optional[CoreAddress] = None

    def _wait_ready(self, from_core) -> EngineInfo:
        if not from_core.poll(START_TIMEOUT_S):
            self._proc.kill()
            raise RuntimeError(f"the engine core did not start within {START_TIMEOUT_S:.0f} s")
        try:
            msg = decode_core_message(from_core.recv_bytes())
        except EOFError:
            self._proc.join(5)
            raise RuntimeError(f"the engine core exited while starting (exit code {self._proc.exitcode})") from None
        match msg:
            case Ready(info=info):
                return info
            case CoreDied(reason=reason):
                self._proc.join(30)
                raise RuntimeError(f"the engine core failed to start: {reason}")
            case _:
                self._proc.kill()
                raise RuntimeError(f"the engine core sent {type(msg).__name__} before Ready")

    # ---- liveness ---------------------------------------------------------------------------------------
    def _exit_code(self) -> Optional[int]:
        self._proc.join(1)                      # the pipe closes a moment before the process is reaped
        return self._proc.exitcode

    def _watch(self) -> None:
        period = min(1.0, self.watchdog_s / 4)
        while not self._stop_watch.wait(period):
            if self._stopping or self._error is not None:
                return
            if not self._proc.is_alive():
                self._declare_dead(EngineDeadError(
                    f"the engine core process exited (exit code {self._proc.exitcode})"))
                return
            silent = time.monotonic() - self._heartbeat.value
            if silent > self.watchdog_s:
                self._stuck = True
                self._declare_dead(EngineDeadError(
                    f"the engine core is stuck: no heartbeat for {silent:.1f} s (engine_watchdog_s="
                    f"{self.watchdog_s:g})"))
                return

    def _gone(self) -> EngineDeadError:
        return EngineDeadError(f"the engine core process exited (exit code {self._exit_code()})")

    def _reader_failed(self) -> None:
        self._proc.kill()

    def open_endpoint(self, host: str) -> CoreAddress:
        """Let other processes use this engine's core (`RemoteEngine(address, config)`): the core accepts clients on
        a TCP port of `host` that prove they hold the returned address's key. Idempotent."""
        if self._endpoint is None:
            self._endpoint = self._call(OpenEndpoint, host=host)
        return self._endpoint

    def health(self) -> EngineHealth:
        """Whether the core serves: alive (not exited, not stuck, not declared dead), stuck (no heartbeat for more
        than the watchdog period), the heartbeat's age and a one-line detail."""
        silent = max(0.0, time.monotonic() - self._heartbeat.value)
        running = self._proc.is_alive()
        stuck = self._stuck or (running and silent > self.watchdog_s and not self._stopping)
        if self._error is not None:
            detail = str(self._error)
        elif not running:
            detail = f"the engine core process exited (exit code {self._proc.exitcode})"
        elif stuck:
            detail = f"no heartbeat for {silent:.1f} s (engine_watchdog_s={self.watchdog_s:g})"
        else:
            detail = "ok"
        return EngineHealth(running and not stuck and self._error is None and not self._stopping, stuck, silent,
                            detail)

    def shutdown(self) -> None:
        """Stop the core (it shuts its ranks' group down), then the ranks' launcher. A dead or stuck core is killed
        at once."""
        healthy = self.is_alive()
        self._stopping = True
        self._stop_watch.set()
        if healthy:
            try:
                self._send(Shutdown())
            except OSError:
                pass
            self._proc.join(60)
        if self._proc.is_alive():
            if healthy:
                log.warning("the engine core did not stop within 60 s; killing it")
            self._proc.kill()
            self._proc.join(5)
        self._reader.join(5)
        self._watchdog.join(5)
        self._declare_dead(EngineDeadError("the engine was shut down"))     # streams still open end here
        self._tokenize_pool.shutdown(wait=False, cancel_futures=True)
        self._to_core.close()
        if self.launcher is not None:
            self.launcher.shutdown()
