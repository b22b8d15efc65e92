"""One prefill worker's connection into a KVReceiver (receiver.py): its HELLO checked, then
its LAYER messages read into staging buffers and handed to the receiver, which checks each
against its transfer and writes it (or drops it).

    HELLO {CompatKey, staging, token}  protocol version, CompatKey and staging must equal the
                                       receiver's, and the token must name a transfer live
                                       on it -> HELLO_ACK {its CompatKey, staging}; else
                                       REJECT {error, compat}, and the connection closes
    LAYER header + body, ...           until the sender closes; anything but a LAYER or a
    KEEPALIVE header (no body)         KEEPALIVE drops the connection; a KEEPALIVE restarts
                                       its transfer's idle window (KVReceiver.keepalive)
    dropped for a malformed message (a bad header, a truncated or cut body) or a transport
    error: every live transfer it had fed fails at once (KVReceiver.fail_fed), so the
    decode worker learns it now instead of at the deadline

Who may send: only a peer that names a reservation (the decode worker makes transfer ids
unguessable and hands them out only with a reservation, over its mTLS-protected gRPC).
Sizes are checked before any buffer is sized: a HELLO body above MAX_HELLO_BYTES or a LAYER
body above the largest possible layer message (every block of the cache) drops the
connection unread.
"""
from __future__ import annotations

import asyncio
import json
import logging

from .transport import Connection, ConnectionClosed, TransportError
from .wire import (HEADER_BYTES, MAX_HELLO_BYTES, PROTOCOL_VERSION, CompatKey, Header,
                   IncompatibleKV, MsgType, WireError, hello_body)

log = logging.getLogger(__name__)
MAX_FED = 4096                 # transfer ids a connection remembers feeding


class Inbound:
    """Reads one connection for `rx` (its KVReceiver) until it closes or breaks (`run`)."""

    def __init__(self, rx, conn: Connection):
        self.rx, self.conn = rx, conn
        self.fed: set[str] = set()    # transfer ids this connection sent LAYERs for

    async def run(self) -> None:
        rx, conn = self.rx, self.conn
        try:
            if not await self._handshake():
                return
            while True:
                await self._next_layer()
        except (ConnectionClosed, asyncio.CancelledError):
            pass
        except (WireError, TransportError) as e:
            log.warning("KV connection from %s dropped: %s", conn.peer, e)
            rx.fail_fed(self.fed, f"its KV connection was dropped: {e}")
        except Exception:
            log.exception("KV connection from %s: receiver error", conn.peer)
            rx.fail_fed(self.fed, "its KV connection failed (receiver error)")
        finally:
            await conn.close()

    async def _next_layer(self) -> None:
        """Read one LAYER message into a staging buffer and hand it to the receiver; the
        buffer goes back to the pool at once, or after the receiver's side-stream write."""
        rx, conn = self.rx, self.conn
        hdr = Header.unpack(await conn.recv(HEADER_BYTES))
        if hdr.msg_type in (MsgType.LAYER, MsgType.KEEPALIVE) and len(self.fed) < MAX_FED:
            self.fed.add(hdr.transfer_id)
        if hdr.msg_type is MsgType.KEEPALIVE:
            if hdr.body_bytes:
                raise WireError(f"KEEPALIVE with a body of {hdr.body_bytes} bytes")
            rx.keepalive(hdr.transfer_id)
            return
        if hdr.msg_type is not MsgType.LAYER:
            raise WireError(f"unexpected {hdr.msg_type.name} after the handshake")
        if hdr.body_bytes > rx.max_body_bytes:
            raise WireError(f"LAYER body of {hdr.body_bytes} bytes: the largest possible "
                            f"is {rx.max_body_bytes}")
        body = rx.pool.acquire(hdr.body_bytes)
        try:
            if hdr.body_bytes:
                await conn.recv(into=body)
            copied, done = rx.on_layer(hdr, body)
        except BaseException:
            rx.pool.release(body, reuse=False)
            raise
        if copied is None:
            rx.pool.release(body)
        else:
            rx.settle_later(copied, body, done)

    async def _handshake(self) -> bool:
        """Read the HELLO; answer HELLO_ACK (True) or REJECT (False)."""
        rx, conn = self.rx, self.conn
        hdr = Header.unpack(await conn.recv(HEADER_BYTES))
        if hdr.msg_type is not MsgType.HELLO:
            raise WireError(f"expected HELLO, got {hdr.msg_type.name}")
        if hdr.body_bytes > MAX_HELLO_BYTES:
            rx.rejected_connections += 1
            raise WireError(f"HELLO body of {hdr.body_bytes} bytes (at most {MAX_HELLO_BYTES})")
        body = await conn.recv(hdr.body_bytes) if hdr.body_bytes else b""
        error = self._refusal(hdr, body)
        if error:
            rx.rejected_connections += 1
            log.warning("rejected KV connection from %s: %s", conn.peer, error)
            reply = json.dumps({"error": error, "compat": json.loads(rx.compat.to_json())}).encode()
            await self._send(Header(MsgType.REJECT, body_bytes=len(reply)), reply)
            return False
        reply = hello_body(rx.compat, rx.staging)
        await self._send(Header(MsgType.HELLO_ACK, body_bytes=len(reply)), reply)
        return True

    def _refusal(self, hdr: Header, body: bytes) -> str:
        """Why this HELLO is refused ("": it is not)."""
        rx = self.rx
        if hdr.version != PROTOCOL_VERSION:
            return f"protocol version: sender={hdr.version} receiver={PROTOCOL_VERSION}"
        try:
            hello = CompatKey.parse_hello(body)
            rx.compat.check(CompatKey.from_dict(hello), "decode", "prefill")
        except (IncompatibleKV, WireError) as e:
            return str(e)
        staging = hello.get("staging", "host")
        if staging != rx.staging:
            return f"KV staging: decode={rx.staging!r} prefill={staging!r}"
        if not rx.is_reserved(hello.get("token")):
            return "the HELLO names no reservation of this receiver (bad token)"
        return ""

    async def _send(self, hdr: Header, body: bytes) -> None:
        await self.conn.send(hdr.pack())
        if body:
            await self.conn.send(body)
