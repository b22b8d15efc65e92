"""The KV receiver keeps strangers out: a HELLO must carry the token (transfer id) of a live
reservation, and no header can make it size a buffer beyond the largest possible layer
message (checked by recording every buffer it allocates, and the process's RSS). The UCX
transport pins UCX's data path to the configured host's device, and its connection listener
(a bootstrap socket: kvtransfer/ucx.py) binds that host only: no socket of the process
listens anywhere else. Junk on that socket ends only its own connection, and a sender killed
in the middle of a message never leaves the receiver waiting."""
from __future__ import annotations

import asyncio
import os
import subprocess
import sys

import psutil
import pytest
import torch

from kvtransfer import CompatKey, KVReceiver, LoopbackTransport
from kvtransfer import receiver as receiver_mod
from kvtransfer.transport import ConnectionClosed
from kvtransfer.wire import HEADER_BYTES, MAX_HELLO_BYTES, Header, MsgType

L, NB = 2, 8
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def cache():
    return torch.zeros(L, 2, NB, 4, 2, 8)


def key(c):
    return CompatKey.from_cache(c, "m")


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 20))


@pytest.fixture
def allocations(monkeypatch):
    """Sizes of every torch.empty the receiver makes."""
    sizes = []
    real = torch.empty

    def empty(*shape, **kw):
        sizes.append(shape[0] if len(shape) == 1 and isinstance(shape[0], int) else shape)
        return real(*shape, **kw)
    monkeypatch.setattr(receiver_mod.torch, "empty", empty)
    return sizes


async def receiver():
    dst = cache()
    rx = KVReceiver(dst, key(dst), LoopbackTransport(), 5.0)
    return rx, await rx.start(), dst


async def closed(conn) -> bool:
    """True once the receiver dropped the connection (it sends nothing more)."""
    try:
        await asyncio.wait_for(conn.recv(HEADER_BYTES), 5)
    except Exception:
        return True
    return False


def test_oversized_hello_is_refused_before_allocation(allocations):
    async def main():
        rx, addr, _ = await receiver()
        rss = psutil.Process().memory_info().rss
        conn = await LoopbackTransport().connect(addr)
        await conn.send(Header(MsgType.HELLO, body_bytes=8 << 30).pack())    # claims 8 GiB
        assert await closed(conn)
        assert rx.rejected_connections == 1
        assert psutil.Process().memory_info().rss - rss < 64 << 20
        await rx.close()
    run(main())
    assert max(allocations, default=0) <= MAX_HELLO_BYTES


def test_forged_token_is_rejected_and_nothing_is_written(allocations):
    async def main():
        rx, addr, dst = await receiver()
        rx.reserve("a" * 48, [1, 2])
        conn = await LoopbackTransport().connect(addr)
        hello = key(dst).hello("b" * 48)                    # a token nobody issued
        await conn.send(Header(MsgType.HELLO, body_bytes=len(hello)).pack())
        await conn.send(hello)
        reply = Header.unpack(await conn.recv(HEADER_BYTES))
        assert reply.msg_type is MsgType.REJECT
        body = await conn.recv(reply.body_bytes)
        assert b"bad token" in bytes(body)
        # whatever it sends next is never read: the connection is closed
        with pytest.raises(ConnectionClosed):
            await conn.send(Header(MsgType.LAYER, "a" * 48, 0, 0, 2, 1 << 40).pack())
        assert torch.count_nonzero(dst) == 0
        await rx.close()
    run(main())
    assert allocations == []                             # no staging buffer was taken


def test_oversized_layer_after_a_good_handshake_drops_the_connection(allocations):
    async def main():
        rx, addr, dst = await receiver()
        tid = "c" * 48
        rx.reserve(tid, [1, 2])
        conn = await LoopbackTransport().connect(addr)
        hello = key(dst).hello(tid)
        await conn.send(Header(MsgType.HELLO, body_bytes=len(hello)).pack())
        await conn.send(hello)
        ack = Header.unpack(await conn.recv(HEADER_BYTES))
        assert ack.msg_type is MsgType.HELLO_ACK
        await conn.recv(ack.body_bytes)
        rss = psutil.Process().memory_info().rss
        await conn.send(Header(MsgType.LAYER, tid, 0, 0, 2, 1 << 40).pack())   # 1 TiB body
        assert await closed(conn)
        assert psutil.Process().memory_info().rss - rss < 64 << 20
        await rx.close()
    run(main())
    assert allocations == []


PROBE = """
import asyncio, os, sys
from kvtransfer.ucx import UcxTransport
async def main():
    t = UcxTransport(sys.argv[1], 0)
    print(await t.listen(lambda c: None), flush=True)
    sys.stdin.readline()
    await t.close()
asyncio.run(main())
"""


def _listening(pid: int) -> list[str]:
    out = subprocess.run(["ss", "-ltnpH"], capture_output=True, text=True, timeout=10).stdout
    return [line.split()[3] for line in out.splitlines() if f"pid={pid}," in line]


def _ucx_listeners(host: str) -> tuple[str, list[str]]:
    env = {k: v for k, v in os.environ.items() if k != "UCX_NET_DEVICES"}
    p = subprocess.Popen([sys.executable, "-c", PROBE, host], stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, text=True, env=env)
    try:
        address = p.stdout.readline().strip()
        return address, _listening(p.pid)
    finally:
        p.communicate("\n", timeout=30)


@pytest.mark.skipif(not os.path.exists("/usr/bin/ss") and not os.path.exists("/bin/ss"),
                    reason="needs ss (iproute2)")
def test_ucx_data_path_binds_only_the_configured_host():
    address, sockets = _ucx_listeners("127.0.0.1")
    port = address.rpartition(":")[2]
    data = [s for s in sockets if s.rpartition(":")[2] != port]
    assert data and all(s.startswith("127.0.0.1:") for s in data), sockets


def test_ucx_connection_listener_binds_only_the_configured_host():
    address, sockets = _ucx_listeners("127.0.0.1")
    port = address.rpartition(":")[2]
    assert [s for s in sockets if s.endswith(":" + port)] == [f"127.0.0.1:{port}"], sockets
    assert all(s.startswith("127.0.0.1:") for s in sockets), sockets     # nothing else either


async def _serve_one(transport, got: asyncio.Queue):
    """Listen; each connection's first receive's outcome goes to `got`."""
    async def handler(conn):
        try:
            await conn.recv(into=bytearray(64 << 20))
            await got.put("received")
        except ConnectionClosed as e:
            await got.put(e)
    return int((await transport.listen(handler)).rpartition(":")[2])


def test_ucx_bootstrap_survives_strangers():
    """Junk on the KV port (a made-up worker address, frames the decoder never expects, a
    peer that leaves at once) ends those connections and nothing else: the process lives
    (UCX would abort it on a malformed worker address it parsed) and serves a real peer."""
    import struct
    from kvtransfer.ucx import UcxTransport

    async def main():
        rx, tx, got = UcxTransport("127.0.0.1", 0), UcxTransport(), asyncio.Queue()
        port = await _serve_one(rx, got)
        for junk in (struct.pack("<H", 52) + os.urandom(52), struct.pack("<Q", 8) + b"x" * 8, b""):
            r, w = await asyncio.open_connection("127.0.0.1", port)
            await r.readexactly(15)                     # the decoder's bootstrap header
            w.write(junk)
            await w.drain()
            w.close()
            assert isinstance(await asyncio.wait_for(got.get(), 15), ConnectionClosed)
        conn = await tx.connect(f"ucx://127.0.0.1:{port}")
        await conn.send(bytearray(64 << 20))
        assert await asyncio.wait_for(got.get(), 15) == "received"
        await tx.close()
        await rx.close()
    asyncio.run(asyncio.wait_for(main(), 90))


SENDER = """
import asyncio, os, signal, sys
from kvtransfer.ucx import UcxTransport
async def main():
    conn = await UcxTransport().connect(sys.argv[1])
    asyncio.get_running_loop().call_later(0.05, os.kill, os.getpid(), signal.SIGKILL)
    await conn.send(bytearray(512 << 20))
asyncio.run(main())
"""


def test_a_receive_from_a_sender_killed_mid_message_ends():
    """UCX never fails a receive whose rendezvous sender died; the bootstrap connection's end
    does (ucx.LAST_MESSAGES_S later), so a decoder's reader is never stuck."""
    from kvtransfer.ucx import UcxTransport

    async def main():
        rx, got = UcxTransport("127.0.0.1", 0), asyncio.Queue()
        port = await _serve_one(rx, got)
        p = await asyncio.create_subprocess_exec(sys.executable, "-c", SENDER, f"ucx://127.0.0.1:{port}",
                                                 stderr=subprocess.DEVNULL, cwd=ROOT)
        assert await asyncio.wait_for(p.wait(), 30) == -9
        assert isinstance(await asyncio.wait_for(got.get(), 15), ConnectionClosed)
        await rx.close()
    asyncio.run(asyncio.wait_for(main(), 90))


def test_a_closed_senders_last_messages_arrive_then_the_receive_ends_at_once(monkeypatch):
    """A sender that sends and closes at once: every message it sent (small ones, eager, and a
    large one, rendezvous) arrives, then the next receive ends at once: its BYE said how many
    to expect, so no grace period is waited (LAST_MESSAGES_S is an hour here)."""
    from kvtransfer import ucx
    monkeypatch.setattr(ucx, "LAST_MESSAGES_S", 3600.0)
    sizes = [64, 8 << 20, 64, 4096]

    async def main():
        rx, tx, got = ucx.UcxTransport("127.0.0.1", 0), ucx.UcxTransport(), asyncio.Queue()

        async def handler(conn):
            try:
                for n in [*sizes, 64]:                   # one receive more than was sent
                    await got.put(bytes(await conn.recv(into=bytearray(n)))[:1])
            except ConnectionClosed as e:
                await got.put(e)
        conn = await tx.connect(await rx.listen(handler))
        for i, n in enumerate(sizes):
            await conn.send(bytearray([i + 1]) * n)
        await conn.close()
        for i in range(len(sizes)):
            assert await asyncio.wait_for(got.get(), 60) == bytes([i + 1])
        assert isinstance(await asyncio.wait_for(got.get(), 60), ConnectionClosed)
        await tx.close()
        await rx.close()
    asyncio.run(asyncio.wait_for(main(), 120))
