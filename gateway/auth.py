"""API keys on both public APIs, with per-key request and concurrency limits.

    REST  `Authorization: Bearer KEY`                    -> `rest_middleware` (401 / 429)
    gRPC  metadata `authorization: Bearer KEY`           -> `GrpcAuth` interceptor
                                                            (UNAUTHENTICATED / RESOURCE_EXHAUSTED)

Keys come from --api-key, the PDSERVE_API_KEY environment variable (`pdserve gateway` reads
it when --api-key is not given: a key there, unlike on a command line, does not show in
`ps`; `pdserve up` hands its key to the gateway that way) and --api-key-file. The file holds one key a line, optionally with
its own limits (`KEY rpm=60 concurrency=4`; blank lines and `# comments` skipped); it is
re-read when it changes (checked at most every `reload_interval_s`, on the next request),
so a key added is accepted and a key removed is refused without a restart. With no key at
all the APIs are open. Limits: `rpm` requests per minute (a token bucket holding `rpm`
tokens, refilled at rpm/60 per second) and `concurrency` requests in flight (a stream holds
its slot until it ends); 0 is unlimited. Health, metrics and reflection stay open, and so
does the status page's HTML (`/status`, which holds no data); its data, `/status.json`
(worker addresses and errors, which client-facing errors never show), needs a key like /v1
(the page asks for one when it gets 401 and keeps it in the tab's sessionStorage).

A key is never logged; a request is known in logs by the key's short hash (`key_id`).
"""
from __future__ import annotations

import hashlib
import logging
import os
import time
from dataclasses import dataclass

import grpc

log = logging.getLogger(__name__)

API_KEY_ENV = "PDSERVE_API_KEY"


class AuthError(Exception):
    """`status` 401 (no or unknown key) or 429 (over a limit)."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status, self.message = status, message

    @property
    def grpc_code(self) -> grpc.StatusCode:
        return grpc.StatusCode.UNAUTHENTICATED if self.status == 401 else grpc.StatusCode.RESOURCE_EXHAUSTED


@dataclass
class _Key:
    key_id: str
    rpm: int
    concurrency: int
    tokens: float = 0.0
    refilled: float = 0.0
    in_flight: int = 0


def key_id(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()[:12]


def parse_key_file(text: str, rpm: int, concurrency: int) -> dict[str, tuple[int, int]]:
    """KEY -> (rpm, concurrency) from a key file's text (ValueError on a bad line)."""
    keys = {}
    for n, line in enumerate(text.splitlines(), 1):
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        key, *opts = line.split()
        limits = {"rpm": rpm, "concurrency": concurrency}
        for opt in opts:
            name, _, value = opt.partition("=")
            if name not in limits or not value.isdigit():
                raise ValueError(f"line {n}: expected KEY [rpm=N] [concurrency=N], got {opt!r}")
            limits[name] = int(value)
        keys[key] = (limits["rpm"], limits["concurrency"])
    return keys


class Lease:
    """One admitted request's concurrency slot; released once (context manager)."""

    def __init__(self, entry: _Key | None):
        self._entry = entry

    def release(self) -> None:
        if self._entry is not None:
            self._entry.in_flight -= 1
            self._entry = None

    def __enter__(self) -> "Lease":
        return self

    def __exit__(self, *exc) -> None:
        self.release()


class KeyStore:
    """The accepted keys and each key's limits and usage (all on the event loop)."""

    def __init__(self, api_key: str = "", key_file: str = "", rpm: int = 0, concurrency: int = 0,
                 reload_interval_s: float = 0.5):
        self.api_key, self.key_file = api_key, key_file
        self.rpm, self.concurrency = rpm, concurrency
        self.reload_interval_s = reload_interval_s
        self._keys: dict[str, _Key] = {}
        self._file_state = None
        self._checked = float("-inf")
        self._load(initial=True)

    @property
    def enabled(self) -> bool:
        return bool(self.api_key or self.key_file)

    def _load(self, initial: bool = False) -> None:
        """(Re-)read the key file if it changed; a bad or missing file at run time keeps the
        keys it had (logged), at start it is an error."""
        wanted = {self.api_key: (self.rpm, self.concurrency)} if self.api_key else {}
        if self.key_file:
            try:
                st = os.stat(self.key_file)
                state = (st.st_mtime_ns, st.st_size, st.st_ino)
                if state == self._file_state:
                    return
                with open(self.key_file) as f:
                    wanted.update(parse_key_file(f.read(), self.rpm, self.concurrency))
            except (OSError, ValueError) as e:
                if initial:
                    raise ValueError(f"API key file {self.key_file!r}: {e}") from None
                log.error("API key file %s not reloaded (keeping %d keys): %s",
                          self.key_file, len(self._keys), e)
                return
            self._file_state = state
        old, self._keys = self._keys, {}
        for key, (rpm, conc) in wanted.items():
            entry = old.get(key) or _Key(key_id(key), rpm, conc, float(rpm), time.monotonic())
            entry.rpm, entry.concurrency = rpm, conc
            self._keys[key] = entry
        if not initial:
            log.info("API keys reloaded from %s: %d keys", self.key_file, len(self._keys))

    def admit(self, authorization: str | None) -> Lease:
        """Check an `Authorization` value and take one request of its key's limits; raises
        AuthError (401, 429). No keys configured: an empty lease."""
        if not self.enabled:
            return Lease(None)
        now = time.monotonic()
        if self.key_file and now - self._checked >= self.reload_interval_s:
            self._checked = now
            self._load()
        scheme, _, token = (authorization or "").partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            raise AuthError(401, "missing API key: send 'Authorization: Bearer <key>'")
        entry = self._keys.get(token.strip())
        if entry is None:
            raise AuthError(401, "incorrect API key provided")
        if entry.concurrency and entry.in_flight >= entry.concurrency:
            raise AuthError(429, f"this API key already has {entry.in_flight} requests in flight "
                                 f"(its limit is {entry.concurrency})")
        if entry.rpm:
            entry.tokens = min(entry.rpm, entry.tokens + (now - entry.refilled) * entry.rpm / 60.0)
            entry.refilled = now
            if entry.tokens < 1.0:
                raise AuthError(429, f"this API key is over its limit of {entry.rpm} requests "
                                     "per minute")
            entry.tokens -= 1.0
        entry.in_flight += 1
        return Lease(entry)


# -- REST -----------------------------------------------------------------------------------

KEYED_PATHS = ("/status.json",)      # besides everything under /v1


def needs_key(path: str) -> bool:
    return path.startswith("/v1") or path in KEYED_PATHS


def rest_middleware(store: KeyStore, error_response):
    """A pure ASGI middleware: /v1 and /status.json requests need a key; the lease is held until the whole
    response (a stream included) is sent. `error_response(status, message)` -> ASGI app."""
    def wrap(app):
        async def middleware(scope, receive, send):
            if scope["type"] != "http" or not needs_key(scope["path"]):
                return await app(scope, receive, send)
            auth = next((v.decode("latin-1") for k, v in scope["headers"] if k == b"authorization"), None)
            try:
                lease = store.admit(auth)
            except AuthError as e:
                return await error_response(e.status, e.message)(scope, receive, send)
            with lease:
                await app(scope, receive, send)
        return middleware
    return wrap


# -- gRPC -----------------------------------------------------------------------------------

class GrpcAuth(grpc.aio.ServerInterceptor):
    """Every method of `services` needs a key (metadata `authorization: Bearer KEY`)."""

    def __init__(self, store: KeyStore, services: tuple[str, ...]):
        self.store = store
        self.prefixes = tuple(f"/{s}/" for s in services)

    async def intercept_service(self, continuation, details):
        handler = await continuation(details)
        if handler is None or not self.store.enabled or not details.method.startswith(self.prefixes):
            return handler
        store = self.store

        async def admit(context) -> Lease:
            md = dict(context.invocation_metadata() or ())
            try:
                return store.admit(md.get("authorization"))
            except AuthError as e:
                await context.abort(e.grpc_code, e.message)

        kw = dict(request_deserializer=handler.request_deserializer,
                  response_serializer=handler.response_serializer)
        if handler.unary_unary is not None:
            async def unary_unary(request, context):
                with await admit(context):
                    return await handler.unary_unary(request, context)
            return grpc.unary_unary_rpc_method_handler(unary_unary, **kw)
        if handler.unary_stream is not None:
            async def unary_stream(request, context):
                with await admit(context):
                    async for msg in handler.unary_stream(request, context):
                        yield msg
            return grpc.unary_stream_rpc_method_handler(unary_stream, **kw)
        raise TypeError(f"{details.method}: streaming requests are not served")
