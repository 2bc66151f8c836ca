"""Starting TP ranks 1..N-1. Rank 0 is the engine's own process.

`ProcessLauncher` spawns local processes (offline `LLM`, tests); the Serve app passes a launcher
that starts Ray actors in the replica's placement group (cluster/rank_actor.py).
"""
from __future__ import annotations

import multiprocessing as mp
import random
import socket
from typing import Protocol

from replicas.config import EngineConfig


class WorkerLauncher(Protocol):
    def launch(self, config: EngineConfig, rank: int, world_size: int, init_method: str) -> None: ...
    def shutdown(self) -> None: ...


# Ports handed out by free_port in this process, never handed out twice.
_HANDED_OUT: set[int] = set()
# Below this, Ray's workers take ports of their own (Ray's default min_worker_port..max_worker_port: 10002-19999).
_LOWEST_PORT = 20000


def _ephemeral_range() -> tuple[int, int]:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low, high = (int(v) for v in f.read().split())
        return low, high
    except (OSError, ValueError):
        return 32768, 60999                          # Linux's default


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("", port))                       # every interface: fails if any address holds the port
        except OSError:
            return False
    return True


def free_port() -> int:
    """A TCP port free on this host now, for a listener that another process binds later (TP rendezvous, local
    servers, HAProxy's listeners). It is drawn below the kernel's ephemeral range: a port the kernel hands out for
    `bind(0)` or an outgoing connection can be taken between this call and the later bind, and a Ray node opens
    hundreds of those while it starts. Only when that range leaves no room is the kernel asked for one."""
    low, _ = _ephemeral_range()
    draw = random.SystemRandom()                     # not the `random` module's state, which tests seed
    if low - _LOWEST_PORT >= 1000:
        for _ in range(200):
            port = draw.randrange(_LOWEST_PORT, low)
            if port not in _HANDED_OUT and _bindable(port):
                _HANDED_OUT.add(port)
                return port
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_worker(config: EngineConfig, rank: int, world_size: int, init_method: str,
               device_index: int | None = None) -> None:
    """A rank's whole life: load the shard, size and allocate the KV cache with the others, serve steps."""
    from replicas.model_runner import ModelRunner
    from replicas.startup_heap import freeze_startup_heap

    runner = ModelRunner(config, rank, world_size, init_method, device_index)
    runner.init_kv()
    freeze_startup_heap()           # a collection's pause here holds every rank at the step's next collective
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
