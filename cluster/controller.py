"""The fleet controller: polls every replica's engine stats and re-tunes runtime knobs across the fleet.

Policy (per replica, one decision per round at most, from the counters' change since the last round):
- KV pressure (usage >= `kv_pressure`, or new preemptions) with elastic KV available but off: turn lending
  on, so the idle prefill reserve holds KV during decode ("kv_pressure").
- A queue backlog (>= `queue_backlog` waiting) while KV has room: double `max_num_batched_tokens`, up to
  the budget the engine reserved activation memory for, so prompts are admitted in fewer steps ("queue_backlog").
- Preemptions with nothing waiting: halve the budget (not below `min_budget`), so fewer prompt tokens land
  in the KV pool at once ("preemptions").
- Idle: restore the engine's configured budget ("idle_reset").
The controller is a detached Ray actor; it talks to replicas by method calls (`describe`,
`apply_controller_decisions`), never on the per-step path.
"""
from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from typing import Optional, Protocol

from replicas.stats import EngineStats

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ControllerConfig:
    interval_s: float = 5.0
    kv_pressure: float = 0.90
    queue_backlog: int = 8
    min_budget: int = 256


@dataclass(frozen=True)
class Decision:
    knob: str                 # "max_num_batched_tokens" | "elastic"
    value: object
    reason: str


@dataclass
class ReplicaView:
    replica_id: str
    stats: EngineStats
    budget_limit: int         # the max_num_batched_tokens the replica's engine was sized for
    elastic_available: bool


def decide(view: ReplicaView, prev: Optional[EngineStats], cfg: ControllerConfig) -> Optional[Decision]:
    s = view.stats
    preempted = s.preemptions - (prev.preemptions if prev is not None else s.preemptions)
    budget = s.max_num_batched_tokens
    if (s.kv_cache_usage >= cfg.kv_pressure or preempted > 0) and view.elastic_available \
            and s.elastic_mode == "off":
        return Decision("elastic", "elastic", "kv_pressure")
    if s.num_waiting >= cfg.queue_backlog and s.kv_cache_usage < cfg.kv_pressure and budget < view.budget_limit:
        return Decision("max_num_batched_tokens", min(2 * budget, view.budget_limit), "queue_backlog")
    if preempted > 0 and s.num_waiting == 0 and budget > cfg.min_budget:
        return Decision("max_num_batched_tokens", max(budget // 2, cfg.min_budget), "preemptions")
    if s.num_running == 0 and s.num_waiting == 0 and budget != view.budget_limit:
        return Decision("max_num_batched_tokens", view.budget_limit, "idle_reset")
    return None


class Fleet(Protocol):
    def views(self) -> list[ReplicaView]: ...
    def apply(self, decisions: dict[str, list[Decision]]) -> dict: ...


class Controller:
    """One round: read every replica, decide, apply. `run` repeats it every `interval_s` until stopped."""

    def __init__(self, fleet: Fleet, cfg: ControllerConfig = ControllerConfig()):
        self.fleet, self.cfg = fleet, cfg
        self.prev: dict[str, EngineStats] = {}
        self.history: list[tuple[str, Decision]] = []
        self._stop = threading.Event()

    def step(self) -> dict[str, list[Decision]]:
        decisions: dict[str, list[Decision]] = {}
        for view in self.fleet.views():
            d = decide(view, self.prev.get(view.replica_id), self.cfg)
            self.prev[view.replica_id] = view.stats
            if d is not None:
                decisions[view.replica_id] = [d]
                self.history.append((view.replica_id, d))
        if decisions:
            self.fleet.apply(decisions)
            logger.info("controller decisions: %s", decisions)
        return decisions

    def run(self) -> None:
        while not self._stop.wait(self.cfg.interval_s):
            try:
                self.step()
            except Exception:  # noqa: BLE001 - a failed round (replica restarting) must not end the loop
                logger.exception("controller round failed")

    def stop(self) -> None:
        self._stop.set()


class ServeFleet:
    """The replicas of a Serve app, reached through its deployment handle (broadcast to every replica)."""

    def __init__(self, app_name: str, deployment: str = "LLMReplica"):
        from ray import serve
        self.handle = serve.get_deployment_handle(deployment, app_name)
        # The controller calls from a plain thread; Serve's throughput preset (cluster.serve_cmd.SERVE_ENV) would
        # otherwise route on the caller's asyncio loop, which a thread does not have.
        self.handle._init(_run_router_in_separate_loop=True)

    def views(self) -> list[ReplicaView]:
        replies = self.handle.broadcast("describe").results(timeout_s=30)
        return [ReplicaView(r["replica_id"], EngineStats(**r["stats"]), r["budget_limit"], r["elastic_available"])
                for r in replies]

    def apply(self, decisions: dict[str, list[Decision]]) -> dict:
        payload = {rid: [(d.knob, d.value, d.reason) for d in ds] for rid, ds in decisions.items()}
        return self.handle.broadcast("apply_controller_decisions", payload).results(timeout_s=30)


def start_controller(app_name: str, cfg: ControllerConfig = ControllerConfig()):
    """A detached Ray actor running the controller loop next to the Serve app."""
    import ray

    @ray.remote(num_cpus=0)
    class FleetController:
        def __init__(self):
            self.controller = Controller(ServeFleet(app_name), cfg)
            self.thread = threading.Thread(target=self.controller.run, name="tidal-controller", daemon=True)
            self.thread.start()

        def history(self) -> list[tuple[str, str, object, str]]:
            return [(rid, d.knob, d.value, d.reason) for rid, d in self.controller.history]

    return FleetController.options(name="tidal-controller", lifetime="detached", get_if_exists=True).remote()
