"""TLS for the public ports and mTLS between the roles (torch-free: the gateway uses it).

    public ports (gateway gRPC + REST):  server TLS from --tls-cert/--tls-key (off: plain text)
    internal gRPC (gateway -> workers, prefill -> decode Stats):  mTLS with the operator's CA
        worker servers:  their --mtls-cert/--mtls-key, and a client certificate signed by
                         --mtls-ca is REQUIRED (a peer without one fails the TLS handshake)
        callers:         present their own --mtls-cert, verify the worker's against the CA
                         (the name checked: --mtls-server-name, else the address's host)

With no CA configured everything stays plain text (the default on loopback); `exposed`
names the ports that listen beyond loopback without TLS, for a warning.

The internal credential (a token in a file: --internal-token-file; `pdserve up` makes one
per deployment, the manifests mount a Secret), with or without mTLS:
    worker servers:  every pdserve.v1 RPC (Stats too; health and reflection stay open)
                     needs metadata `authorization: Bearer TOKEN`, else UNAUTHENTICATED
                     (RequestGuard)
    callers:         the gateway and the prefill workers send it (`channel(..., token=)`)
    transfer ids:    a decode worker signs each transfer id it reserves (HMAC of the id's
                     nonce and the reservation's expiry, keyed by the token); a prefill
                     worker refuses a Prefill whose id it cannot verify before any compute
The token never appears on a command line (`ps`): only the file's path does.
"""
from __future__ import annotations

import hashlib
import hmac
import ipaddress
import os
import secrets
from dataclasses import dataclass
from pathlib import Path

import grpc


def tls_pair(cert_name: str, cert: str, key_name: str, key: str) -> None:
    """Both or neither of a certificate and its key (ValueError otherwise)."""
    if bool(cert) != bool(key):
        raise ValueError(f"give both {cert_name} and {key_name}, or neither")


def mtls_triple(ca: str, cert: str, key: str) -> None:
    if (ca or cert or key) and not (ca and cert and key):
        raise ValueError("mTLS needs all of mtls_ca, mtls_cert and mtls_key")


def _read(path: str) -> bytes:
    try:
        return Path(path).expanduser().read_bytes()
    except OSError as e:
        raise ValueError(f"cannot read {path!r}: {e.strerror}") from None


@dataclass(frozen=True)
class MTLS:
    """One process's internal identity: the CA both ends trust, its certificate and key."""
    ca: bytes
    cert: bytes
    key: bytes
    server_name: str = ""          # callers: the name expected in the peer's certificate

    @classmethod
    def from_config(cls, cfg) -> "MTLS | None":
        """From a config's mtls_ca/mtls_cert/mtls_key (and mtls_server_name); None when off."""
        if not cfg.mtls_ca:
            return None
        return cls(_read(cfg.mtls_ca), _read(cfg.mtls_cert), _read(cfg.mtls_key),
                   getattr(cfg, "mtls_server_name", ""))

    def server_credentials(self) -> grpc.ServerCredentials:
        return grpc.ssl_server_credentials([(self.key, self.cert)], root_certificates=self.ca,
                                           require_client_auth=True)

    def channel_credentials(self) -> grpc.ChannelCredentials:
        return grpc.ssl_channel_credentials(root_certificates=self.ca, private_key=self.key,
                                            certificate_chain=self.cert)


def read_token(path: str) -> str:
    """The internal credential in `path` ("" when no path is given); ValueError when the
    file cannot be read or holds no token of at least 16 characters."""
    if not path:
        return ""
    token = _read(path).decode(errors="replace").strip()
    if len(token) < 16 or any(c.isspace() for c in token):
        raise ValueError(f"{path!r} must hold one token of at least 16 characters")
    return token


def write_token(path: str) -> None:
    """A new random internal credential in `path`, readable by its owner only."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(secrets.token_urlsafe(32) + "\n")


def bearer(token: str) -> str:
    return f"Bearer {token}"


def _transfer_mac(token: str, nonce: str, expires_at_ms: int) -> str:
    msg = f"pdserve transfer {nonce} {expires_at_ms}".encode()
    return hmac.new(token.encode(), msg, hashlib.sha256).hexdigest()[:24]


def new_transfer_id(token: str, expires_at_ms: int) -> str:
    """An unguessable transfer id (48 hex digits); with a token, its second half is the HMAC
    of the first and of the reservation's expiry, which `transfer_id_signed` checks."""
    nonce = secrets.token_hex(12)
    return nonce + (_transfer_mac(token, nonce, expires_at_ms) if token else secrets.token_hex(12))


def transfer_id_signed(token: str, transfer_id: str, expires_at_ms: int) -> bool:
    """Whether a decode worker holding `token` made this id for a reservation ending then."""
    nonce, mac = transfer_id[:24], transfer_id[24:]
    return len(transfer_id) == 48 and hmac.compare_digest(mac, _transfer_mac(token, nonce, expires_at_ms))


def caller_of(context) -> str:
    """Who calls a server (per-caller limits): its certificate's name under mTLS, else its
    address without the port."""
    names = (context.auth_context() or {}).get("x509_common_name", ())
    if names:
        return "certificate " + b",".join(names).decode(errors="replace")
    return "peer " + context.peer().rpartition(":")[0]


def _with_token(details, md):
    kept = [m for m in (details.metadata or ()) if m[0] != "authorization"]
    return details._replace(metadata=grpc.aio.Metadata(*kept, md))


class _TokenUnary(grpc.aio.UnaryUnaryClientInterceptor):
    """Adds `authorization: Bearer TOKEN` to every unary call of a channel (grpc.aio files an
    interceptor under one kind only: one class per kind)."""

    def __init__(self, token: str):
        self.md = ("authorization", bearer(token))

    async def intercept_unary_unary(self, continuation, details, request):
        return await continuation(_with_token(details, self.md), request)


class _TokenStream(grpc.aio.UnaryStreamClientInterceptor):
    """The same for server-streaming calls (Decode)."""

    def __init__(self, token: str):
        self.md = ("authorization", bearer(token))

    async def intercept_unary_stream(self, continuation, details, request):
        return await continuation(_with_token(details, self.md), request)


def server_tls(cert: str, key: str) -> grpc.ServerCredentials | None:
    """Server-side TLS (no client certificate) from PEM files; None when not configured."""
    if not cert:
        return None
    return grpc.ssl_server_credentials([(_read(key), _read(cert))])


def add_port(server: grpc.aio.Server, address: str, creds: grpc.ServerCredentials | None) -> int:
    """Bind `address` with TLS when `creds` is given; raises OSError when it cannot bind."""
    port = (server.add_secure_port(address, creds) if creds is not None
            else server.add_insecure_port(address))
    if port == 0:
        raise OSError(f"cannot bind {address}")
    return port


def channel(address: str, mtls: MTLS | None, options: list | None = None,
            token: str = "") -> grpc.aio.Channel:
    """A grpc.aio channel to an internal RPC server: mTLS when `mtls`, else plain text;
    every call carries the internal credential `token` when one is given."""
    options = list(options or [])
    interceptors = [_TokenUnary(token), _TokenStream(token)] if token else None
    if mtls is None:
        return grpc.aio.insecure_channel(address, options=options, interceptors=interceptors)
    if mtls.server_name:
        options.append(("grpc.ssl_target_name_override", mtls.server_name))
    return grpc.aio.secure_channel(address, mtls.channel_credentials(), options=options,
                                   interceptors=interceptors)


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def exposed(host: str, ports: dict[str, tuple[int, bool]]) -> list[str]:
    """'name host:port' for each port (name -> (port, has TLS)) that listens beyond loopback
    in plain text."""
    if is_loopback(host):
        return []
    return [f"{name} {host}:{port}" for name, (port, tls) in ports.items() if port and not tls]


class RequestGuard(grpc.aio.ServerInterceptor):
    """Checks every request to the methods of `services` before its handler runs:
    - with `token` (the internal credential), a call without metadata `authorization:
      Bearer TOKEN` gets UNAUTHENTICATED;
    - with `callers` (certificate common names; mTLS only), a peer whose certificate names
      none of them gets PERMISSION_DENIED for any method but Stats: the gateway's RPCs
      (Decode, Prefill, SubmitFirstToken, Abort, KvEvents) are the gateway's even among the holders
      of the operator's certificates (a prefill worker reads a decode worker's Stats);
    - a request that does not parse ends with INVALID_ARGUMENT (grpc's own handling says
      UNKNOWN): the methods get raw bytes and parse them here; so does one over `max_bytes`
      (0: no limit; the server's max_receive_message_length must be above it, or grpc
      answers RESOURCE_EXHAUSTED itself first).
    Only unary requests (every pdserve.v1 method), served by async generators or coroutines."""

    def __init__(self, services: tuple[str, ...], callers: frozenset[str] = frozenset(),
                 max_bytes: int = 0, token: str = ""):
        self.prefixes = tuple(f"/{s}/" for s in services)
        self.callers = callers
        self.max_bytes = max_bytes
        self.authorization = bearer(token).encode() if token else b""

    async def intercept_service(self, continuation, details):
        handler = await continuation(details)
        if (handler is None or handler.request_deserializer is None
                or not details.method.startswith(self.prefixes)):
            return handler
        parse, method = handler.request_deserializer, details.method

        async def parsed(raw: bytes, context):
            if self.authorization:
                got = dict(context.invocation_metadata() or ()).get("authorization", "")
                if not hmac.compare_digest(got.encode(), self.authorization):
                    await context.abort(grpc.StatusCode.UNAUTHENTICATED,
                                        f"{method} needs this deployment's internal credential "
                                        "(metadata 'authorization: Bearer <token>', "
                                        "--internal-token-file)")
            if self.callers and not method.endswith("/Stats"):
                names = {v.decode(errors="replace") for v in
                         (context.auth_context() or {}).get("x509_common_name", ())}
                if not names & self.callers:
                    await context.abort(grpc.StatusCode.PERMISSION_DENIED,
                                        f"{method} is not open to certificate "
                                        f"{', '.join(sorted(names)) or '(none)'}")
            if self.max_bytes and len(raw) > self.max_bytes:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                    f"the request is {len(raw)} bytes, over the limit of "
                                    f"{self.max_bytes} bytes")
            try:
                return parse(raw)
            except Exception as e:        # protobuf's DecodeError, and anything a parser raises
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                    f"malformed {method} request: {type(e).__name__}")

        kw = dict(response_serializer=handler.response_serializer)
        if handler.unary_unary is not None:
            async def unary_unary(raw, context):
                return await handler.unary_unary(await parsed(raw, context), context)
            return grpc.unary_unary_rpc_method_handler(unary_unary, **kw)
        if handler.unary_stream is not None:
            async def unary_stream(raw, context):
                async for msg in handler.unary_stream(await parsed(raw, context), context):
                    yield msg
            return grpc.unary_stream_rpc_method_handler(unary_stream, **kw)
        return handler
