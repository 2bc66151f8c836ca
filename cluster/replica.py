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
from typing import AsyncIterator, Optional, Union

from ray import serve
from ray.serve.exceptions import RayServeException

from cluster.admission import Refused, admission_for, request_tokens
from cluster.errors import OpenAIError, engine_unavailable, overloaded, request_timeout, server_draining
from cluster.ingress import DEFAULT_MAX_BODY_BYTES, OpenAIRoutes, app
from cluster.protocol import ChoiceDelta, GenerationJob, StreamFailure, StreamStart
from cluster.rank_actor import RayRankLauncher
from cluster.recent_requests import RecentRequests
from cluster.replica_metrics import MetricsPump
from cluster.tool_calls import ToolSupport
from replicas.async_engine import (AsyncLLMEngine, ChatPrompt, EngineDeadError, EngineDraining, EngineStepError,
                                   RequestError, RequestTimeout)
from replicas import envs
from replicas.config import EngineConfig
from replicas.outputs import RequestOutput
from replicas.sampling_params import SamplingParamsError
from replicas.startup_heap import freeze_startup_heap
from replicas.stats import EngineStats

logger = logging.getLogger("tidal.replica")

RECONFIGURABLE_KNOBS = ("max_num_batched_tokens", "elastic", "speculation")
DEFAULT_REQUEST_TIMEOUT_S = 600.0
CONTROLLER_LOG = 32             # the fleet controller's last decisions each replica keeps (`tidal controller status`)
RECENT_S = 120.0                # how far back `describe(recent=True)` reports finished requests


def replica_engine_config(config: EngineConfig) -> EngineConfig:
    """The config a replica's engine runs: the stream-item budget (EngineConfig's stream_item_ms), when the config
    leaves it unset, is $TIDAL_STREAM_ITEM_MS or 0.1 ms (replicas/envs.py). Each of the n streams a step touched
    then reports at most every (n - 1) x that, so a replica loads and sends at most ~10,000 items/s however many
    streams it serves (every item is work on this process's GIL); below that rate every stream gets every step
    (0: an output per engine step, always)."""
    if config.serving.stream_item_ms is not None:
        return config
    return config.with_(stream_item_ms=envs.stream_item_ms())


def _replica_id() -> str:
    try:
        return serve.get_replica_context().replica_id.unique_id
    except RayServeException:  # Serve's local testing mode has no replica context during __init__
        return f"local-{uuid.uuid4().hex[:8]}"


def _deltas(out: RequestOutput, reported: set[int]) -> list[ChoiceDelta]:
    """The new part of every choice in one engine output; a finish reason is sent once per choice."""
    deltas = []
    for o in out.outputs:
        finish = o.finish_reason if o.finish_reason is not None and o.index not in reported else None
        if not o.delta_token_ids and not o.delta_text and finish is None:
            continue
        if finish is not None:
            reported.add(o.index)
        n_new = len(o.delta_token_ids)
        logprobs = list(o.logprobs[-n_new:]) if (o.logprobs and n_new) else None
        deltas.append(ChoiceDelta(o.index, o.delta_text, list(o.delta_token_ids), logprobs, finish))
    return deltas


def _merge(deltas: list[ChoiceDelta]) -> list[ChoiceDelta]:
    """Consecutive deltas of the same choices as one delta per choice (text, tokens and logprobs in order); a
    choice with one delta passes through, the inputs are never modified."""
    merged: dict[int, ChoiceDelta] = {}
    for d in deltas:
        m = merged.get(d.index)
        if m is None:
            merged[d.index] = d
            continue
        logprobs = m.logprobs + d.logprobs if m.logprobs is not None and d.logprobs is not None else \
            (m.logprobs or d.logprobs)
        merged[d.index] = ChoiceDelta(d.index, m.text + d.text, m.token_ids + d.token_ids, logprobs,
                                      d.finish_reason or m.finish_reason)
    return list(merged.values())


def _failure(e: Exception, default_param: str) -> StreamFailure:
    code = getattr(e, "code", None)
    if code is None and isinstance(e, (RequestError, SamplingParamsError)):
        code = "invalid_value"
    return StreamFailure(400, str(e), getattr(e, "param", None) or default_param, code)


def _as_failure(e: OpenAIError) -> StreamFailure:
    return StreamFailure(e.status, e.message, e.param, e.code, e.retry_after_s)


class EngineReplica(OpenAIRoutes):
    """One engine and the routes in front of it; `LLMReplica` is this class as a Serve ingress deployment."""

    def __init__(self, engine_config: EngineConfig, cpus_per_rank: float = 1.0, *, request_limit: int = 1 << 30,
                 api_key: Optional[str] = None, served_model_name: Optional[str] = None,
                 max_body_bytes: int = DEFAULT_MAX_BODY_BYTES, request_timeout_s: float = DEFAULT_REQUEST_TIMEOUT_S):
        """request_limit: jobs in flight (generating or waiting in the engine) beyond which new ones get a 503, a
        safety bound above the token limit (cluster/admission.py, EngineConfig's max_queued_tokens);
        request_timeout_s: a job still running that long after it arrived is aborted (a 504, or in-band)."""
        self._init_routes(api_key, served_model_name, max_body_bytes)
        self.request_timeout_s = request_timeout_s
        self.replica_id = _replica_id()
        self.launcher: Optional[RayRankLauncher] = None
        if engine_config.tensor_parallel_size > 1:
            self.launcher = RayRankLauncher(engine_config.device == "cuda", cpus_per_rank)
        self.engine = AsyncLLMEngine(replica_engine_config(engine_config), worker_launcher=self.launcher)
        templates = self.engine.tokenizer.chat_templates
        self._tool_support = ToolSupport.of_template(templates.get("tool_use") or templates.get("default"))
        self.admission = admission_for(engine_config.serving.max_queued_tokens, self.engine.info.kv_tokens,
                                       request_limit)
        self._peers = None                   # this deployment's handle, for /stats
        self.recent = RecentRequests()
        self.controller_state: dict = {}                    # the fleet controller's, kept for its restarts
        self.controller_log: deque[dict] = deque(maxlen=CONTROLLER_LOG)
        self.metrics = MetricsPump(self.engine, self.engine.model_name, self.replica_id, on_finished=self.recent.add,
                                   admission=self.admission.snapshot)
        self.metrics.start()
        logger.info("replica %s serving %s (tp=%d; admits %d prompt and output tokens, %d requests)", self.replica_id,
                    self.engine.model_name, engine_config.tensor_parallel_size, self.admission.token_limit,
                    request_limit)

    async def generate(self, job: GenerationJob) -> AsyncIterator[Union[StreamStart, StreamFailure, list[ChoiceDelta]]]:
        """Stream one job. Closing the stream (client gone) closes the engine stream, which aborts the request. The
        job holds its admission ticket until the stream ends, however it ends."""
        try:
            ticket = self.admission.enter()
        except Refused as e:
            yield _as_failure(overloaded(str(e), e.retry_after_s))
            return
        param = "messages" if job.messages is not None else "prompt"
        deadline = asyncio.get_running_loop().time() + self.request_timeout_s
        max_model_len = self.engine.max_model_len

        def admit(ids: list[int]) -> None:
            ticket.charge(request_tokens(len(ids), job.params, max_model_len))

        stream = self.engine.generate_batches(self._prompt(job), job.params, job.request_id, deadline=deadline,
                                              admit=admit)
        started = False
        reported: set[int] = set()
        try:
            async for outs in stream:
                deltas = _merge([d for out in outs for d in _deltas(out, reported)])
                if not started:
                    started = True
                    yield StreamStart(self.replica_id, len(outs[0].prompt_token_ids), deltas)
                elif deltas:
                    yield deltas
        except Refused as e:          # before the request reached the engine: nothing started
            yield _as_failure(overloaded(str(e), e.retry_after_s))
        except RequestTimeout:
            logger.warning("request %s passed its deadline (%g s) and was aborted", job.request_id,
                           self.request_timeout_s)
            if started:
                raise request_timeout(self.request_timeout_s, job.request_id) from None
            yield _as_failure(request_timeout(self.request_timeout_s, job.request_id))
        except EngineDraining:
            logger.warning("request %s was still running when the drain period ended; aborted", job.request_id)
            if started:
                raise server_draining(job.request_id) from None
            yield _as_failure(server_draining(job.request_id))
        except EngineDeadError as e:
            logger.error("request %s failed: %s", job.request_id, e)
            if started:
                raise engine_unavailable(job.request_id) from None
            yield _as_failure(engine_unavailable(job.request_id))
        except EngineStepError as e:  # the step running it failed; the engine goes on, so a retry may pass
            logger.error("request %s failed: %s", job.request_id, e)
            error = OpenAIError(503, f"{e}; retry (request {job.request_id}).", None, "engine_step_failed")
            if started:
                raise error from None
            yield _as_failure(error)
        except ValueError as e:       # RequestError (empty or too long prompt, bad ids) or a refused chat
            if started:
                raise
            yield _failure(e, param)
        except OSError:               # the core's pipe closed before the reader thread saw it die
            if self.engine.is_alive():
                raise
            if started:
                raise engine_unavailable(job.request_id) from None
            yield _as_failure(engine_unavailable(job.request_id))
        finally:
            try:
                await stream.aclose()
            finally:
                ticket.release()

    async def begin_drain(self, within_s: float) -> None:
        """The server is stopping: requests still running `within_s` from now end with a 503 `shutting_down`
        (in-band on a stream, then [DONE]), so every client gets an answer before Serve's drain period
        (graceful_shutdown_timeout_s) ends and the replica is killed."""
        loop = asyncio.get_running_loop()
        loop.call_later(max(0.0, within_s), lambda: self.engine.fail_streams(EngineDraining("the drain period ended")))

    @staticmethod
    def _prompt(job: GenerationJob) -> Union[str, list[int], ChatPrompt]:
        return ChatPrompt(job.messages, job.tools) if job.messages is not None else job.prompt

    def model_identity(self) -> tuple[str, int]:
        return self.engine.model_name, self.engine.max_model_len

    def tool_support(self) -> ToolSupport:
        return self._tool_support

    def max_schema_bytes(self) -> int:
        return self.engine.config.limits.max_schema_bytes

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
        """None while the engine serves, else why not, in a few words a client may see: /health answers 503 and
        `check_health` fails (with the details), so Serve replaces this replica."""
        health = self.engine.health()
        if health.stuck:
            return f"its core has not stepped for {health.seconds_since_heartbeat:.0f} s"
        if not health.alive:
            return "its core is not running"
        if self.launcher is not None and self.launcher.exited_ranks():
            return f"TP ranks {self.launcher.exited_ranks()} exited"
        return None

    def check_health(self) -> None:
        problem = self.engine_problem()
        if problem is not None:
            raise RuntimeError(f"replica {self.replica_id}: the engine is unavailable: {problem} "
                               f"({self.engine.health().detail})")

    def __del__(self):
        # Serve calls this after in-flight requests drained (graceful_shutdown_timeout_s).
        # The engine shuts its TP ranks' launcher down too. Idempotent: tests call it before the GC does.
        metrics, self.metrics = getattr(self, "metrics", None), None
        if metrics is not None:
            metrics.stop()
        engine, self.engine = getattr(self, "engine", None), None
        if engine is not None:
            engine.shutdown()


class ServedEngineReplica(EngineReplica):
    """An EngineReplica in a Serve replica process of its own, whose start-up heap is frozen once the engine is up
    (replicas/startup_heap.py): the process's full collections then walk only what serving allocates."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        freeze_startup_heap()


# Serve replaces a replica after three failed checks in a row: with a dead or stuck engine, within ~6 s.
LLMReplica = serve.deployment(
    name="LLMReplica",
    health_check_period_s=2,
    health_check_timeout_s=30,
    graceful_shutdown_wait_loop_s=0.5,
    graceful_shutdown_timeout_s=120,
)(serve.ingress(app)(ServedEngineReplica))
