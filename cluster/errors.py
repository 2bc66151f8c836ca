"""OpenAI-shaped errors: `{"error": {"message", "type", "param", "code"}}` and the FastAPI handlers.

Status rules: unparsable JSON and out-of-range values are 400, a body of the wrong shape or
types (pydantic schema) is 422, a missing or wrong API key 401, an unknown model or route 404,
an oversized body 413, anything unexpected 500 ("internal error" and the request id; the
traceback goes to the server's log only), an overloaded replica (with a Retry-After header) or a
dead or stuck engine 503, a request past its deadline 504.
"""
from __future__ import annotations

import logging
import uuid
from typing import Optional

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

logger = logging.getLogger("tidal.ingress")

_TYPE_BY_STATUS = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    422: "invalid_request_error",
    503: "server_error",
    504: "server_error",
}


class ErrorObject(BaseModel):
    message: str
    type: str
    param: Optional[str] = None
    code: Optional[str] = None


class ErrorResponse(BaseModel):
    """The body of every error answer (the OpenAPI description of 4xx and 5xx)."""
    error: ErrorObject


class OpenAIError(Exception):
    """An error the API reports to the client; `status` is the HTTP status."""

    def __init__(self, status: int, message: str, param: Optional[str] = None,
                 code: Optional[str] = None, type: Optional[str] = None, retry_after_s: Optional[int] = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.type = type or _TYPE_BY_STATUS.get(status, "server_error" if status >= 500 else "invalid_request_error")
        self.retry_after_s = retry_after_s

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        headers = {}
        if self.status == 401:
            headers["WWW-Authenticate"] = "Bearer"
        if self.retry_after_s is not None:
            headers["Retry-After"] = str(self.retry_after_s)
        return JSONResponse(self.body(), status_code=self.status, headers=headers or None)


def bad_request(message: str, param: Optional[str] = None, code: Optional[str] = None) -> OpenAIError:
    return OpenAIError(400, message, param, code)


def model_not_found(model: str, served: str) -> OpenAIError:
    return OpenAIError(404, f"The model '{model}' does not exist; this server serves '{served}'.",
                       "model", "model_not_found")


def overloaded(message: str, retry_after_s: int) -> OpenAIError:
    return OpenAIError(503, message, None, "overloaded", retry_after_s=retry_after_s)


def engine_unavailable(request_id: str) -> OpenAIError:
    return OpenAIError(503, f"This replica's engine is unavailable; retry (request {request_id}).", None,
                       "engine_unavailable")


def server_draining(request_id: str) -> OpenAIError:
    return OpenAIError(503, f"The server is shutting down and its drain period ended before this request did; "
                            f"retry (request {request_id}).", None, "shutting_down")


def request_timeout(timeout_s: float, request_id: str) -> OpenAIError:
    return OpenAIError(504, f"The request did not finish within {timeout_s:g} s and was aborted "
                       f"(request {request_id}).", None, "timeout")


def internal_error(request_id: str) -> OpenAIError:
    return OpenAIError(500, f"internal error (request {request_id})", None, "internal_error", "server_error")


def public_error(exc: BaseException, request_id: str) -> OpenAIError:
    """What a client may see of an exception: an OpenAIError as it is; anything else is logged here with its
    traceback and the request id, and the client gets only "internal error" and the id."""
    if isinstance(exc, OpenAIError):
        return exc
    logger.error("request %s failed", request_id, exc_info=exc)
    return internal_error(request_id)


def from_validation_error(exc: ValidationError) -> OpenAIError:
    """Pydantic errors: broken JSON is a 400, anything else (types, missing fields) a 422."""
    errors = exc.errors(include_url=False)
    first = errors[0] if errors else {"loc": (), "msg": str(exc), "type": ""}
    if first.get("type") == "json_invalid":
        return OpenAIError(400, f"We could not parse the JSON body of your request: {first['msg']}",
                           None, "invalid_json")
    param = _dotted(first.get("loc", ()))
    message = "; ".join(f"{_dotted(e.get('loc', ())) or 'body'}: {e['msg']}" for e in errors[:5])
    return OpenAIError(422, message, param or None, "invalid_type" if param else "invalid_body")


_UNION_TAGS = {"str", "int", "float", "bool", "list", "dict", "none"}


def _dotted(loc) -> str:
    """('messages', 0, 'content', 'str') -> 'messages[0].content' (pydantic adds union member tags)."""
    parts: list[str] = []
    for item in loc:
        if item == "body":
            continue
        if isinstance(item, str) and (item in _UNION_TAGS or "[" in item or "-" in item):
            break
        if isinstance(item, int):
            parts.append(f"[{item}]")
        else:
            parts.append(("." if parts else "") + str(item))
    return "".join(parts)


def install_error_handlers(app: FastAPI) -> None:
    """Make every error the app can raise come back in the OpenAI shape."""

    @app.exception_handler(OpenAIError)
    async def _openai_error(_: Request, exc: OpenAIError):
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _request_validation(_: Request, exc: RequestValidationError):
        errors = exc.errors()
        param = _dotted(errors[0].get("loc", ())) if errors else None
        return OpenAIError(422, str(errors[:5]), param or None, "invalid_type").response()

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, exc: StarletteHTTPException):
        return OpenAIError(exc.status_code, str(exc.detail), None, None).response()

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception):
        request_id = getattr(request.state, "request_id", None) or f"req-{uuid.uuid4().hex}"
        return public_error(exc, request_id).response()
