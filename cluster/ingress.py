"""The OpenAI-compatible HTTP front: FastAPI on Serve, in front of the `LLMReplica` deployment.

Each prompt becomes one streaming handle call to a replica. The first frame is awaited before
any byte goes out, so rejected prompts and backpressure get a real status code; after that the
frames are turned into SSE chunks or one JSON body. A client that goes away cancels the handle
call, which aborts the request in the engine.

Serve pickles the deployment class by value when it is decorated: module helpers it uses are
defined above it, and annotations stay eager (no `from __future__ import annotations`) because
FastAPI reads the handlers' `Request` annotations at run time.
"""

import asyncio
import hmac
import json
import time
import uuid
from typing import AsyncIterator, Optional, Union

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ValidationError
from ray import serve
from ray.exceptions import RayActorError
from ray.serve.exceptions import BackPressureError, DeploymentUnavailableError
from ray.serve.handle import DeploymentHandle, DeploymentResponseGenerator

from cluster.errors import OpenAIError, from_validation_error, install_error_handlers, model_not_found, overloaded
from cluster.protocol import ChatCompletionRequest, CompletionRequest, GenerationJob, StreamFailure, StreamStart
from cluster.responses import ModelCard, ModelList, ResponseBuilder
from replicas.sampling_params import SamplingParams, SamplingParamsError

DEFAULT_MAX_BODY_BYTES = 8 << 20

app = FastAPI(title="tidal", description="OpenAI-compatible LLM serving on Ray Serve")
install_error_handlers(app)


def _sampling_params(req: Union[CompletionRequest, ChatCompletionRequest]) -> SamplingParams:
    try:
        return req.sampling_params()
    except SamplingParamsError as e:
        raise OpenAIError(400, str(e), e.param, "invalid_value") from None


def _too_large(limit: int) -> OpenAIError:
    return OpenAIError(413, f"Request body is larger than {limit} bytes.", None, "request_too_large")


def _as_openai_error(e: BaseException) -> OpenAIError:
    if isinstance(e, OpenAIError):
        return e
    if isinstance(e, BackPressureError):
        return overloaded(f"The server is overloaded, retry later ({e}).")
    if isinstance(e, (DeploymentUnavailableError, RayActorError)):
        return overloaded(f"No replica is available right now ({type(e).__name__}).")
    return OpenAIError(500, f"Generation failed: {type(e).__name__}: {e}", None, "internal_error", "server_error")


async def _call(awaitable):
    """Await a handle call; Serve's refusals become OpenAI errors (503 for overload)."""
    try:
        return await awaitable
    except (BackPressureError, DeploymentUnavailableError, RayActorError) as e:
        raise _as_openai_error(e) from None


def _sse(payload: dict) -> str:
    return f"data: {json.dumps(payload, separators=(',', ':'))}\n\n"


def _cancel_all(streams: list[DeploymentResponseGenerator]) -> None:
    """Abort calls still running (client gone, sibling prompt failed)."""
    for s in streams:
        try:
            s.cancel()
        except Exception:  # cancel() re-raises a refused call's error (e.g. BackPressureError): nothing to abort
            pass


async def _merge(streams: list[DeploymentResponseGenerator]) -> AsyncIterator[tuple[int, list]]:
    """Frames of several streams as they come, tagged with the stream's index."""
    if len(streams) == 1:
        async for frame in streams[0]:
            yield 0, frame
        return
    queue: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(i: int, s: DeploymentResponseGenerator):
        try:
            async for frame in s:
                await queue.put((i, frame))
            await queue.put((i, done))
        except Exception as e:
            await queue.put((i, e))

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(streams)
        while remaining:
            i, frame = await queue.get()
            if frame is done:
                remaining -= 1
            elif isinstance(frame, Exception):
                raise frame
            else:
                yield i, frame
    finally:
        for t in tasks:
            t.cancel()


@serve.deployment(name="OpenAIIngress", max_ongoing_requests=4096, ray_actor_options={"num_cpus": 0},
                  graceful_shutdown_wait_loop_s=0.5, graceful_shutdown_timeout_s=120)
@serve.ingress(app)
class OpenAIIngress:
    def __init__(self, replicas: DeploymentHandle, api_key: Optional[str] = None,
                 served_model_name: Optional[str] = None, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES):
        self.replicas = replicas
        self.api_key = api_key or None
        self.served_model_name = served_model_name
        self.max_body_bytes = max_body_bytes
        self.created = int(time.time())
        self._model: Optional[ModelCard] = None

    # ---- routes -----------------------------------------------------------------------

    @app.get("/health")
    async def health(self) -> JSONResponse:
        card = await self._model_card()
        return JSONResponse({"status": "ok", "model": card.id})

    @app.get("/v1/models")
    async def models(self, request: Request) -> JSONResponse:
        self._authorize(request)
        return JSONResponse(ModelList(data=[await self._model_card()]).model_dump())

    @app.get("/stats")
    async def stats(self, request: Request) -> JSONResponse:
        """Every replica's id and engine stats (an operator's view; same auth as the API)."""
        self._authorize(request)
        replies = await self.replicas.broadcast("describe").results_async(timeout_s=30, return_exceptions=True)
        return JSONResponse({"object": "list", "data": [r for r in replies if isinstance(r, dict)],
                             "unreachable": sum(1 for r in replies if not isinstance(r, dict))})

    @app.post("/v1/completions")
    async def completions(self, request: Request):
        req: CompletionRequest = await self._parse(request, CompletionRequest)
        params = _sampling_params(req)
        request_id = f"cmpl-{uuid.uuid4().hex}"
        jobs = [GenerationJob(f"{request_id}-{i}", params, prompt=p) for i, p in enumerate(req.prompts())]
        builder = ResponseBuilder("completion", request_id, req.model, params.n, len(jobs), params.logprobs,
                                  req.include_usage)
        return await self._respond(jobs, builder, req.stream)

    @app.post("/v1/chat/completions")
    async def chat_completions(self, request: Request):
        req: ChatCompletionRequest = await self._parse(request, ChatCompletionRequest)
        params = _sampling_params(req)
        request_id = f"chatcmpl-{uuid.uuid4().hex}"
        jobs = [GenerationJob(request_id, params, messages=req.chat_messages())]
        builder = ResponseBuilder("chat", request_id, req.model, params.n, 1, params.logprobs, req.include_usage)
        return await self._respond(jobs, builder, req.stream)

    # ---- request handling -------------------------------------------------------------

    def _authorize(self, request: Request) -> None:
        if self.api_key is None:
            return
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), self.api_key.encode()):
            raise OpenAIError(401, "Incorrect or missing API key; send 'Authorization: Bearer <key>'.",
                              None, "invalid_api_key")

    async def _parse(self, request: Request, model_cls: type[BaseModel]):
        self._authorize(request)
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_body_bytes:
            raise _too_large(self.max_body_bytes)
        body = await request.body()
        if len(body) > self.max_body_bytes:
            raise _too_large(self.max_body_bytes)
        try:
            req = model_cls.model_validate_json(body)
        except ValidationError as e:
            raise from_validation_error(e) from None
        card = await self._model_card()
        if req.model != card.id:
            raise model_not_found(req.model, card.id)
        return req

    async def _model_card(self) -> ModelCard:
        if self._model is None:
            info = await _call(self.replicas.describe.remote())
            self._model = ModelCard(id=self.served_model_name or info["model"], created=self.created,
                                    max_model_len=info["max_model_len"])
        return self._model

    async def _respond(self, jobs: list[GenerationJob], builder: ResponseBuilder, stream: bool):
        streams, firsts = await self._start(jobs, builder)
        if stream:
            return StreamingResponse(self._sse(streams, firsts, builder), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        done = False
        try:
            for i, first in enumerate(firsts):
                builder.add(i, first.deltas)
            async for job_index, deltas in _merge(streams):
                builder.add(job_index, deltas)
            done = True
        finally:
            if not done:
                _cancel_all(streams)
        return JSONResponse(builder.final())

    async def _start(self, jobs: list[GenerationJob],
                     builder: ResponseBuilder) -> tuple[list[DeploymentResponseGenerator], list[StreamStart]]:
        """Submit every job and wait for each first frame, turning refusals into OpenAIErrors."""
        streams = [self.replicas.options(stream=True).generate.remote(job) for job in jobs]
        try:
            firsts = await asyncio.gather(*(_call(s.__anext__()) for s in streams))
        except BaseException:
            _cancel_all(streams)
            raise
        for i, first in enumerate(firsts):
            if isinstance(first, StreamFailure):
                _cancel_all(streams)
                raise OpenAIError(first.status, first.message, first.param, first.code)
            assert isinstance(first, StreamStart), f"unexpected first frame {type(first).__name__}"
            builder.start(i, first)
        return streams, firsts

    async def _sse(self, streams: list[DeploymentResponseGenerator], firsts: list[StreamStart],
                   builder: ResponseBuilder) -> AsyncIterator[str]:
        done = False
        try:
            for chunk in builder.opening_chunks():
                yield _sse(chunk)
            for i, first in enumerate(firsts):
                for chunk in builder.add(i, first.deltas):
                    yield _sse(chunk)
            async for job_index, deltas in _merge(streams):
                for chunk in builder.add(job_index, deltas):
                    yield _sse(chunk)
            done = True
            usage = builder.usage_chunk()
            if usage is not None:
                yield _sse(usage)
        except Exception as e:  # the replica died mid-stream: tell the client in-band
            yield _sse(_as_openai_error(e).body())
        finally:
            if not done:
                _cancel_all(streams)
        yield "data: [DONE]\n\n"
