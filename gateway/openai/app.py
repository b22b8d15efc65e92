"""The OpenAI-compatible REST shim: a FastAPI app over `gateway.core.Gateway`.

    POST /v1/chat/completions   chat template -> token ids -> n x Gateway.generate() -> JSON | SSE
    POST /v1/completions        prompt(s) (text or ids) -> n x generate() per prompt, echo/logprobs
    GET  /v1/models, /v1/models/{id}, /health, /metrics

Each choice is its own request (seeds seed + i), merged as they come. A stream first waits
for every choice's first event, so routing errors (429 RESOURCE_EXHAUSTED, 503 UNAVAILABLE,
400 INVALID_ARGUMENT from a worker) still get a real HTTP status; afterwards a failure is
sent as an SSE `error` event before `[DONE]`. When the client goes away, Starlette cancels
the stream, which closes every generate() generator: the gateway aborts both workers.

Errors always have OpenAI's shape `{"error": {"message", "type", "param", "code"}}`;
FastAPI's 422 validation errors become 400.
"""
from __future__ import annotations

import asyncio
import json
import logging
import math
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, AsyncIterator

import grpc
from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from starlette.exceptions import HTTPException as StarletteHTTPException

from engine.sampling_params import SamplingParams
from services import tracing
from engine.structured import StructuredOutput, validate as validate_structured

from ..core import Gateway, GatewayError, GenerateEvent, GenerateInput, merge_streams
from . import tools as toolkit
from .protocol import ChatCompletionRequest, CompletionRequest

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
                 param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code

    @classmethod
    def from_gateway(cls, e: GatewayError) -> "OpenAIError":
        status, type_ = _STATUS.get(e.code, (500, "internal_error"))
        return cls(status, e.message, type_, None, e.code.name.lower())

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}

    def response(self) -> JSONResponse:
        headers = {"WWW-Authenticate": "Bearer"} if self.status == 401 else None
        return JSONResponse(self.body(), status_code=self.status, headers=headers)


def bad(message: str, param: str | None = None, code: str | None = None) -> OpenAIError:
    return OpenAIError(400, message, "invalid_request_error", param, code)


# ----------------------------------------------------------------------------- the app

def create_app(gw: Gateway, api_key: str = "") -> FastAPI:
    app = FastAPI(title="pdserve OpenAI-compatible API", version="1",
                  description="OpenAI chat/completions over pdserve's disaggregated gateway")
    created = int(time.time())
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

    @app.exception_handler(OpenAIError)
    async def _openai_error(_, e: OpenAIError):
        return e.response()

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

    def model_card() -> dict:
        return {"id": gw.model_name, "object": "model", "created": created, "owned_by": "pdserve",
                "max_model_len": gw.max_model_len}

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
        registry = getattr(getattr(gw, "metrics", None), "registry", None)
        body = generate_latest(registry) if registry is not None else b""
        return PlainTextResponse(body, media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models", dependencies=[Depends(auth)])
    async def list_models():
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{model_id:path}", dependencies=[Depends(auth)])
    async def get_model(model_id: str):
        if model_id != gw.model_name:
            raise _unknown_model(gw, model_id)
        return model_card()

    @app.post("/v1/chat/completions", dependencies=[Depends(auth)])
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        return await _Chat(gw, body, tracing.extract_context(dict(request.headers))).run()

    @app.post("/v1/completions", dependencies=[Depends(auth)])
    async def completions(body: CompletionRequest, request: Request):
        return await _Completion(gw, body, tracing.extract_context(dict(request.headers))).run()

    return app


def _unknown_model(gw: Gateway, model: str) -> OpenAIError:
    return OpenAIError(404, f"the model {model!r} does not exist; this server serves "
                       f"{gw.model_name!r}", "invalid_request_error", "model", "model_not_found")


# ----------------------------------------------------------------------------- shared

def sampling_params(body, max_tokens: int | None, logprobs: int | None,
                    prompt_logprobs: int | None = None,
                    structured: StructuredOutput | None = None) -> SamplingParams:
    bias = {}
    for k, v in (body.logit_bias or {}).items():
        try:
            bias[int(k)] = float(v)
        except ValueError:
            raise bad(f"logit_bias keys must be token ids, got {k!r}", "logit_bias") from None
        if not -100 <= v <= 100:
            raise bad(f"logit_bias values must be in [-100, 100], got {v}", "logit_bias")
    kw = dict(temperature=1.0 if body.temperature is None else body.temperature,
              top_p=1.0 if body.top_p is None else body.top_p, top_k=body.top_k or 0,
              min_p=body.min_p or 0.0, seed=body.seed,
              presence_penalty=body.presence_penalty or 0.0,
              frequency_penalty=body.frequency_penalty or 0.0,
              repetition_penalty=body.repetition_penalty or 1.0, max_tokens=max_tokens,
              min_tokens=body.min_tokens, stop=body.stop or [],
              stop_token_ids=body.stop_token_ids or [], ignore_eos=body.ignore_eos,
              logprobs=logprobs, prompt_logprobs=prompt_logprobs, logit_bias=bias,
              skip_special_tokens=body.skip_special_tokens,
              include_stop_str_in_output=body.include_stop_str_in_output, structured=structured)
    try:
        return SamplingParams(**kw)
    except ValueError as e:
        msg = str(e)
        param = msg.split("invalid sampling parameter ", 1)[-1].split("=", 1)[0] \
            if msg.startswith("invalid sampling parameter") else None
        raise bad(msg, param) from None


def response_format_spec(body) -> StructuredOutput | None:
    rf = body.response_format
    if rf is None or rf.type == "text":
        return None
    if rf.type == "json_object":
        return StructuredOutput(json_object=True)
    if rf.json_schema is None or rf.json_schema.schema_ is None:
        raise bad("response_format json_schema needs json_schema.schema", "response_format")
    return StructuredOutput(json_schema=rf.json_schema.schema_)


def check_structured(spec: StructuredOutput | None, param: str) -> None:
    if spec is None:
        return
    try:
        validate_structured(spec)
    except ValueError as e:
        raise bad(str(e), param) from None


@dataclass
class _ChoiceOut:
    """Everything one choice produced (non-streaming, or what a stream holds back)."""
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    logprobs: list = field(default_factory=list)          # (logprob, top) per token
    finish_reason: str | None = None
    stop_reason: Any = None
    prompt_logprobs: list | None = None
    completion_tokens: int = 0
    cached_tokens: int = 0
    energy_joules: float | None = None

    def add(self, ev: GenerateEvent) -> None:
        self.token_ids += ev.token_ids
        self.text += ev.text
        if ev.logprobs:
            self.logprobs += ev.logprobs
        if ev.prompt_logprobs is not None:
            self.prompt_logprobs = ev.prompt_logprobs
        if ev.finish_reason is not None:
            self.finish_reason, self.stop_reason = ev.finish_reason, ev.stop_reason
        self.completion_tokens += len(ev.token_ids)
        if ev.usage is not None:
            self.completion_tokens = ev.usage.completion_tokens
            self.cached_tokens = ev.usage.cached_tokens
            self.energy_joules = ev.usage.energy_joules


class _Run:
    """One OpenAI request: several Gateway.generate() calls (choices), started together."""

    def __init__(self, gw: Gateway, inputs: list[GenerateInput]):
        self.gw, self.inputs = gw, inputs
        self.gens = [gw.generate(x) for x in inputs]
        self.firsts: list[GenerateEvent | None] = []

    async def start(self) -> None:
        """Wait for every choice's first event (so routing errors surface as a status)."""
        async def first(g):
            try:
                return await g.__anext__()
            except StopAsyncIteration:
                return None
        tasks = [asyncio.ensure_future(first(g)) for g in self.gens]
        try:
            done, pending = await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
            for t in pending:
                t.cancel()
            await asyncio.gather(*pending, return_exceptions=True)
            for t in tasks:
                if t.done() and not t.cancelled() and t.exception() is not None:
                    raise t.exception()
            self.firsts = [t.result() for t in tasks]
        except BaseException as e:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            await self.close()
            if isinstance(e, GatewayError):
                raise OpenAIError.from_gateway(e) from None
            raise

    async def events(self) -> AsyncIterator[tuple[int, GenerateEvent]]:
        """(choice index, event) as they come, first events included; closes everything."""
        async def resume(first, g):
            if first is not None:
                yield first
                async for ev in g:
                    yield ev
        try:
            async for i, ev in merge_streams([resume(f, g) for g, f in zip(self.gens, self.firsts)]):
                yield i, ev
        except GatewayError as e:
            raise OpenAIError.from_gateway(e) from None
        finally:
            await self.close()

    async def close(self) -> None:
        for g in self.gens:
            try:
                await g.aclose()
            except Exception:     # a generator that failed is closed already
                pass

    async def collect(self) -> list[_ChoiceOut]:
        outs = [_ChoiceOut() for _ in self.inputs]
        async for i, ev in self.events():
            outs[i].add(ev)
        return outs


def _sse(obj: Any) -> str:
    return f"data: {json.dumps(obj, separators=(',', ':'), allow_nan=False)}\n\n"


def _finite(x: float | None) -> float | None:
    if x is None:
        return None
    return x if math.isfinite(x) else -9999.0


def _usage(prompt_tokens: int, completion_tokens: int, cached: int, outs=()) -> dict:
    """OpenAI usage; `energy_joules` (GPU energy of `outs`' choices) only where measured."""
    u = {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
         "total_tokens": prompt_tokens + completion_tokens,
         "prompt_tokens_details": {"cached_tokens": cached}}
    energy = [o.energy_joules for o in outs if o.energy_joules is not None]
    if energy:
        u["energy_joules"] = sum(energy)
    return u


class _Endpoint:
    object_name = ""

    def __init__(self, gw: Gateway, body, trace_parent=None):
        self.gw, self.body, self.trace_parent = gw, body, trace_parent
        if body.model != gw.model_name:
            raise _unknown_model(gw, body.model)
        self.id = f"{self.prefix}-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self._tok_cache: dict[int, str] = {}

    def token_str(self, t: int) -> str:
        s = self._tok_cache.get(t)
        if s is None:
            s = self._tok_cache[t] = self.gw.tokenizer.decode([t], skip_special_tokens=False)
        return s

    def check_length(self, ids: list[int], max_tokens: int | None, param: str) -> None:
        L = self.gw.max_model_len
        if not L:
            return
        if len(ids) >= L:
            raise bad(f"this model's maximum context length is {L} tokens, but the prompt has "
                      f"{len(ids)} tokens", param, "context_length_exceeded")
        if max_tokens is not None and len(ids) + max_tokens > L:
            raise bad(f"this model's maximum context length is {L} tokens; the prompt has "
                      f"{len(ids)} and max_tokens asks for {max_tokens} more", "max_tokens",
                      "context_length_exceeded")

    def inputs(self, ids: list[int], params: SamplingParams, n: int, base: int = 0
               ) -> list[GenerateInput]:
        out = []
        for j in range(n):
            seed = None if params.seed is None else params.seed + j
            p = params if (n == 1 and base == 0) else _replace(params, seed=seed)
            out.append(GenerateInput(f"{self.id}-{base + j}", list(ids), p,
                                     trace_parent=self.trace_parent))
        return out


def _replace(p: SamplingParams, **kw) -> SamplingParams:
    from dataclasses import replace
    return replace(p, **kw)


# ----------------------------------------------------------------------------- chat

class _Chat(_Endpoint):
    prefix = "chatcmpl"

    def __init__(self, gw: Gateway, body: ChatCompletionRequest, trace_parent=None):
        super().__init__(gw, body, trace_parent)
        self.tools = body.tools or []
        choice = body.tool_choice
        if choice is None:
            choice = "auto" if self.tools else "none"
        if choice != "none" and not self.tools:
            raise bad("tool_choice needs tools", "tool_choice")
        self.tool_choice = choice
        self.forced = choice == "required" or not isinstance(choice, str)
        self.parse_tools = bool(self.tools) and choice != "none"

    def prompt_ids(self) -> list[int]:
        b, tok = self.body, self.gw.tokenizer
        messages = [_message_dict(m) for m in b.messages]
        tools = [t.model_dump(exclude_none=True) for t in self.tools] \
            if self.tools and self.tool_choice != "none" else None
        try:
            text = tok.apply_chat_template(messages, add_generation_prompt=b.add_generation_prompt,
                                           tools=tools, **(b.chat_template_kwargs or {}))
        except Exception as e:      # template errors (raise_exception), no template
            raise bad(f"chat template: {e}", "messages") from None
        has_bos = tok.bos_token is not None and text.startswith(tok.bos_token)
        return tok.encode(text, add_special_tokens=not has_bos)

    def structured(self) -> StructuredOutput | None:
        spec = response_format_spec(self.body)
        check_structured(spec, "response_format")
        if self.forced:
            if spec is not None:
                raise bad("response_format cannot be combined with a forced tool_choice",
                          "response_format")
            name = None if self.tool_choice == "required" else self.tool_choice.function.name
            try:
                spec = StructuredOutput(json_schema=toolkit.forced_schema(
                    self.tools, name, parallel=self.body.parallel_tool_calls is not False))
            except ValueError as e:
                raise bad(str(e), "tool_choice") from None
            check_structured(spec, "tools")
        return spec

    async def run(self):
        b = self.body
        max_tokens = b.max_completion_tokens or b.max_tokens
        ids = self.prompt_ids()
        self.check_length(ids, max_tokens, "messages")
        k = None
        if b.logprobs:
            k = b.top_logprobs or 0
        elif b.top_logprobs:
            raise bad("top_logprobs needs logprobs=true", "top_logprobs")
        params = sampling_params(b, max_tokens, k, structured=self.structured())
        self.n_prompt = len(ids)
        run = _Run(self.gw, self.inputs(ids, params, b.n))
        await run.start()
        if b.stream:
            return StreamingResponse(self.stream(run), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})
        outs = await run.collect()
        choices = []
        for i, o in enumerate(outs):
            msg: dict[str, Any] = {"role": "assistant", "content": o.text}
            finish = o.finish_reason
            calls = toolkit.parse_calls(o.text, self.tools) if self.parse_tools else None
            if calls:
                msg = {"role": "assistant", "content": None, "tool_calls": calls}
                finish = "tool_calls"
            choices.append({"index": i, "message": msg, "finish_reason": finish,
                            "logprobs": self.logprobs(o.token_ids, o.logprobs) if b.logprobs else None})
        usage = _usage(len(ids), sum(o.completion_tokens for o in outs), outs[0].cached_tokens, outs)
        return {"id": self.id, "object": "chat.completion", "created": self.created,
                "model": self.gw.model_name, "choices": choices, "usage": usage}

    def logprobs(self, ids: list[int], lps: list) -> dict:
        content = []
        for t, (lp, top) in zip(ids, lps):
            s = self.token_str(t)
            content.append({"token": s, "logprob": _finite(lp), "bytes": list(s.encode()),
                            "top_logprobs": [{"token": self.token_str(x), "logprob": _finite(l),
                                              "bytes": list(self.token_str(x).encode())}
                                             for x, l in (top or [])]})
        return {"content": content}

    def chunk(self, choices: list[dict], usage: dict | None = None, with_usage: bool = False) -> str:
        obj = {"id": self.id, "object": "chat.completion.chunk", "created": self.created,
               "model": self.gw.model_name, "choices": choices}
        if with_usage:
            obj["usage"] = usage
        return _sse(obj)

    async def stream(self, run: _Run) -> AsyncIterator[str]:
        b = self.body
        opts = b.stream_options
        inc_usage = bool(opts and opts.include_usage)
        cont_usage = bool(opts and opts.continuous_usage_stats)
        n = len(run.inputs)
        outs = [_ChoiceOut() for _ in range(n)]
        held = [self.forced for _ in range(n)]      # content held back: maybe a tool call
        sent_text = [False] * n
        try:
            for i in range(n):
                yield self.chunk([{"index": i, "delta": {"role": "assistant", "content": ""},
                                   "logprobs": None, "finish_reason": None}], None, inc_usage)
            async for i, ev in run.events():
                o = outs[i]
                start = len(o.token_ids)
                o.add(ev)
                if self.parse_tools and not held[i] and not sent_text[i] and toolkit.may_be_call(o.text):
                    held[i] = True
                if held[i] and not ev.finish_reason and ev.text and not toolkit.may_be_call(o.text) \
                        and not self.forced:
                    held[i] = False                 # not a call after all: flush what was held
                    yield self.chunk([self._content(i, o.text, o.token_ids, o.logprobs)], None, inc_usage)
                    sent_text[i] = True
                    continue
                u = _usage(self.n_prompt, o.completion_tokens, o.cached_tokens) if cont_usage else None
                if not held[i] and (ev.text or (b.logprobs and ev.token_ids)):
                    yield self.chunk([self._content(i, ev.text, ev.token_ids, o.logprobs[start:])],
                                     u, inc_usage)
                    sent_text[i] = sent_text[i] or bool(ev.text)
                if ev.finish_reason is None:
                    continue
                finish = ev.finish_reason
                if held[i]:
                    calls = toolkit.parse_calls(o.text, self.tools)
                    if calls:
                        finish = "tool_calls"
                        for k, c in enumerate(calls):
                            yield self.chunk([{"index": i, "delta": {"tool_calls": [{
                                "index": k, "id": c["id"], "type": "function",
                                "function": {"name": c["function"]["name"], "arguments": ""}}]},
                                "logprobs": None, "finish_reason": None}], None, inc_usage)
                            yield self.chunk([{"index": i, "delta": {"tool_calls": [{
                                "index": k, "function": {"arguments": c["function"]["arguments"]}}]},
                                "logprobs": None, "finish_reason": None}], None, inc_usage)
                    elif o.text or o.token_ids:
                        yield self.chunk([self._content(i, o.text, o.token_ids, o.logprobs)], None, inc_usage)
                u = _usage(self.n_prompt, o.completion_tokens, o.cached_tokens) if cont_usage else None
                yield self.chunk([{"index": i, "delta": {}, "logprobs": None, "finish_reason": finish}],
                                 u, inc_usage)
            if inc_usage:
                yield self.chunk([], _usage(self.n_prompt, sum(o.completion_tokens for o in outs),
                                            outs[0].cached_tokens, outs), True)
        except OpenAIError as e:
            yield _sse(e.body())
        yield "data: [DONE]\n\n"

    def _content(self, i: int, text: str, ids: list[int], lps: list) -> dict:
        return {"index": i, "delta": {"content": text},
                "logprobs": self.logprobs(ids, lps) if self.body.logprobs else None,
                "finish_reason": None}


def _message_dict(m) -> dict:
    d: dict[str, Any] = {"role": "system" if m.role == "developer" else m.role}
    content = m.content
    if isinstance(content, list):
        parts = []
        for p in content:
            if p.get("type") != "text":
                raise bad(f"message content part type {p.get('type')!r} is not supported "
                          "(text only)", "messages")
            parts.append(str(p.get("text", "")))
        content = "".join(parts)
    d["content"] = content if content is not None else ""
    if m.name:
        d["name"] = m.name
    if m.tool_call_id:
        d["tool_call_id"] = m.tool_call_id
    if m.tool_calls:
        calls = []
        for c in m.tool_calls:
            try:
                args = json.loads(c.function.arguments)
            except ValueError:
                args = c.function.arguments
            calls.append({"id": c.id, "type": "function",
                          "function": {"name": c.function.name, "arguments": args}})
        d["tool_calls"] = calls
    return d


# ----------------------------------------------------------------------------- completions

class _Completion(_Endpoint):
    prefix = "cmpl"

    def prompts(self) -> list[tuple[list[int], str | None]]:
        """(token ids, original text or None) per prompt."""
        p, tok = self.body.prompt, self.gw.tokenizer
        if isinstance(p, str):
            items = [p]
        elif p and all(isinstance(x, int) for x in p):
            items = [list(p)]
        else:
            items = list(p)
        if not items:
            raise bad("prompt must not be empty", "prompt")
        out = []
        for x in items:
            ids = tok.encode(x) if isinstance(x, str) else list(x)
            if not ids:
                raise bad("prompt must not be empty", "prompt")
            if any(t < 0 for t in ids):
                raise bad("prompt token ids must be >= 0", "prompt")
            out.append((ids, x if isinstance(x, str) else None))
        return out

    async def run(self):
        b = self.body
        if b.suffix:
            raise bad("suffix is not supported", "suffix")
        if b.max_tokens == 0 and not b.echo:
            raise bad("max_tokens=0 is only allowed with echo=true", "max_tokens")
        gen_tokens = b.max_tokens if b.max_tokens != 0 else 1     # echo-only: run 1, drop it
        prompt_lp = b.logprobs if (b.echo and b.logprobs is not None) else None
        spec = response_format_spec(b)
        check_structured(spec, "response_format")
        params = sampling_params(b, gen_tokens, b.logprobs, prompt_lp, spec)
        prompts = self.prompts()
        inputs = []
        for k, (ids, _) in enumerate(prompts):
            self.check_length(ids, b.max_tokens or None, "prompt")
            inputs += self.inputs(ids, params, b.n, base=k * b.n)
        self.prompt_list = prompts
        run = _Run(self.gw, inputs)
        await run.start()
        if b.stream:
            return StreamingResponse(self.stream(run), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})
        outs = await run.collect()
        choices = [self.choice(i, o) for i, o in enumerate(outs)]
        comp = 0 if b.max_tokens == 0 else sum(o.completion_tokens for o in outs)
        usage = _usage(sum(len(ids) for ids, _ in prompts), comp, outs[0].cached_tokens, outs)
        return {"id": self.id, "object": "text_completion", "created": self.created,
                "model": self.gw.model_name, "choices": choices, "usage": usage}

    def _prompt_of(self, i: int) -> tuple[list[int], str | None]:
        return self.prompt_list[i // self.body.n]

    def choice(self, i: int, o: _ChoiceOut) -> dict:
        b = self.body
        ids, ptext = self._prompt_of(i)
        echo_only = b.max_tokens == 0
        gen_ids = [] if echo_only else o.token_ids
        gen_lps = [] if echo_only else o.logprobs
        text = "" if echo_only else o.text
        finish = "length" if echo_only else o.finish_reason
        lp = None
        if b.echo:
            prompt_text = ptext if ptext is not None else self.gw.tokenizer.decode(ids, False)
            if b.logprobs is not None:
                lp = self.logprobs(ids, o.prompt_logprobs or [(None, None)] * len(ids), 0)
                lp = _join_logprobs(lp, self.logprobs(gen_ids, gen_lps, len(prompt_text)))
            text = prompt_text + text
        elif b.logprobs is not None:
            lp = self.logprobs(gen_ids, gen_lps, 0)
        return {"index": i, "text": text, "logprobs": lp, "finish_reason": finish}

    def logprobs(self, ids: list[int], lps: list, offset: int) -> dict:
        tokens, token_lps, tops, offsets = [], [], [], []
        for t, (lp, top) in zip(ids, lps):
            s = self.token_str(t)
            tokens.append(s)
            token_lps.append(_finite(lp))
            tops.append(None if top is None else {self.token_str(x): _finite(l) for x, l in top})
            offsets.append(offset)
            offset += len(s)
        return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops,
                "text_offset": offsets}

    async def stream(self, run: _Run) -> AsyncIterator[str]:
        b = self.body
        opts = b.stream_options
        inc_usage = bool(opts and opts.include_usage)
        outs = [_ChoiceOut() for _ in run.inputs]
        echoed = [False] * len(outs)
        try:
            async for i, ev in run.events():
                o = outs[i]
                start, offset = len(o.token_ids), len(o.text)
                o.add(ev)
                echo_only = b.max_tokens == 0           # the one generated token is dropped
                gen_ids = [] if echo_only else ev.token_ids
                text, lp = ("" if echo_only else ev.text), None
                if b.logprobs is not None:
                    lp = self.logprobs(gen_ids, o.logprobs[start:], offset)
                if b.echo and not echoed[i]:
                    echoed[i] = True
                    ids, ptext = self._prompt_of(i)
                    ptext = ptext if ptext is not None else self.gw.tokenizer.decode(ids, False)
                    if b.logprobs is not None:
                        plp = self.logprobs(ids, o.prompt_logprobs or [(None, None)] * len(ids), 0)
                        lp = _join_logprobs(plp, self.logprobs(gen_ids, o.logprobs[start:], len(ptext)))
                    text = ptext + text
                finish = ("length" if echo_only else ev.finish_reason) if ev.finish_reason else None
                if not text and finish is None and not (lp and lp["tokens"]):
                    continue
                obj = {"id": self.id, "object": "text_completion", "created": self.created,
                       "model": self.gw.model_name,
                       "choices": [{"index": i, "text": text, "logprobs": lp, "finish_reason": finish}]}
                if inc_usage:
                    obj["usage"] = None
                yield _sse(obj)
            if inc_usage:
                comp = 0 if b.max_tokens == 0 else sum(o.completion_tokens for o in outs)
                yield _sse({"id": self.id, "object": "text_completion", "created": self.created,
                            "model": self.gw.model_name, "choices": [],
                            "usage": _usage(sum(len(ids) for ids, _ in self.prompt_list), comp,
                                            outs[0].cached_tokens, outs)})
        except OpenAIError as e:
            yield _sse(e.body())
        yield "data: [DONE]\n\n"


def _join_logprobs(a: dict, b: dict) -> dict:
    return {k: a[k] + b[k] for k in a}
