"""Starting TP ranks 1..N-1. Rank 0 is the engine's own process.

`ProcessLauncher` spawns local processes (offline `LLM`, tests); the Serve app passes a launcher
that starts Ray actors in the replica's placement group (cluster/rank_actor.py).
"""
from __future__ import annotations

import multiprocessing as mp
import socket
from typing import Protocol

from replicas.config import EngineConfig


class WorkerLauncher(Protocol):
    def launch(self, config: EngineConfig, rank: int, world_size: int, init_method: str) -> None: ...
    def shutdown(self) -> None: ...


def free_port() -> int:
    """A TCP port free on this host now (TP rendezvous, local servers)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_worker(config: EngineConfig, rank: int, world_size: int, init_method: str,
               device_index: int | None = None) -> None:
    """A rank's whole life: load the shard, size and allocate the KV cache with the others, serve steps."""
    from replicas.model_runner import ModelRunner

    runner = ModelRunner(config, rank, world_size, init_method, device_index)
    runner.init_kv()
    runner.serve_forever()


class LaunchedRanks:
    """Ranks 1..N-1 that another process already started at `init_method` (the serving process starts them
    for an engine core running in a process of its own); shutting them down stays that process's job."""

    def __init__(self, init_method: str):
        self.init_method = init_method

    def launch(self, config, rank, world_size, init_method):
        raise RuntimeError("these ranks were launched already")

    def shutdown(self):
        pass


class ProcessLauncher:
    def __init__(self):
        self._ctx = mp.get_context("spawn")
        self._procs: list = []

    def launch(self, config, rank, world_size, init_method):
        p = self._ctx.Process(target=run_worker, args=(config, rank, world_size, init_method), daemon=True,
                              name=f"tidal-rank{rank}")
        p.start()
        self._procs.append(p)

    def shutdown(self):
        for p in self._procs:
            p.join(timeout=10)
            if p.is_alive():
                p.terminate()
        self._procs.clear()
