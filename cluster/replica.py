"""The Serve deployment: one engine, and the OpenAI HTTP routes in front of it (`cluster.ingress.OpenAIRoutes`).

Its process is rank 0 of the replica's TP group; ranks 1..TP-1 are `RankWorker` actors in the same placement
group (see `cluster.rank_actor`). The engine's step loop runs in a process of its own (replicas/engine_core.py).
Serve's proxy routes each HTTP request to a replica; `generate` turns one job into frames (`StreamStart` or
`StreamFailure` first, then lists of `ChoiceDelta`) that the routes write as SSE. The fleet controller calls
`reconfigure` and `stats` on every replica with `handle.broadcast(...)`.
Serve pickles the class by value at decoration, so the helpers it calls are defined above it.
"""
from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections import deque
from dataclasses import asdict
from typing import Optional

from ray import serve
from ray.serve.exceptions import RayServeException

from cluster.admission import admission_for
from cluster.frontend import EngineFrontend
from cluster.ingress import DEFAULT_MAX_BODY_BYTES, app
from cluster.rank_actor import RayRankLauncher
from cluster.recent_requests import RecentRequests
from cluster.replica_metrics import MetricsPump
from replicas.async_engine import AsyncLLMEngine
from replicas import envs
from replicas.config import EngineConfig
from replicas.startup_heap import freeze_startup_heap
from replicas.stats import EngineStats

logger = logging.getLogger("tidal.replica")

RECONFIGURABLE_KNOBS = ("max_num_batched_tokens", "elastic", "speculation")
DEFAULT_REQUEST_TIMEOUT_S = 600.0
CONTROLLER_LOG = 32             # the fleet controller's last decisions each replica keeps (`tidal controller status`)
RECENT_S = 120.0                # how far back `describe(recent=True)` reports finished requests


def replica_engine_config(config: EngineConfig, serving_processes: int = 1) -> EngineConfig:
    """The config a replica's engine runs: the stream-item budget (EngineConfig's stream_item_ms), when the config
    leaves it unset, is $TIDAL_STREAM_ITEM_MS or 0.1 ms (replicas/envs.py), divided by the processes that write the
    engine's streams (its ingress replicas). Each of the n streams a step touched then reports at most every (n - 1)
    x that, so each serving process loads and sends at most ~10,000 items/s however many streams it serves (every
    item is work on that process's GIL); below that rate every stream gets every step (0: an output per engine step,
    always)."""
    if config.serving.stream_item_ms is not None:
        return config
    return config.with_(stream_item_ms=envs.stream_item_ms() / serving_processes)


def _replica_rank() -> int:
    try:
        return serve.get_replica_context().rank.rank
    except (RayServeException, AttributeError):
        return 0


def _replica_id() -> str:
    try:
        return serve.get_replica_context().replica_id.unique_id
    except RayServeException:  # Serve's local testing mode has no replica context during __init__
        return f"local-{uuid.uuid4().hex[:8]}"


class EngineReplica(EngineFrontend):
    """One engine and the routes in front of it; `LLMReplica` is this class as a Serve ingress deployment."""

    def __init__(self, engine_config: EngineConfig, cpus_per_rank: float = 1.0, *, request_limit: int = 1 << 30,
                 api_key: Optional[str] = None, served_model_name: Optional[str] = None,
                 max_body_bytes: int = DEFAULT_MAX_BODY_BYTES, request_timeout_s: float = DEFAULT_REQUEST_TIMEOUT_S,
                 ingress_replicas: int = 0, drain_s: float = 0.0):
        """request_limit: jobs in flight (generating or waiting in the engine) beyond which new ones get a 503, a
        safety bound above the token limit (cluster/admission.py, EngineConfig's max_queued_tokens);
        request_timeout_s: a job still running that long after it arrived is aborted (a 504, or in-band);
        ingress_replicas: 0 when this replica serves HTTP itself, else how many `IngressReplica`s stream its
        engine's requests (cluster/ingress_replica.py), whose admission and drain are theirs: on stopping, this
        replica waits up to `drain_s` for the requests they still run."""
        self._init_routes(api_key, served_model_name, max_body_bytes)
        self.request_timeout_s = request_timeout_s
        self.replica_id = _replica_id()
        self.launcher: Optional[RayRankLauncher] = None
        if engine_config.tensor_parallel_size > 1:
            self.launcher = RayRankLauncher(engine_config.device == "cuda", cpus_per_rank)
        self.ingress_replicas, self.drain_s = ingress_replicas, drain_s
        self.engine = AsyncLLMEngine(replica_engine_config(engine_config, max(1, ingress_replicas)),
                                     worker_launcher=self.launcher)
        self.admission = admission_for(engine_config.serving.max_queued_tokens, self.engine.info.kv_tokens,
                                       request_limit)
        self._peers = None                   # this deployment's handle, for /stats
        self.recent = RecentRequests()
        self.controller_state: dict = {}                    # the fleet controller's, kept for its restarts
        self.controller_log: deque[dict] = deque(maxlen=CONTROLLER_LOG)
        self.metrics = MetricsPump(self.engine, self.engine.model_name, self.replica_id, on_finished=self.recent.add,
                                   admission=None if ingress_replicas else self.admission.snapshot)
        self.metrics.start()
        logger.info("replica %s serving %s (tp=%d; admits %d prompt and output tokens, %d requests)", self.replica_id,
                    self.engine.model_name, engine_config.tensor_parallel_size, self.admission.token_limit,
                    request_limit)

    async def core_endpoint(self) -> dict:
        """Where this replica's ingress replicas reach its engine core: its Serve rank (they pair by it), id and
        `CoreAddress` on this node's address."""
        import ray
        address = await asyncio.to_thread(self.engine.open_endpoint, ray.util.get_node_ip_address())
        return {"rank": _replica_rank(), "replica_id": self.replica_id, "address": address}

    async def replicas_describe(self) -> list:
        if self._peers is None:
            ctx = serve.get_replica_context()
            self._peers = serve.get_deployment_handle(ctx.deployment, ctx.app_name)
        return await self._peers.broadcast("describe").results_async(timeout_s=30, return_exceptions=True)

    async def describe(self, recent: bool = False) -> dict:
        """Identity, current stats and the fleet controller's state and last decisions on this replica (/stats and
        the controller read it); with `recent`, the requests it finished in the last RECENT_S seconds."""
        stats = await asyncio.to_thread(self.engine.stats)       # an engine call: answered between two steps
        out = {"replica_id": self.replica_id, "model": self.engine.model_name,
               "max_model_len": self.engine.max_model_len, "stats": asdict(stats),
               "admission": asdict(self.admission.snapshot()),
               "budget_limit": self.engine.config.scheduling.max_num_batched_tokens,
               "elastic_available": self.engine.info.elastic_available,
               "controller": {"state": self.controller_state, "log": list(self.controller_log)}}
        if recent:
            out["recent"] = self.recent.since(time.time() - RECENT_S)
        return out

    async def stats(self) -> EngineStats:
        return await asyncio.to_thread(self.engine.stats)

    def reconfigure(self, knobs: dict) -> dict:
        """Runtime knobs without a restart: Serve calls it with `user_config`, the controller directly."""
        unknown = set(knobs or {}) - set(RECONFIGURABLE_KNOBS)
        if unknown:
            raise ValueError(f"unknown knobs {sorted(unknown)}; reconfigurable: {RECONFIGURABLE_KNOBS}")
        applied = self.engine.reconfigure(**(knobs or {}))
        logger.info("replica %s reconfigured: %s", self.replica_id, applied)
        return applied

    def apply_controller_decisions(self, payload: dict) -> list:
        """The fleet controller broadcasts every replica's round, {replica_id: {"state", "decisions", "advisory"}};
        each replica keeps its state, applies its decisions (unless advisory), logs and exports them (an advisory
        decision's reason is exported as `advisory_<reason>`)."""
        mine = payload.get(self.replica_id)
        if mine is None:
            return []
        self.controller_state = mine["state"]
        done = []
        for knob, value, reason in mine["decisions"]:
            if not mine["advisory"]:
                self.reconfigure({knob: value})
            logger.info("replica %s: controller %s %s=%s (%s)", self.replica_id,
                        "advises" if mine["advisory"] else "sets", knob, value, reason)
            self.controller_log.append({"at": time.time(), "knob": knob, "value": value, "reason": reason,
                                        "applied": not mine["advisory"]})
            if self.metrics.recorder is not None:
                numeric = value if isinstance(value, (int, float)) else float(value != "off")
                self.metrics.recorder.record_controller_decision(
                    knob, numeric, f"advisory_{reason}" if mine["advisory"] else reason, not mine["advisory"])
            done.append((knob, value, reason))
        return done

    def engine_problem(self) -> Optional[str]:
        if self.launcher is not None and self.launcher.exited_ranks():
            return f"TP ranks {self.launcher.exited_ranks()} exited"
        return super().engine_problem()

    def _await_ingress_drain(self) -> None:
        """Serve sees no request in flight on an engine whose streams its ingress replicas carry: their drain runs
        on, so the engine stays until they finished (or left) or `drain_s` passed."""
        deadline = time.monotonic() + self.drain_s
        while time.monotonic() < deadline and self.engine.is_alive():
            stats = self.engine.stats()
            if stats.num_running + stats.num_waiting == 0:
                return
            time.sleep(0.2)

    def __del__(self):
        # The engine shuts its TP ranks' launcher down too.
        if getattr(self, "ingress_replicas", 0) and getattr(self, "engine", None) is not None:
            try:
                self._await_ingress_drain()
            except Exception:  # noqa: BLE001 - the engine stops either way
                logger.warning("waiting for the ingress replicas' drain failed", exc_info=True)
        super().__del__()


class ServedEngineReplica(EngineReplica):
    """An EngineReplica in a Serve replica process of its own, whose start-up heap is frozen once the engine is up
    (replicas/startup_heap.py): the process's full collections then walk only what serving allocates."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        freeze_startup_heap()


# Serve replaces a replica after three failed checks in a row: with a dead or stuck engine, within ~6 s.
_REPLICA_OPTIONS = dict(name="LLMReplica", health_check_period_s=2, health_check_timeout_s=30,
                        graceful_shutdown_wait_loop_s=0.5, graceful_shutdown_timeout_s=120)
LLMReplica = serve.deployment(**_REPLICA_OPTIONS)(serve.ingress(app)(ServedEngineReplica))
# The same replica behind ingress replicas (`tidal serve --api-server-count N`): no HTTP of its own.
LLMEngineReplica = serve.deployment(**_REPLICA_OPTIONS)(ServedEngineReplica)
