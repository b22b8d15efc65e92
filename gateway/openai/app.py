"""The OpenAI-compatible REST shim: a FastAPI app over `gateway.core.Gateway`.

    POST /v1/chat/completions   chat.py: chat template -> token ids -> n x generate() -> JSON | SSE
    POST /v1/completions        completions.py: prompt(s) -> n x generate() per prompt, echo
    GET  /v1/models, /v1/models/{id}, /health, /metrics

endpoint.py holds what both endpoints share (how n choices run, and why a stream first waits
for every first event); errors.py the OpenAI error shape and the exception handlers.
"""
from __future__ import annotations

import time

from fastapi import Depends, FastAPI, Request
from fastapi.responses import PlainTextResponse
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from services import tracing

from ..core import Gateway
from .chat import Chat
from .completions import Completion
from .disconnect import CancelOnDisconnect
from .errors import OpenAIError, install_handlers, unknown_model
from .protocol import ChatCompletionRequest, CompletionRequest


def create_app(gw: Gateway, api_key: str = "") -> FastAPI:
    app = FastAPI(title="pdserve OpenAI-compatible API", version="1",
                  description="OpenAI chat/completions over pdserve's disaggregated gateway")
    install_handlers(app)
    app.add_middleware(CancelOnDisconnect)
    auth = [Depends(_bearer_auth(api_key))]
    card = {"id": gw.model_name, "object": "model", "created": int(time.time()),
            "owned_by": "pdserve", "max_model_len": gw.max_model_len}

    @app.get("/health", summary="200 when a healthy prefill and decode worker are known")
    async def health():
        missing = [p.kind for p in (gw.prefill, gw.decode) if not p.healthy()]
        if missing:
            return OpenAIError(503, f"no healthy {' or '.join(missing)} worker",
                               "service_unavailable", None, "unavailable").response()
        return {"status": "ok"}

    @app.get("/metrics", response_class=PlainTextResponse, summary="Prometheus metrics")
    async def metrics():
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
        return PlainTextResponse(generate_latest(gw.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models", dependencies=auth)
    async def list_models():
        return {"object": "list", "data": [dict(card)]}

    @app.get("/v1/models/{model_id:path}", dependencies=auth)
    async def get_model(model_id: str):
        if model_id != gw.model_name:
            raise unknown_model(gw.model_name, model_id)
        return dict(card)

    @app.post("/v1/chat/completions", dependencies=auth)
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        return await Chat(gw, body, tracing.extract_context(dict(request.headers))).run()

    @app.post("/v1/completions", dependencies=auth)
    async def completions(body: CompletionRequest, request: Request):
        return await Completion(gw, body, tracing.extract_context(dict(request.headers))).run()

    return app


def _bearer_auth(api_key: str):
    """A dependency: 401 unless the request carries `Authorization: Bearer <api_key>` (no
    key configured: open)."""
    bearer = HTTPBearer(auto_error=False, description="the gateway's --api-key, when set")

    async def auth(cred: HTTPAuthorizationCredentials | None = Depends(bearer)) -> None:
        if not api_key:
            return
        if cred is None:
            raise OpenAIError(401, "missing API key: send 'Authorization: Bearer <key>'",
                              "authentication_error", None, "invalid_api_key")
        if cred.credentials != api_key:
            raise OpenAIError(401, "incorrect API key provided", "authentication_error", None,
                              "invalid_api_key")
    return auth
