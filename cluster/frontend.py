"""The streaming front over one engine client: turns a job into frames for the OpenAI routes
(`cluster.ingress.OpenAIRoutes`), with admission by tokens and every engine failure mapped to its OpenAI error.

`EngineReplica` (cluster/replica.py) runs it over the engine it owns; `IngressReplica` (cluster/ingress_replica.py)
over a connection to another replica's engine core. The subclass sets `engine` (an `EngineClient`), `admission`,
`replica_id`, `request_timeout_s` and `metrics` (a `MetricsPump`), and calls `_init_routes`.
"""
from __future__ import annotations

import asyncio
import functools
import logging
from typing import AsyncIterator, Optional, Union

from cluster.admission import Refused, request_tokens
from cluster.errors import OpenAIError, engine_unavailable, overloaded, request_timeout, server_draining
from cluster.ingress import OpenAIRoutes
from cluster.protocol import ChoiceDelta, GenerationJob, StreamFailure, StreamStart
from cluster.tool_calls import ToolSupport
from replicas.engine_client import (ChatPrompt, EngineDeadError, EngineDraining, EngineStepError, RequestError,
                                    RequestTimeout)
from replicas.outputs import RequestOutput
from replicas.sampling_params import SamplingParamsError

logger = logging.getLogger("tidal.replica")


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


class EngineFrontend(OpenAIRoutes):
    """`generate` and the route hooks that need only the engine client (see the module's docstring)."""

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

    @functools.cached_property
    def _tool_support(self) -> ToolSupport:
        templates = self.engine.tokenizer.chat_templates
        return ToolSupport.of_template(templates.get("tool_use") or templates.get("default"))

    def max_schema_bytes(self) -> int:
        return self.engine.config.limits.max_schema_bytes

    def engine_problem(self) -> Optional[str]:
        """None while the engine serves, else why not, in a few words a client may see: /health answers 503 and
        `check_health` fails (with the details), so Serve replaces this replica."""
        health = self.engine.health()
        if health.stuck:
            return f"its core has not stepped for {health.seconds_since_heartbeat:.0f} s"
        if not health.alive:
            return "its core is not running"
        return None

    def __del__(self):
        # Serve calls this after in-flight requests drained; idempotent (tests call it before the GC does).
        metrics, self.metrics = getattr(self, "metrics", None), None
        if metrics is not None:
            metrics.stop()
        engine, self.engine = getattr(self, "engine", None), None
        if engine is not None:
            engine.shutdown()

    def check_health(self) -> None:
        problem = self.engine_problem()
        if problem is not None:
            raise RuntimeError(f"replica {self.replica_id}: the engine is unavailable: {problem} "
                               f"({self.engine.health().detail})")
