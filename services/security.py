"""TLS for the public ports and mTLS between the roles (torch-free: the gateway uses it).

    public ports (gateway gRPC + REST):  server TLS from --tls-cert/--tls-key (off: plain text)
    internal gRPC (gateway -> workers, prefill -> decode Stats):  mTLS with the operator's CA
        worker servers:  their --mtls-cert/--mtls-key, and a client certificate signed by
                         --mtls-ca is REQUIRED (a peer without one fails the TLS handshake)
        callers:         present their own --mtls-cert, verify the worker's against the CA
                         (the name checked: --mtls-server-name, else the address's host)

With no CA configured everything stays plain text (the default on loopback); `exposed`
names the ports that listen beyond loopback without TLS, for a warning.
"""
from __future__ import annotations

import ipaddress
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


def channel(address: str, mtls: MTLS | None, options: list | None = None) -> grpc.aio.Channel:
    """A grpc.aio channel to an internal RPC server: mTLS when `mtls`, else plain text."""
    options = list(options or [])
    if mtls is None:
        return grpc.aio.insecure_channel(address, options=options)
    if mtls.server_name:
        options.append(("grpc.ssl_target_name_override", mtls.server_name))
    return grpc.aio.secure_channel(address, mtls.channel_credentials(), options=options)


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
    - with `callers` (certificate common names; mTLS only), a peer whose certificate names
      none of them gets PERMISSION_DENIED for any method but Stats: the gateway's RPCs
      (Decode, Prefill, SubmitFirstToken, Abort) are the gateway's even among the holders
      of the operator's certificates (a prefill worker reads a decode worker's Stats);
    - a request that does not parse ends with INVALID_ARGUMENT (grpc's own handling says
      UNKNOWN): the methods get raw bytes and parse them here; so does one over `max_bytes`
      (0: no limit; the server's max_receive_message_length must be above it, or grpc
      answers RESOURCE_EXHAUSTED itself first).
    Only unary requests (every pdserve.v1 method), served by async generators or coroutines."""

    def __init__(self, services: tuple[str, ...], callers: frozenset[str] = frozenset(),
                 max_bytes: int = 0):
        self.prefixes = tuple(f"/{s}/" for s in services)
        self.callers = callers
        self.max_bytes = max_bytes

    async def intercept_service(self, continuation, details):
        handler = await continuation(details)
        if (handler is None or handler.request_deserializer is None
                or not details.method.startswith(self.prefixes)):
            return handler
        parse, method = handler.request_deserializer, details.method

        async def parsed(raw: bytes, context):
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
