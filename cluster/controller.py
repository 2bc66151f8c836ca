"""The fleet controller: every `interval_s` it reads each replica (engine stats, recently finished requests, the
state it left there), lets its policy (cluster/controller_policies.py) decide per replica, bounds and rate-limits
the decisions and sends them back; each replica applies its own through its reconfigure path (or only records
them, in advisory mode), logs them and exports them to Prometheus with their reasons.

The controller keeps nothing that matters itself: each round it hands every replica its policy state, and a
restarted controller (the actor is detached, named and restartable) reads it back and carries on. It talks to
replicas by method calls (`describe`, `apply_controller_decisions`), never on the per-step path.
"""
from __future__ import annotations

import logging
import threading
import time
from typing import Optional, Protocol

from cluster.controller_policies import ControllerConfig, Decision, ReplicaView, make_policy
from replicas.stats import EngineStats

logger = logging.getLogger(__name__)

ACTOR_NAME = "tidal-controller"


class Fleet(Protocol):
    def views(self) -> list[ReplicaView]: ...
    def apply(self, payload: dict[str, dict]) -> object: ...


class Controller:
    """One round: read every replica, decide, bound, send. `run` repeats it every `interval_s` until stopped."""

    def __init__(self, fleet: Fleet, cfg: ControllerConfig = ControllerConfig()):
        self.fleet, self.cfg = fleet, cfg
        self.policy = make_policy(cfg)
        self.history: list[tuple[str, Decision]] = []
        self._stop = threading.Event()

    def step(self, now: Optional[float] = None) -> dict[str, list[Decision]]:
        now = time.time() if now is None else now
        decided: dict[str, list[Decision]] = {}
        payload: dict[str, dict] = {}
        for view in self.fleet.views():
            state = dict(view.state) if view.state.get("policy") == self.policy.name else {"policy": self.policy.name}
            state["round"] = state.get("round", 0) + 1
            decisions = self.bounded(view, self.policy.decide(view, state, now))
            if decisions and state["round"] - state.get("changed_round", -(1 << 30)) <= self.cfg.cooldown_rounds:
                decisions = []                                  # rate limit: the last change is too recent
            if decisions:
                state.update(changed_round=state["round"], changed_at=now)
                decided[view.replica_id] = decisions
                self.history.extend((view.replica_id, d) for d in decisions)
            payload[view.replica_id] = {"state": state, "advisory": self.cfg.advisory,
                                        "decisions": [(d.knob, d.value, d.reason) for d in decisions]}
        if payload:
            self.fleet.apply(payload)
        if decided:
            logger.info("controller %s%s decisions: %s", self.policy.name, " (advisory)" if self.cfg.advisory else "",
                        decided)
        return decided

    def bounded(self, view: ReplicaView, decisions: list[Decision]) -> list[Decision]:
        """Within what the replica allows, and only what changes something."""
        out = []
        for d in decisions:
            if d.knob == "max_num_batched_tokens":
                value = max(1, min(int(d.value), view.budget_limit))
                if value != view.stats.max_num_batched_tokens:
                    out.append(Decision(d.knob, value, d.reason))
            elif d.knob == "elastic":
                if view.elastic_available and d.value in ("off", "elastic") and d.value != view.stats.elastic_mode:
                    out.append(d)
            else:
                raise ValueError(f"policy {self.policy.name} decided an unknown knob {d.knob!r}")
        return out

    def run(self) -> None:
        served = False                      # before the app's first answer, a failed round is the app starting
        while not self._stop.wait(self.cfg.interval_s):
            try:
                self.step()
                served = True
            except Exception as e:  # noqa: BLE001 - a failed round (the app starting, a replica restarting) is retried
                logger.log(logging.WARNING if served else logging.DEBUG, "controller round failed: %s: %s",
                           type(e).__name__, e)

    def stop(self) -> None:
        self._stop.set()


class ServeFleet:
    """The replicas of a Serve app, reached through its deployment handle (broadcast to every replica); the
    handle is taken at the first round, so the controller may start before the app is deployed."""

    def __init__(self, app_name: str, deployment: str = "LLMReplica"):
        self.app_name, self.deployment = app_name, deployment
        self.handle = None

    def _handle(self):
        if self.handle is None:
            from ray import serve
            handle = serve.get_deployment_handle(self.deployment, self.app_name)
            # The controller calls from a plain thread; Serve's throughput preset (cluster.serve_cmd.SERVE_ENV)
            # would otherwise route on the caller's asyncio loop, which a thread does not have.
            handle._init(_run_router_in_separate_loop=True)
            self.handle = handle
        return self.handle

    def views(self) -> list[ReplicaView]:
        replies = self._handle().broadcast("describe", True).results(timeout_s=30)
        return [ReplicaView(r["replica_id"], EngineStats(**r["stats"]), r["budget_limit"], r["elastic_available"],
                            r["recent"], r["controller"]["state"]) for r in replies]

    def apply(self, payload: dict[str, dict]) -> list:
        return self._handle().broadcast("apply_controller_decisions", payload).results(timeout_s=30)


def start_controller(app_name: str, cfg: ControllerConfig):
    """The controller as a detached, named Ray actor next to the Serve app. Ray restarts it if its process dies
    (its state is on the replicas); an actor already running under the name is kept as it is."""
    import ray

    @ray.remote(num_cpus=0, max_restarts=-1)
    class FleetController:
        def __init__(self):
            logging.basicConfig(level=logging.INFO)
            self.controller = Controller(ServeFleet(app_name), cfg)
            self.thread = threading.Thread(target=self.controller.run, name="tidal-controller", daemon=True)
            self.thread.start()

        def config(self) -> dict:
            from dataclasses import asdict
            return asdict(cfg)

        def history(self) -> list[tuple[str, str, object, str]]:
            return [(rid, d.knob, d.value, d.reason) for rid, d in self.controller.history]

    return FleetController.options(name=ACTOR_NAME, lifetime="detached", get_if_exists=True).remote()
