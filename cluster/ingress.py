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
import json
import time
import uuid
from typing import AsyncIterator, Optional, Union

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ValidationError

from cluster.errors import OpenAIError, from_validation_error, install_error_handlers, model_not_found
from cluster.protocol import ChatCompletionRequest, CompletionRequest, GenerationJob, StreamFailure, StreamStart
from cluster.responses import ModelCard, ModelList, ResponseBuilder
from replicas.sampling_params import SamplingParams, SamplingParamsError

DEFAULT_MAX_BODY_BYTES = 8 << 20

app = FastAPI(title="tidal", description="OpenAI-compatible LLM serving on Ray Serve")
install_error_handlers(app)

Frames = AsyncIterator[Union[StreamStart, StreamFailure, list]]


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
    return OpenAIError(500, f"Generation failed: {type(e).__name__}: {e}", None, "internal_error", "server_error")


def _sse(payload: dict) -> str:
    return f"data: {json.dumps(payload, separators=(',', ':'))}\n\n"


async def _close_all(streams: list) -> None:
    """Close streams still running (client gone, sibling prompt failed): each aborts its request."""
    for s in streams:
        await s.aclose()


async def _merge(streams: list) -> AsyncIterator[tuple[int, list]]:
    """Frames of several streams as they come, tagged with the stream's index."""
    if len(streams) == 1:
        async for frame in streams[0]:
            yield 0, frame
        return
    queue: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(i: int, s):
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


class OpenAIRoutes:
    """The routes and their HTTP handling. The subclass owns the engine and provides `generate(job)` (an async
    iterator of one job's frames; it refuses work beyond its queue with a 503 `StreamFailure`),
    `model_identity()` -> (name, max_model_len) and `async replicas_describe()` (every replica's `describe()`)."""

    def _init_routes(self, api_key: Optional[str], served_model_name: Optional[str], max_body_bytes: int) -> None:
        self.api_key = api_key or None
        self.served_model_name = served_model_name
        self.max_body_bytes = max_body_bytes
        self.created = int(time.time())

    # ---- routes -----------------------------------------------------------------------

    @app.get("/health")
    async def health(self) -> JSONResponse:
        return JSONResponse({"status": "ok", "model": self._model_card().id})

    @app.get("/v1/models")
    async def models(self, request: Request) -> JSONResponse:
        self._authorize(request)
        return JSONResponse(ModelList(data=[self._model_card()]).model_dump())

    @app.get("/stats")
    async def stats_route(self, request: Request) -> JSONResponse:
        """Every replica's id and engine stats (an operator's view; same auth as the API)."""
        self._authorize(request)
        replies = await self.replicas_describe()
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
        done = False
        try:
            for i, first in enumerate(firsts):
                builder.add(i, first.deltas)
            async for job_index, deltas in _merge(streams):
                builder.add(job_index, deltas)
            done = True
        finally:
            if not done:
                await _close_all(streams)
        return JSONResponse(builder.final())

    async def _start(self, jobs: list[GenerationJob], builder: ResponseBuilder) -> tuple[list, list[StreamStart]]:
        """Open every job's stream and wait for each first frame, turning refusals into OpenAIErrors."""
        streams = [self.generate(job) for job in jobs]
        try:
            firsts = await asyncio.gather(*(s.__anext__() for s in streams))
        except BaseException:
            await _close_all(streams)
            raise
        for i, first in enumerate(firsts):
            if isinstance(first, StreamFailure):
                await _close_all(streams)
                raise OpenAIError(first.status, first.message, first.param, first.code)
            assert isinstance(first, StreamStart), f"unexpected first frame {type(first).__name__}"
            builder.start(i, first)
        return streams, firsts

    async def _sse(self, streams: list, firsts: list[StreamStart], builder: ResponseBuilder) -> AsyncIterator[str]:
        """The events of one frame go out as one write (each write is a trip through Serve's and Starlette's
        send wrappers and a syscall); the last frame's wait for the streams' end and go with the usage chunk and
        [DONE]."""
        done = False
        events = [_sse(c) for c in builder.opening_chunks()]
        try:
            for i, first in enumerate(firsts):
                events += [_sse(c) for c in builder.add(i, first.deltas)]
            if events and not builder.finished:
                yield "".join(events)
                events = []
            async for job_index, deltas in _merge(streams):
                events += [_sse(c) for c in builder.add(job_index, deltas)]
                if events and not builder.finished:
                    yield "".join(events)
                    events = []
            done = True
            usage = builder.usage_chunk()
            if usage is not None:
                events.append(_sse(usage))
        except Exception as e:  # the engine died mid-stream: tell the client in-band
            events.append(_sse(_as_openai_error(e).body()))
        finally:
            if not done:
                await _close_all(streams)
        yield "".join(events) + "data: [DONE]\n\n"
