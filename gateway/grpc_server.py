"""The public `pdserve.v1.Generation` gRPC service on grpc.aio (uvloop), over `Gateway`.

    GenerateRequest --prompt (text | token ids | chat)--> token ids --Gateway.generate()-->
        GenerateEvents --> GenerateResponse stream (n > 1: one generate() per index, merged)

GatewayError becomes the call's status (code + message). Cancelling the call cancels the
servicer task, which closes the generators, which abort the request on its workers.
Several models (gateway/models.py): `ModelRouter` hands each call to the servicer of its
request's `model` (unknown: NOT_FOUND). Also served: grpc.health.v1 ("" and
pdserve.v1.Generation) and server reflection.
"""
from __future__ import annotations

import asyncio
import logging
import signal
import time
import uuid
from functools import lru_cache
from typing import AsyncIterator

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from services import metrics, security, service_names
from services import tracing
from services.grpc_options import SERVER_OPTIONS
from services.startup_log import StartupClock
from protos.pdserve.v1 import common_pb2, generation_pb2, generation_pb2_grpc

from services.protoconv import FINISH_TO_PROTO, sampling_from_proto

from .auth import GrpcAuth, KeyStore
from .choices import fan_out, merge_streams
from .config import GatewayConfig
from .core import Gateway
from .models import Models, model_configs
from .prompt import chat_prompt_ids, encode
from .redact import public_message
from .request import GatewayError, GenerateEvent, GenerateInput, Usage
from .validate import MAX_BODY_BYTES, check_request, template_role

log = logging.getLogger(__name__)

SERVICE = service_names.GENERATION


class GenerationServicer(generation_pb2_grpc.GenerationServicer):
    def __init__(self, gateway: Gateway):
        self.gw = gateway
        self.created = int(time.time())
        self._token_text = lru_cache(maxsize=65536)(
            lambda i: gateway.tokenizer.decode([i], skip_special_tokens=False))

    # -- Generate ----------------------------------------------------------------------------
    async def Generate(self, request, context):
        try:
            async for resp in self._generate(request, tracing.extract_context(context)):
                yield resp
        except GatewayError as e:
            if e.retry_after_s is not None:
                context.set_trailing_metadata((("retry-after", str(e.retry_after_s)),))
            await context.abort(e.code, public_message(e, request.request_id,
                                                       self.gw.worker_addresses()))

    async def _inputs(self, request, trace_parent) -> tuple[str, list[int], list[GenerateInput]]:
        """(request id, prompt ids, one GenerateInput per choice), checked (gateway/validate.py)."""
        try:
            params = sampling_from_proto(request.sampling)
        except ValueError as e:
            raise GatewayError(grpc.StatusCode.INVALID_ARGUMENT, str(e)) from None
        ids = await self._prompt_ids(request)
        self.gw.check_prompt(ids, params.max_tokens)
        check_request(params, params.n, [len(ids)], self.gw.vocab_size, self.gw.max_model_len)
        rid = request.request_id or f"gen-{uuid.uuid4().hex}"
        return rid, ids, fan_out(rid, [ids], params, params.n, trace_parent)

    async def _generate(self, request, trace_parent=None) -> AsyncIterator[generation_pb2.GenerateResponse]:
        rid, ids, inputs = await self._inputs(request, trace_parent)
        opts = request.stream_options
        # Unset stream options: streaming, the proto's reading of an empty message is "false",
        # but a client that sent no options at all surely wants the stream.
        stream = opts.stream or not request.HasField("stream_options")
        usage = [Usage(len(ids), 0, 0) for _ in inputs]
        pending: dict[int, generation_pb2.GenerateResponse] = {}
        async for index, ev in merge_streams([self.gw.generate(x) for x in inputs]):
            usage[index].completion_tokens += len(ev.token_ids)
            if ev.usage is not None:
                usage[index] = ev.usage
            msg = self._response(rid, index, ev, ids)
            if opts.continuous_usage_stats or (ev.finish_reason and opts.include_usage):
                msg.usage.CopyFrom(_usage_proto(usage[index]))
            if stream:
                yield msg
            elif index in pending:
                _append(pending[index], msg)
            else:
                pending[index] = msg
        for index in sorted(pending):
            yield pending[index]

    def _response(self, rid: str, index: int, ev: GenerateEvent, prompt: list[int]):
        msg = generation_pb2.GenerateResponse(
            request_id=rid, index=index, token_ids=ev.token_ids, text=ev.text,
            finish_reason=FINISH_TO_PROTO[ev.finish_reason],
            stop_reason="" if ev.stop_reason is None else str(ev.stop_reason))
        if ev.logprobs is not None:
            for tid, (lp, top) in zip(ev.token_ids, ev.logprobs):
                msg.logprobs.append(self._token_logprob(tid, lp, top))
        if ev.prompt_logprobs is not None:
            for tid, (lp, top) in zip(prompt, ev.prompt_logprobs):
                msg.prompt_logprobs.append(self._token_logprob(tid, lp or 0.0, top))
        return msg

    def _token_logprob(self, tid: int, lp: float, top) -> common_pb2.TokenLogprob:
        m = common_pb2.TokenLogprob(token_id=tid, logprob=lp)
        for rank, (t, l) in enumerate(top or (), 1):
            m.top_logprobs.add(token_id=t, logprob=l, token=self._token_text(t))
            if t == tid:
                m.rank = rank
        return m

    async def _prompt_ids(self, request) -> list[int]:
        kind = request.WhichOneof("prompt")
        if kind == "token_ids":
            return list(request.token_ids.ids)
        if kind == "text":
            return await encode(self.gw.tokenizer, request.text, self.gw.max_model_len)
        if kind == "chat":
            return await self._chat_ids(request.chat, self.gw.max_model_len)
        raise GatewayError(grpc.StatusCode.INVALID_ARGUMENT,
                           "GenerateRequest needs a prompt: text, token_ids or chat")

    async def _chat_ids(self, chat, context_length: int = 0) -> list[int]:
        messages = [{"role": template_role(m.role), "content": m.content} for m in chat.messages]
        return await chat_prompt_ids(self.gw.tokenizer, messages, chat.add_generation_prompt,
                                     context_length=context_length)

    # -- Tokenize, ListModels -----------------------------------------------------------------
    async def Tokenize(self, request, context):
        try:
            kind = request.WhichOneof("prompt")
            if kind == "text":
                ids = await encode(self.gw.tokenizer, request.text, 0, "text",
                                   request.add_special_tokens)
            elif kind == "chat":
                ids = await self._chat_ids(request.chat)
            else:
                raise GatewayError(grpc.StatusCode.INVALID_ARGUMENT,
                                   "TokenizeRequest needs text or chat")
        except GatewayError as e:
            await context.abort(e.code, e.message)
        return generation_pb2.TokenizeResponse(token_ids=ids, count=len(ids),
                                               max_model_len=self.gw.max_model_len)

    async def ListModels(self, request, context):
        return generation_pb2.ListModelsResponse(models=[generation_pb2.ModelInfo(
            id=self.gw.model_name, max_model_len=self.gw.max_model_len, owned_by="pdserve",
            created=self.created)])


class ModelRouter(generation_pb2_grpc.GenerationServicer):
    """The Generation service over several models: each call goes to the GenerationServicer
    of its request's model (Models.get: unknown NOT_FOUND, none named with several
    INVALID_ARGUMENT); ListModels lists every model."""

    def __init__(self, models: Models):
        self.models = models
        self.servicers = {gw.model_name: GenerationServicer(gw) for gw in models}

    async def _servicer(self, model: str, context) -> GenerationServicer:
        try:
            return self.servicers[self.models.get(model).model_name]
        except GatewayError as e:
            await context.abort(e.code, e.message)

    async def Generate(self, request, context):
        servicer = await self._servicer(request.model, context)
        async for resp in servicer.Generate(request, context):
            yield resp

    async def Tokenize(self, request, context):
        servicer = await self._servicer(request.model, context)
        return await servicer.Tokenize(request, context)

    async def ListModels(self, request, context):
        listed = [await s.ListModels(request, context) for s in self.servicers.values()]
        return generation_pb2.ListModelsResponse(models=[m for r in listed for m in r.models])


def _usage_proto(u: Usage) -> common_pb2.Usage:
    return common_pb2.Usage(prompt_tokens=u.prompt_tokens, completion_tokens=u.completion_tokens,
                            cached_tokens=u.cached_tokens, energy_joules=u.energy_joules)


def _append(acc: generation_pb2.GenerateResponse, msg: generation_pb2.GenerateResponse) -> None:
    """Fold one streamed message into the single non-streaming one."""
    acc.token_ids.extend(msg.token_ids)
    acc.text += msg.text
    acc.logprobs.extend(msg.logprobs)
    acc.finish_reason = msg.finish_reason
    acc.stop_reason = msg.stop_reason
    if msg.HasField("usage"):
        acc.usage.CopyFrom(msg.usage)


# -- server ---------------------------------------------------------------------------------

async def _wait_for_workers(models: Models, timeout_s: float, clock: StartupClock) -> None:
    """`--wait-for-workers-s` (0: nothing to wait for): until every worker of every pool is
    healthy, or timeout_s (then SERVING anyway: the health probes keep looking for the rest)."""
    if timeout_s <= 0:
        return
    pools = [pool for gw in models for pool in (gw.prefill, gw.decode)]
    done = await asyncio.gather(*(pool.until_healthy(timeout_s) for pool in pools))
    for pool, ok in zip(pools, done):
        if not ok:
            log.warning("%s workers not all healthy after %gs: serving with %d of %d", pool.kind,
                        timeout_s, sum(w.healthy for w in pool.workers.values()), len(pool.workers))
    clock.mark("waiting for workers")


async def _unless_stopped(aw, stop: asyncio.Event | None) -> bool:
    """Await `aw` unless `stop` is set first (then `aw` is cancelled): whether it finished."""
    task = asyncio.ensure_future(aw)
    if stop is None:
        await task
        return True
    halt = asyncio.ensure_future(stop.wait())
    done, _ = await asyncio.wait({task, halt}, return_when=asyncio.FIRST_COMPLETED)
    for t in (task, halt):
        t.cancel()
    await asyncio.gather(task, halt, return_exceptions=True)
    if task in done:
        task.result()                   # its exception, if it raised
        return True
    return False


async def _serving(address: str, models: Models, health_servicer, clock: StartupClock) -> None:
    """SERVING, said in the log and on stdout (the launcher waits for that line)."""
    for name in ("", SERVICE):
        await health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    for gw in models:
        log.info("gateway serving %s on %s (prefill: %d, decode: %d workers)", gw.model_name,
                 address, len(gw.prefill.workers), len(gw.decode.workers))
    clock.mark("servers")
    log.info("%s", clock.line("gateway"))
    print(f"gateway ready on {address}", flush=True)


async def serve(cfg: GatewayConfig, ready: asyncio.Event | None = None,
                stop: asyncio.Event | None = None) -> None:
    """Run the gateway until `stop` is set (or forever); `ready` is set once SERVING.
    (The same shape as the workers' serve(cfg, ready, stop).)"""
    clock = StartupClock()        # its start-up phases, one line once SERVING
    tracing.setup_tracing("pdserve-gateway", span_file=cfg.trace_file or None)
    models = Models.from_config(cfg)
    metrics_server = None
    if cfg.metrics_port:
        metrics_server, _ = metrics.start_metrics_server(models.registry, cfg.host, cfg.metrics_port)
    await models.start()
    clock.mark("models + first probes")
    keys = KeyStore(cfg.api_key, cfg.api_key_file, cfg.api_key_rpm, cfg.api_key_concurrency)
    server, health_servicer = _grpc_server(models, keys)
    port = security.add_port(server, f"{cfg.host}:{cfg.grpc_port}",
                             security.server_tls(cfg.tls_cert, cfg.tls_key))
    await server.start()
    http = None
    if cfg.http_port:      # the OpenAI REST shim, in this loop (SERVING waits for it too)
        from .openai import start_http
        http = await start_http(models, cfg.host, cfg.http_port, keys,
                                (cfg.tls_cert, cfg.tls_key) if cfg.tls_cert else None,
                                drain_timeout_s=cfg.drain_timeout_s,
                                planner_url=cfg.planner_url)
    for line in security.exposed(cfg.host, {"gRPC": (port, bool(cfg.tls_cert)),
                                            "REST": (cfg.http_port, bool(cfg.tls_cert))}):
        log.warning("public %s listens in plain text beyond loopback (no --tls-cert)", line)
    if not keys.enabled and not security.is_loopback(cfg.host):
        log.warning("the public APIs on %s need no API key (no --api-key/--api-key-file)", cfg.host)
    try:
        # a SIGTERM while waiting (`pdserve up` interrupted while its workers load, which then
        # never become healthy) stops at once, not after --wait-for-workers-s
        if not await _unless_stopped(_wait_for_workers(models, cfg.wait_for_workers_s, clock), stop):
            log.info("stopped while waiting for the workers")
            return
        await _serving(f"{cfg.host}:{port}", models, health_servicer, clock)
        if ready is not None:
            ready.set()
        if stop is None:
            await server.wait_for_termination()
        else:
            await stop.wait()
    finally:
        # Drain: NOT_SERVING; both servers stop accepting at once and give the requests in
        # flight up to drain_timeout_s, together; what is left then is cancelled.
        for name in ("", SERVICE):
            await health_servicer.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
        log.info("draining: %d request(s) in flight, up to %gs",
                 sum(gw.in_flight for gw in models), cfg.drain_timeout_s)
        await asyncio.gather(server.stop(grace=cfg.drain_timeout_s),
                             *([http.stop(cfg.drain_timeout_s + 1)] if http is not None else []))
        await models.stop()
        if metrics_server is not None:
            metrics_server.shutdown()
            metrics_server.server_close()
        tracing.shutdown_tracing()


def _grpc_server(models: Models, keys: KeyStore | None = None):
    """The grpc.aio server with Generation (behind `keys`), health (serve() sets its
    statuses) and reflection."""
    interceptors = [GrpcAuth(keys, (SERVICE,))] if keys is not None and keys.enabled else []
    # after the key check; requests over MAX_BODY_BYTES (as on REST) are INVALID_ARGUMENT,
    # grpc's own RESOURCE_EXHAUSTED is left for those over twice that
    interceptors.append(security.RequestGuard((SERVICE,), max_bytes=MAX_BODY_BYTES))
    server = grpc.aio.server(options=[*SERVER_OPTIONS,
                                      ("grpc.max_receive_message_length", 2 * MAX_BODY_BYTES)],
                             interceptors=interceptors)
    generation_pb2_grpc.add_GenerationServicer_to_server(ModelRouter(models), server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection(
        [generation_pb2.DESCRIPTOR.services_by_name["Generation"].full_name,
         health.SERVICE_NAME, reflection.SERVICE_NAME], server)
    return server, health_servicer


def run(cfg: GatewayConfig) -> int:
    """`pdserve gateway`: serve on uvloop until SIGINT/SIGTERM."""
    import uvloop

    try:        # a bad models file or model directory: one line, before anything starts
        for c in model_configs(cfg):
            c.resolved_model_dir()
    except ValueError as e:
        raise SystemExit(f"pdserve gateway: {e}")

    async def main():
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        await serve(cfg, None, stop)

    uvloop.run(main())
    return 0
