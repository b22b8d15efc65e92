"""The OpenAI-compatible REST shim: a FastAPI app over the models of `gateway.models.Models`
(each request goes to the `Gateway` of its `model`; unknown: 404 model_not_found).

    POST /v1/chat/completions   chat.py: chat template -> token ids -> n x generate() -> JSON | SSE
    POST /v1/completions        completions.py: prompt(s) -> n x generate() per prompt, echo
    POST /tokenize              vLLM's: {model, prompt, add_special_tokens} -> {tokens, count,
                                max_model_len} (`pdserve eval --url` tokenizes with it)
    GET  /v1/models, /v1/models/{id}, /health, /metrics
    GET  /status, /status.json  the operator's status page and its data (gateway/status.py;
                                /status.json needs a key when the gateway has keys)

endpoint.py holds what both endpoints share (how n choices run, and why a stream first waits
for every first event); errors.py the OpenAI error shape and the exception handlers.
"""
from __future__ import annotations

import asyncio
import functools
import time
from importlib import resources

from fastapi import Depends, FastAPI, Request
from fastapi.responses import HTMLResponse, JSONResponse, PlainTextResponse
from fastapi.security import HTTPBearer

from services import tracing

from ..auth import KeyStore, rest_middleware
from ..core import Gateway
from ..models import Models
from ..planner_client import PlannerClient
from ..status import status_json
from ..validate import MAX_BODY_BYTES
from .chat import Chat
from .completions import Completion
from .disconnect import CancelOnDisconnect
from .errors import OpenAIError, install_handlers, unknown_model
from .protocol import ChatCompletionRequest, CompletionRequest, _Body


class TokenizeRequest(_Body):
    model: str
    prompt: str
    add_special_tokens: bool = True


def create_app(models: Models, keys: KeyStore | None = None, planner_url: str = "") -> FastAPI:
    """The REST app; with `keys`, /v1 and /status.json need an API key and keep its limits
    (gateway/auth.py, an ASGI middleware); `planner_url`: the autoscaler's /plan (/status)."""
    app = FastAPI(title="pdserve OpenAI-compatible API", version="1",
                  description="OpenAI chat/completions over pdserve's disaggregated gateway")
    install_handlers(app)
    _add_middleware(app, keys)
    # documents the scheme in /openapi.json; the middleware above does the checking
    auth = [Depends(HTTPBearer(auto_error=False, description="an API key of the gateway"))]
    created = int(time.time())

    def card(gw: Gateway) -> dict:
        return {"id": gw.model_name, "object": "model", "created": created,
                "owned_by": "pdserve", "max_model_len": gw.max_model_len}

    def model(name: str) -> Gateway:
        if name not in models.by_name:
            raise unknown_model(models.names, name)
        return models.by_name[name]

    @app.get("/health", summary="200 when some model has a healthy prefill and decode worker")
    async def health():
        missing = {gw.model_name: [p.kind for p in (gw.prefill, gw.decode) if not p.healthy()]
                   for gw in models}
        if all(missing.values()):       # one model without workers leaves the others serving
            why = "; ".join(f"{name}: no healthy {' or '.join(kinds)} worker"
                            for name, kinds in missing.items())
            return OpenAIError(503, why, "service_unavailable", None, "unavailable").response()
        return {"status": "ok"}

    @app.get("/v1/models", dependencies=auth)
    async def list_models():
        return {"object": "list", "data": [card(gw) for gw in models]}

    @app.get("/v1/models/{model_id:path}", dependencies=auth)
    async def get_model(model_id: str):
        return card(model(model_id))

    _add_tokenize(app, model, auth)
    _add_operator_routes(app, models, PlannerClient(planner_url), auth)

    @app.post("/v1/chat/completions", dependencies=auth)
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        trace = tracing.extract_context(dict(request.headers))
        return await Chat(model(body.model), body, trace, _arrived(request)).run()

    @app.post("/v1/completions", dependencies=auth)
    async def completions(body: CompletionRequest, request: Request):
        trace = tracing.extract_context(dict(request.headers))
        return await Completion(model(body.model), body, trace, _arrived(request)).run()

    return app


def _add_middleware(app: FastAPI, keys: KeyStore | None) -> None:
    """Inside out: the body limit, the disconnect watch, API keys, the arrival stamp."""
    app.add_middleware(_limit_body)
    app.add_middleware(CancelOnDisconnect)
    if keys is not None and keys.enabled:
        app.add_middleware(rest_middleware(keys, lambda status, msg: OpenAIError(
            status, msg, *_AUTH_ERRORS[status]).response()))
    app.add_middleware(_stamp_arrival)    # outermost: a request's TTFT starts here


def _add_tokenize(app: FastAPI, model, auth) -> None:
    @app.post("/tokenize", dependencies=auth)
    async def tokenize(body: TokenizeRequest):
        gw = model(body.model)
        ids = gw.tokenizer.encode(body.prompt, add_special_tokens=body.add_special_tokens)
        return {"tokens": ids, "count": len(ids), "max_model_len": gw.max_model_len}


def _add_operator_routes(app: FastAPI, models: Models, planner: PlannerClient, auth) -> None:
    """/metrics (open), the status page (open) and its data (behind `auth`)."""
    @app.get("/metrics", response_class=PlainTextResponse, summary="Prometheus metrics")
    async def metrics():
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
        text = await asyncio.to_thread(generate_latest, models.registry)   # scrapes workers
        return PlainTextResponse(text, media_type=CONTENT_TYPE_LATEST)

    @app.get("/status", response_class=HTMLResponse, summary="the operator's status page")
    async def status_page():
        return HTMLResponse(_status_html(), headers={"Cache-Control": "no-store"})

    @app.get("/status.json", dependencies=auth, summary="pools, workers, latency, planner")
    async def status_data():
        return JSONResponse(status_json(models, await planner.get()),
                            headers={"Cache-Control": "no-store"})


@functools.cache
def _status_html() -> str:
    return resources.files("gateway").joinpath("status_page.html").read_text(encoding="utf-8")


def _stamp_arrival(app):
    """A pure ASGI middleware: scope["state"]["arrived"] = time.monotonic() as the request
    head comes in (where the TTFT waterfall starts: gateway/waterfall.py)."""
    async def middleware(scope, receive, send):
        if scope["type"] == "http":
            scope.setdefault("state", {})["arrived"] = time.monotonic()
        return await app(scope, receive, send)
    return middleware


def _arrived(request: Request) -> float | None:
    return getattr(request.state, "arrived", None)


def _limit_body(app):
    """A pure ASGI middleware: a request body over MAX_BODY_BYTES gets 413 (by its
    Content-Length before anything is read, or once the bytes received pass it)."""
    async def middleware(scope, receive, send):
        if scope["type"] != "http":
            return await app(scope, receive, send)
        length = next((v for k, v in scope["headers"] if k == b"content-length"), b"0")
        too_big = OpenAIError(413, f"request body over {MAX_BODY_BYTES} bytes",
                              "invalid_request_error", None, "request_too_large")
        if not length.isdigit() or int(length) > MAX_BODY_BYTES:
            return await too_big.response()(scope, receive, send)
        seen = 0

        async def bounded():
            nonlocal seen
            msg = await receive()
            seen += len(msg.get("body", b""))
            if seen > MAX_BODY_BYTES:
                raise OpenAIError(413, too_big.message, too_big.type, None, too_big.code)
            return msg
        await app(scope, bounded, send)
    return middleware


_AUTH_ERRORS = {401: ("authentication_error", None, "invalid_api_key"),
                429: ("rate_limit_error", None, "rate_limit_exceeded")}
