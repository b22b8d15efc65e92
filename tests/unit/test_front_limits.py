"""Limits of the gateway's two fronts over real sockets: a connection that does not send a
whole request head in time is closed (slowloris), also between keep-alive requests, while a
slow but complete head is served; a gRPC request over the body limit is INVALID_ARGUMENT
with the limit in its message, not grpc's RESOURCE_EXHAUSTED."""
from __future__ import annotations

import socket
import time

import grpc
import pytest

from gateway.models import Models
from gateway.openai import start_http
from gateway.validate import MAX_BODY_BYTES
from protos.pdserve.v1 import generation_pb2, generation_pb2_grpc
from tests.unit.test_validate import Front

DEADLINE_S = 1.0
HANG_S = 20.0            # catches a connection that is never closed; never waited in full


@pytest.fixture(scope="module")
def front():
    from engine.tiny_model import ensure_default_model
    f = Front(str(ensure_default_model()))
    http = f.run(start_http(Models([f.gw]), "127.0.0.1", 0, header_timeout=DEADLINE_S))
    f.port = http.port
    yield f
    f.run(http.stop())
    f.close()


def connect(front) -> socket.socket:
    s = socket.create_connection(("127.0.0.1", front.port), timeout=HANG_S)
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return s


def closed_after(s: socket.socket, drip: bytes = b"") -> float:
    """Seconds until the server closes `s` (reading and discarding what it sends), sending
    one byte of `drip` every 0.2 s meanwhile."""
    t0 = time.monotonic()
    s.settimeout(0.2)
    while time.monotonic() - t0 < HANG_S:
        try:
            if not s.recv(4096):
                return time.monotonic() - t0
        except socket.timeout:
            if drip:
                s.sendall(drip[:1])
                drip = drip[1:]
        except ConnectionResetError:
            return time.monotonic() - t0
    raise AssertionError(f"connection still open after {HANG_S} s")


def get_models(s: socket.socket, pieces: int = 1) -> bytes:
    """One GET /v1/models sent in `pieces` parts 0.1 s apart; the response head."""
    req = b"GET /v1/models HTTP/1.1\r\nHost: x\r\n\r\n"
    step = -(-len(req) // pieces)
    for k in range(0, len(req), step):
        s.sendall(req[k:k + step])
        time.sleep(0.1)
    s.settimeout(HANG_S)
    head = b""
    while b"\r\n\r\n" not in head:
        head += s.recv(4096)
    return head


def test_half_sent_heads_are_closed_by_the_deadline(front):
    socks = [connect(front) for _ in range(10)]
    for k, s in enumerate(socks):
        s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Le"[:10 + 4 * k])
    dripping, silent = connect(front), connect(front)        # a byte every 0.2 s; nothing
    t0 = time.monotonic()
    waited = [closed_after(dripping, b"GET /v1/models HTTP/1.1\r\nHost: x\r\nX-Slow: " + b"y" * 200)]
    waited += [closed_after(s) for s in socks + [silent]]
    assert time.monotonic() - t0 >= DEADLINE_S * 0.9        # (a timer never fires early)
    assert max(waited) < HANG_S
    for s in socks + [dripping, silent]:
        s.close()


def test_slow_complete_heads_and_keep_alive(front):
    s = connect(front)
    assert get_models(s, pieces=4).startswith(b"HTTP/1.1 200")   # 0.4 s < the deadline
    assert get_models(s).startswith(b"HTTP/1.1 200")             # the same connection
    s.sendall(b"GET /v1/mo")                                      # then half a head
    assert closed_after(s) < HANG_S
    s.close()


def test_grpc_request_over_the_body_limit(front):
    with grpc.insecure_channel(f"127.0.0.1:{front.grpc_port}") as ch:
        stub = generation_pb2_grpc.GenerationStub(ch)
        for size in (MAX_BODY_BYTES + 1, 5 << 20):        # over ours; over grpc's default 4 MB
            req = generation_pb2.GenerateRequest(text="a" * size)
            with pytest.raises(grpc.RpcError) as e:
                list(stub.Generate(req, timeout=60))
            assert e.value.code() is grpc.StatusCode.INVALID_ARGUMENT, e.value
            if size > MAX_BODY_BYTES:
                assert f"over the limit of {MAX_BODY_BYTES} bytes" in e.value.details()
