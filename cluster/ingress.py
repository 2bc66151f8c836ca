"""The OpenAI-compatible HTTP front: the FastAPI routes every `LLMReplica` serves itself.

There is one deployment: the replica that owns an engine is also the HTTP ingress (Serve's proxy routes each
request to a replica, and the replica streams SSE back), so a token crosses one Ray hop, not two. Each prompt
becomes one local stream of frames (`StreamStart` or `StreamFailure` first, then lists of `ChoiceDelta`). The
first frame is awaited before any byte goes out, so rejected prompts and overload get a real status code; after
that the frames are turned into SSE chunks or one JSON body. A client that goes away cancels the request, which
closes its streams and aborts them in the engine.

Serve pickles the deployment class by value when it is decorated: module helpers it uses are defined above it,
and annotations stay eager (no `from __future__ import annotations`) because FastAPI reads the handlers'
`Request` annotations at run time. `make_fastapi_class_based_view` finds routes defined on a base class.
"""

import asyncio
import hmac
import logging
import time
import uuid
from typing import Any, AsyncIterator, Callable, Optional, Union

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ValidationError

from cluster.errors import (ErrorResponse, OpenAIError, from_validation_error, install_error_handlers,
                            model_not_found, public_error)
from cluster.protocol import ChatCompletionRequest, CompletionRequest, GenerationJob, StreamFailure, StreamStart
from cluster.responses import ChatCompletionResponse, CompletionResponse, HealthStatus, ModelCard, ModelList, \
    ResponseBuilder, sse_event
from cluster.tool_calls import template_messages
from replicas.sampling_params import SamplingParams, SamplingParamsError

DEFAULT_MAX_BODY_BYTES = 8 << 20

logger = logging.getLogger("tidal.ingress")

Frames = AsyncIterator[Union[StreamStart, StreamFailure, list]]


class OpenAIApp(FastAPI):
    """FastAPI whose OpenAPI document also holds the request models the generation routes read themselves (they
    parse the body by hand: a size limit while reading, OpenAI-style errors), under components/schemas."""

    request_models: tuple[type[BaseModel], ...] = (CompletionRequest, ChatCompletionRequest)

    def openapi(self) -> dict[str, Any]:
        if self.openapi_schema is None:
            schema = super().openapi()
            components = schema.setdefault("components", {}).setdefault("schemas", {})
            for model in self.request_models:
                body = model.model_json_schema(ref_template="#/components/schemas/{model}")
                components.update(body.pop("$defs", {}))
                components[model.__name__] = body
        return self.openapi_schema


def _json_body(model: type[BaseModel]) -> dict:
    """`openapi_extra` of a route that reads `model` from its JSON body itself."""
    ref = {"$ref": f"#/components/schemas/{model.__name__}"}
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": ref}}}}


def _errors(*statuses: int) -> dict:
    return {status: {"model": ErrorResponse, "description": "an OpenAI error object"} for status in statuses}


_SSE = {"text/event-stream": {"schema": {"type": "string"},
                              "description": "with stream=true: `data: {chunk}` events, then `data: [DONE]`"}}
_GENERATION_ERRORS = _errors(400, 401, 404, 413, 422, 500, 503, 504)

app = OpenAIApp(title="tidal", description="OpenAI-compatible LLM serving on Ray Serve")
install_error_handlers(app)


def _sampling_params(build: Callable[[], SamplingParams]) -> SamplingParams:
    try:
        return build()
    except SamplingParamsError as e:
        raise OpenAIError(400, str(e), e.param, "invalid_value") from None


def _too_large(limit: int) -> OpenAIError:
    return OpenAIError(413, f"Request body is larger than {limit} bytes.", None, "request_too_large")


async def _read_body(request: Request, limit: int) -> bytes:
    """The body, refused with a 413 as soon as it passes `limit` bytes (a chunked body has no length up front)."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise _too_large(limit)
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > limit:
            raise _too_large(limit)
    return bytes(body)


class _PromptStreams:
    """The streams of one request's prompts. Each stream is iterated by one task at a time; `close()` first
    cancels and awaits those tasks, then closes every stream (which aborts its request): closing a stream that
    another task is still running would fail ("aclose(): asynchronous generator is already running")."""

    def __init__(self, streams: list):
        self.streams = streams
        self._tasks: list[asyncio.Future] = []

    async def first_frames(self) -> list:
        self._tasks = [asyncio.ensure_future(s.__anext__()) for s in self.streams]
        return await asyncio.gather(*self._tasks)

    async def frames(self) -> AsyncIterator[tuple[int, list]]:
        """Frames of every stream as they come, tagged with the stream's index; the first error is raised."""
        if len(self.streams) == 1:
            async for frame in self.streams[0]:
                yield 0, frame
            return
        queue: asyncio.Queue = asyncio.Queue()
        done = object()

        async def pump(i: int, s):
            try:
                async for frame in s:
                    queue.put_nowait((i, frame))
                queue.put_nowait((i, done))
            except Exception as e:
                queue.put_nowait((i, e))

        self._tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(self.streams)]
        remaining = len(self.streams)
        while remaining:
            i, frame = await queue.get()
            if frame is done:
                remaining -= 1
            elif isinstance(frame, Exception):
                raise frame
            else:
                yield i, frame

    async def close(self) -> None:
        """Runs to its end even when the caller is cancelled (a client that left): every request is aborted."""
        await asyncio.shield(asyncio.ensure_future(self._close()))

    async def _close(self) -> None:
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        for s in self.streams:
            try:
                await s.aclose()
            except Exception:
                logger.exception("closing a generation stream failed")


class OpenAIRoutes:
    """The routes and their HTTP handling. The subclass owns the engine and provides `generate(job)` (an async
    iterator of one job's frames; it refuses work beyond its queue with a 503 `StreamFailure` carrying a
    Retry-After, and raises an `OpenAIError` for a failure after the first frame), `model_identity()` -> (name,
    max_model_len), `engine_problem()` -> None or why the engine cannot serve, `async replicas_describe()` (every
    replica's `describe()`), `tool_support()` -> the served chat template's `cluster.tool_calls.ToolSupport` and
    `max_schema_bytes()` -> the engine's bound on the JSON schemas of one request."""

    def _init_routes(self, api_key: Optional[str], served_model_name: Optional[str], max_body_bytes: int) -> None:
        self.api_key = api_key or None
        self.served_model_name = served_model_name
        self.max_body_bytes = max_body_bytes
        self.created = int(time.time())

    # ---- routes -----------------------------------------------------------------------

    @app.get("/health", responses={200: {"model": HealthStatus}, **_errors(503)})
    async def health(self) -> JSONResponse:
        """200 while this replica's engine serves; 503 when its core process died or stopped stepping."""
        problem = self.engine_problem()
        if problem is not None:
            raise OpenAIError(503, f"This replica's engine is unavailable: {problem}.", None, "engine_unavailable")
        return JSONResponse(HealthStatus(model=self._model_card().id).model_dump())

    @app.get("/v1/models", responses={200: {"model": ModelList}, **_errors(401)})
    async def models(self, request: Request) -> JSONResponse:
        self._authorize(request)
        return JSONResponse(ModelList(data=[self._model_card()]).model_dump())

    @app.get("/stats", responses={200: {"description": "every replica's id and engine stats"}, **_errors(401)})
    async def stats_route(self, request: Request) -> JSONResponse:
        """Every replica's id and engine stats (an operator's view; same auth as the API)."""
        self._authorize(request)
        replies = await self.replicas_describe()
        return JSONResponse({"object": "list", "data": [r for r in replies if isinstance(r, dict)],
                             "unreachable": sum(1 for r in replies if not isinstance(r, dict))})

    @app.post("/v1/completions", openapi_extra=_json_body(CompletionRequest),
              responses={200: {"model": CompletionResponse, "content": _SSE}, **_GENERATION_ERRORS})
    async def completions(self, request: Request):
        request_id = request.state.request_id = f"cmpl-{uuid.uuid4().hex}"
        req: CompletionRequest = await self._parse(request, CompletionRequest)
        params = _sampling_params(lambda: req.sampling_params(self.max_schema_bytes()))
        jobs = [GenerationJob(f"{request_id}-{i}", params, prompt=p) for i, p in enumerate(req.prompts())]
        builder = ResponseBuilder("completion", request_id, req.model, params.n, len(jobs), params.logprobs,
                                  req.include_usage)
        return await self._respond(jobs, builder, req.stream)

    @app.post("/v1/chat/completions", openapi_extra=_json_body(ChatCompletionRequest),
              responses={200: {"model": ChatCompletionResponse, "content": _SSE}, **_GENERATION_ERRORS})
    async def chat_completions(self, request: Request):
        request_id = request.state.request_id = f"chatcmpl-{uuid.uuid4().hex}"
        req: ChatCompletionRequest = await self._parse(request, ChatCompletionRequest)
        support = self.tool_support()
        tools = req.tool_plan(support, self.max_schema_bytes())
        params = _sampling_params(lambda: req.sampling_params(tools, self.max_schema_bytes()))
        messages, offered = template_messages(req.chat_messages(), tools.offered, support)
        jobs = [GenerationJob(request_id, params, messages=messages, tools=offered)]
        builder = ResponseBuilder("chat", request_id, req.model, params.n, 1, params.logprobs, req.include_usage,
                                  tool_format=support.call_format if tools.parse else None)
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
        body = await _read_body(request, self.max_body_bytes)
        try:
            req = model_cls.model_validate_json(body)
        except ValidationError as e:
            raise from_validation_error(e) from None
        card = self._model_card()
        if req.model != card.id:
            raise model_not_found(req.model, card.id)
        return req

    def _model_card(self) -> ModelCard:
        name, max_model_len = self.model_identity()
        return ModelCard(id=self.served_model_name or name, created=self.created, max_model_len=max_model_len)

    async def _respond(self, jobs: list[GenerationJob], builder: ResponseBuilder, stream: bool):
        streams, firsts = await self._start(jobs, builder)
        if stream:
            return StreamingResponse(self._sse(streams, firsts, builder), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        group = _PromptStreams(streams)
        done = False
        try:
            for i, first in enumerate(firsts):
                builder.add(i, first.deltas)
            async for job_index, deltas in group.frames():
                builder.add(job_index, deltas)
            done = True
        except Exception as e:
            raise public_error(e, builder.id) from None
        finally:
            if not done:
                await group.close()
        return JSONResponse(builder.final())

    async def _start(self, jobs: list[GenerationJob], builder: ResponseBuilder) -> tuple[list, list[StreamStart]]:
        """Open every job's stream and wait for each first frame, turning refusals into OpenAIErrors."""
        group = _PromptStreams([self.generate(job) for job in jobs])
        try:
            firsts = await group.first_frames()
        except BaseException as e:
            await group.close()
            if isinstance(e, Exception):
                raise public_error(e, builder.id) from None
            raise
        for i, first in enumerate(firsts):
            if isinstance(first, StreamFailure):
                await group.close()
                raise OpenAIError(first.status, first.message, first.param, first.code,
                                  retry_after_s=first.retry_after_s)
            assert isinstance(first, StreamStart), f"unexpected first frame {type(first).__name__}"
            builder.start(i, first)
        return group.streams, firsts

    async def _sse(self, streams: list, firsts: list[StreamStart], builder: ResponseBuilder) -> AsyncIterator[str]:
        """The events of one frame go out as one write (each write is a trip through Serve's and Starlette's
        send wrappers and a syscall); the last frame's wait for the streams' end and go with the usage chunk and
        [DONE]. A failure after the first frame (the engine died, the deadline passed, a sibling prompt failed)
        ends the stream with one error event and [DONE]."""
        group = _PromptStreams(streams)
        done = False
        events = builder.opening_events()
        try:
            for i, first in enumerate(firsts):
                events += builder.add_events(i, first.deltas)
            if events and not builder.finished:
                yield events
                events = ""
            async for job_index, deltas in group.frames():
                events += builder.add_events(job_index, deltas)
                if events and not builder.finished:
                    yield events
                    events = ""
            done = True
            events += builder.usage_event()
        except Exception as e:
            events += sse_event(public_error(e, builder.id).body())
        finally:
            if not done:
                await group.close()
        yield events + "data: [DONE]\n\n"
