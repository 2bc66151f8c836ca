"""Ingress replicas: the OpenAI routes in processes of their own, each streaming its requests straight from one
`LLMReplica`'s engine core (`tidal serve --api-server-count N`, vLLM's name for the same idea).

One serving process writes every chunk of every stream it carries (a socket write per chunk, plus the request's
HTTP, validation and SSE work), all on one GIL, so one process streams a bounded number of chunks a second however
fast its engine steps. With N ingress replicas per engine the front door (HAProxy) spreads requests over N processes;
each talks to its engine's core over a TCP connection of its own (replicas/remote_engine.py), so a token still
crosses one hop, and the engine's step loop is shared. The engine replicas (`LLMReplica`, not an HTTP ingress in this
shape) keep the engine, its ranks, its metrics and the fleet controller's knobs.

Pairing: ingress replica of Serve rank r uses the engine replica of rank r mod E (E engine replicas), so each engine
gets N ingress replicas. An ingress whose engine goes away fails its streams and its health check; Serve replaces it
and the replacement connects to the engine that then holds that rank. Admission (cluster/admission.py) is split:
each of the N ingress replicas of an engine admits 1/N of the engine's token and request limits.
"""
from __future__ import annotations

import asyncio
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Optional

from ray import serve
from ray.serve.exceptions import DeploymentUnavailableError

from cluster.admission import admission_for
from cluster.frontend import EngineFrontend
from cluster.ingress import DEFAULT_MAX_BODY_BYTES, app
from cluster.replica import DEFAULT_REQUEST_TIMEOUT_S, _replica_id, _replica_rank, replica_engine_config
from cluster.replica_metrics import MetricsPump
from replicas.config import EngineConfig
from replicas.remote_engine import RemoteEngine
from replicas.startup_heap import freeze_startup_heap

logger = logging.getLogger("tidal.ingress")

ENGINE_WAIT_S = 1800.0          # an engine replica loading and profiling a large model
ENGINE_POLL_S = 1.0


class IngressReplica(EngineFrontend):
    def __init__(self, engines, engine_config: EngineConfig, *, num_engines: int, ingresses_per_engine: int,
                 request_limit: int = 1 << 30, api_key: Optional[str] = None, served_model_name: Optional[str] = None,
                 max_body_bytes: int = DEFAULT_MAX_BODY_BYTES, request_timeout_s: float = DEFAULT_REQUEST_TIMEOUT_S):
        """engines: the `LLMReplica` deployment's handle; request_limit: the engine replica's, of which this
        replica admits 1 / ingresses_per_engine."""
        self._init_routes(api_key, served_model_name, max_body_bytes)
        self.request_timeout_s = request_timeout_s
        self.replica_id = _replica_id()
        self.engines = engines
        self.engines._init(_run_router_in_separate_loop=True)     # called from threads: Serve runs this on its loop
        rank = _replica_rank()
        with ThreadPoolExecutor(1) as pool:
            endpoint = pool.submit(self._find_engine, rank % num_engines).result()
        self.engine_replica_id = endpoint["replica_id"]
        self.engine = RemoteEngine(endpoint["address"], replica_engine_config(engine_config))
        self.admission = admission_for(engine_config.serving.max_queued_tokens, self.engine.info.kv_tokens,
                                       request_limit, share=ingresses_per_engine)
        self.metrics = MetricsPump(None, self.engine.model_name, self.replica_id, admission=self.admission.snapshot)
        self.metrics.start()
        freeze_startup_heap()
        logger.info("ingress replica %s (rank %d) streams from engine replica %s (admits %d prompt and output tokens, "
                    "%d requests)", self.replica_id, rank, self.engine_replica_id, self.admission.token_limit,
                    self.admission.request_limit)

    def _find_engine(self, engine_rank: int) -> dict:
        """The `core_endpoint()` of the engine replica of `engine_rank`, once it is up."""
        deadline = time.monotonic() + ENGINE_WAIT_S
        while True:
            try:
                replies = self.engines.broadcast("core_endpoint").results(timeout_s=60, return_exceptions=True)
            except (DeploymentUnavailableError, TimeoutError):       # no engine replica runs yet
                replies = []
            for reply in replies:
                if isinstance(reply, dict) and reply["rank"] == engine_rank:
                    return reply
            if time.monotonic() > deadline:
                raise RuntimeError(f"no engine replica of rank {engine_rank} came up within {ENGINE_WAIT_S:.0f} s")
            time.sleep(ENGINE_POLL_S)

    async def replicas_describe(self) -> list:
        """/stats: every engine replica (each ingress replica's admission is in its metrics)."""
        return await asyncio.to_thread(
            lambda: self.engines.broadcast("describe").results(timeout_s=30, return_exceptions=True))


# Serve replaces an ingress replica whose engine went away after three failed checks (about 6 s).
LLMIngress = serve.deployment(
    name="IngressReplica",
    health_check_period_s=2,
    health_check_timeout_s=30,
    graceful_shutdown_wait_loop_s=0.5,
    graceful_shutdown_timeout_s=120,
)(serve.ingress(app)(IngressReplica))
