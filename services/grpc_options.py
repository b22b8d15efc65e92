"""Options of every pdserve gRPC server (the gateway's and the workers').

grpc-core keeps the calls that arrived but that the server has not yet picked up (a
grpc.aio server picks them up on its event loop, one at a time), and past
`grpc.server.max_pending_requests` (default 1,000) it cancels new ones at random, with a
probability reaching 1 at `..._hard_limit` (default 3,000). A burst of about 1,200 streams
was enough: clients got CANCELLED (REST: 500). These limits are raised so that a burst
reaches the servicer, which refuses what it cannot take with a proper status (the gateway:
RESOURCE_EXHAUSTED, gateway/admission.py; a decode worker: its reservation refusals).
`grpc.max_concurrent_streams` is not set: calls past it are refused with REFUSED_STREAM,
which clients see as UNAVAILABLE (a worker that looks dead), not as overload.
"""
from __future__ import annotations

MAX_PENDING_CALLS = 20_000

SERVER_OPTIONS = [
    ("grpc.so_reuseport", 0),
    ("grpc.server.max_pending_requests", MAX_PENDING_CALLS),
    ("grpc.server.max_pending_requests_hard_limit", 2 * MAX_PENDING_CALLS),
]
