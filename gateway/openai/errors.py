"""Errors in OpenAI's shape `{"error": {"message", "type", "param", "code"}}`, and the
app's exception handlers (FastAPI's 422 validation errors become 400)."""
from __future__ import annotations

import logging

import grpc
from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..prompt import PromptError
from ..request import GatewayError
from ..validate import InvalidInput

log = logging.getLogger(__name__)

_STATUS = {  # grpc status -> (http status, OpenAI error type)
    grpc.StatusCode.INVALID_ARGUMENT: (400, "invalid_request_error"),
    grpc.StatusCode.FAILED_PRECONDITION: (400, "invalid_request_error"),
    grpc.StatusCode.NOT_FOUND: (404, "not_found_error"),
    grpc.StatusCode.UNAUTHENTICATED: (401, "authentication_error"),
    grpc.StatusCode.RESOURCE_EXHAUSTED: (429, "rate_limit_error"),
    grpc.StatusCode.UNAVAILABLE: (503, "service_unavailable"),
    grpc.StatusCode.DEADLINE_EXCEEDED: (504, "timeout"),
}


class OpenAIError(Exception):
    def __init__(self, status: int, message: str, type_: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None,
                 retry_after_s: int | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code
        self.retry_after_s = retry_after_s

    @classmethod
    def from_gateway(cls, e: GatewayError, message: str | None = None) -> "OpenAIError":
        """`message`: the client's version of e.message (gateway/redact.py)."""
        status, type_ = _STATUS.get(e.code, (500, "internal_error"))
        return cls(status, e.message if message is None else message, type_, None,
                   e.code.name.lower(), e.retry_after_s)

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}

    def response(self) -> JSONResponse:
        headers = {"WWW-Authenticate": "Bearer"} if self.status == 401 else {}
        if self.retry_after_s is not None:
            headers["Retry-After"] = str(self.retry_after_s)
        return JSONResponse(self.body(), status_code=self.status, headers=headers or None)


def bad(message: str, param: str | None = None, code: str | None = None) -> OpenAIError:
    return OpenAIError(400, message, "invalid_request_error", param, code)


def from_prompt(e: PromptError, param: str) -> OpenAIError:
    """A rejected prompt, worded as OpenAI words it (clients match "maximum context length")."""
    L, n, exceeded = e.context_length, e.num_tokens, "context_length_exceeded"
    if e.kind == "empty":
        return bad("prompt must not be empty", param)
    if e.kind == "negative":
        return bad("prompt token ids must be >= 0", param)
    if e.kind == "too_long":
        return bad(f"this model's maximum context length is {L} tokens, but the prompt has "
                   f"{n} tokens", param, exceeded)
    if e.kind == "no_room":
        return bad(f"this model's maximum context length is {L} tokens; the prompt has {n} and "
                   f"max_tokens asks for {e.max_tokens} more", "max_tokens", exceeded)
    return bad(e.message, param)


def unknown_model(served: list[str], model: str) -> OpenAIError:
    return OpenAIError(404, f"the model {model!r} does not exist; this server serves "
                       f"{', '.join(map(repr, served))}", "invalid_request_error", "model",
                       "model_not_found")


def install_handlers(app: FastAPI) -> None:
    """Every error the app returns has OpenAI's shape."""

    @app.exception_handler(OpenAIError)
    async def _openai_error(_, e: OpenAIError):
        return e.response()

    @app.exception_handler(InvalidInput)
    async def _invalid_input(_, e: InvalidInput):       # gateway/validate.py's one check
        return bad(e.message, e.param).response()

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_, e: RequestValidationError):
        errs = e.errors()
        first = errs[0] if errs else {}
        loc = [str(x) for x in first.get("loc", ()) if x != "body"]
        msg = "; ".join(f"{'.'.join(str(x) for x in er.get('loc', ()) if x != 'body') or 'body'}: "
                        f"{er.get('msg')}" for er in errs[:5])
        return bad(msg or "invalid request", loc[0] if loc else None).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_, e: StarletteHTTPException):
        type_ = "not_found_error" if e.status_code == 404 else "invalid_request_error"
        return OpenAIError(e.status_code, str(e.detail), type_).response()

    @app.exception_handler(Exception)
    async def _internal(_, e: Exception):
        log.exception("internal error in the REST shim")
        return OpenAIError(500, f"internal error: {type(e).__name__}", "internal_error").response()
