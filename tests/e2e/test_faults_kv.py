"""KV messages delayed, truncated or corrupted on their way from a prefill worker's KVSender
to a decode worker's KVReceiver, a stalled or slow peer, and who is blamed when the decode
worker's KV endpoint cannot be reached.

The faults are injected by a man in the middle on the transport seam (`MitmTransport`: the
sender's connections pass each message through a `tamper` function), over the in-process
LoopbackTransport: no UCX and no subprocesses, so every case is quick and exact. The first
tests drive a sender/receiver pair; the last ones a whole prefill + decode + gateway system
(tests/unit/test_pd_inprocess.py's System) whose prefill worker sends through the man in the
middle. After each: nothing corrupt in the cache or the output, every KV block free.
"""
from __future__ import annotations

import asyncio
import uuid

import grpc
import pytest
import torch

from engine.sampling_params import SamplingParams
from gateway.request import GatewayError, GenerateInput
from kvtransfer import KVReceiver, KVSender, LoopbackTransport, TransferState, TransportError
from kvtransfer.transport import Connection, as_buffer
from kvtransfer.wire import HEADER_BYTES, Header, MsgType, WireError, ids_bytes
from protos.pdserve.v1 import common_pb2, decode_pb2, prefill_pb2
from tests.unit.test_kvtransfer_state import L, cache, key
from tests.unit.test_pd_inprocess import RPC_S, System, _dest, _greedy, _prompt, _rest

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(120)]


class Mitm(Connection):
    """A sender's connection through a man in the middle: each message goes through
    `transport.tamper(kind, data)` (kind "header" or "body" of a LAYER, else "other"), which
    returns the bytes to pass on (None: drop it) and may take its time."""

    def __init__(self, inner: Connection, transport: "MitmTransport"):
        self.inner, self.transport, self.peer = inner, transport, inner.peer
        self._body_next = False

    async def send(self, buffer) -> None:
        data = bytes(memoryview(as_buffer(buffer)).cast("B"))
        kind = "other"
        if self._body_next:
            kind, self._body_next = "body", False
        elif len(data) == HEADER_BYTES:
            try:
                h = Header.unpack(data)
            except WireError:
                h = None
            if h is not None and h.msg_type is MsgType.LAYER:
                kind, self._body_next = "header", h.body_bytes > 0
        out = await self.transport.tamper(kind, data)
        if out is not None:
            await self.inner.send(out)

    async def recv(self, nbytes=None, *, into=None):
        return await self.inner.recv(nbytes, into=into)

    async def close(self) -> None:
        await self.inner.close()

    @property
    def closed(self) -> bool:
        return self.inner.closed


async def _pass(kind: str, data: bytes) -> bytes:
    return data


class MitmTransport(LoopbackTransport):
    """LoopbackTransport whose outgoing connections go through a man in the middle;
    `refuse`: connect fails, as to an endpoint nothing listens on."""

    def __init__(self):
        super().__init__()
        self.tamper, self.refuse, self.connects = _pass, False, 0

    async def connect(self, address: str, timeout: float = 5.0) -> Connection:
        if self.refuse:
            raise TransportError(f"connection to {address} refused (test)")
        self.connects += 1
        return Mitm(await super().connect(address, timeout), self)

    async def cut_all(self) -> None:
        """Break every connection made so far (the sender drops them from its cache)."""
        for c in self._conns:
            await c.close()


def once(kind: str, change):
    """A tamper function: `change(data)` on the first message of `kind`, the rest passes."""
    done = False

    async def tamper(k: str, data: bytes):
        nonlocal done
        if k == kind and not done:
            done = True
            return change(data)
        return data
    return tamper


def flip_last_byte(data: bytes) -> bytes:         # inside the KV payload of a LAYER body
    return data[:-1] + bytes([data[-1] ^ 0x40])


def truncate(data: bytes) -> bytes:
    return data[:-64]


def bad_magic(data: bytes) -> bytes:
    return b"XDKV" + data[4:]


# -- a sender / receiver pair ------------------------------------------------------------------

async def pair(mitm: MitmTransport, expiry_s: float = 30.0, **sender_kw):
    dst, src = cache(), cache(1)
    rx = KVReceiver(dst, key(dst), LoopbackTransport(), expiry_s)
    addr = await rx.start()
    tx = KVSender(src, key(src), mitm, **sender_kw)
    return rx, tx, addr, src, dst


async def transfer(tx, rx, addr, tid, srcb, dstb, finish_s=5.0):
    rx.reserve(tid, dstb)
    h = await tx.open(tid, addr, srcb, dstb)
    for layer in range(L):
        await tx.push_layer(h, layer)
    return await tx.finish(h, finish_s)


def run(coro, timeout_s: float = 30):
    return asyncio.run(asyncio.wait_for(coro, timeout_s))


def test_corrupted_body_fails_its_transfer_and_is_never_written():
    """One flipped payload bit: the receiver's checksum catches it, the transfer FAILS
    (long before its deadline) and its blocks keep their old contents; the connection
    stays usable and the next transfer over it arrives exact."""
    async def main():
        mitm = MitmTransport()
        mitm.tamper = once("body", flip_last_byte)
        rx, tx, addr, src, dst = await pair(mitm)
        before = dst.clone()
        await transfer(tx, rx, addr, "t1", [7, 2, 9], [1, 5, 11])   # the sender cannot tell
        res = await rx.wait("t1", 5)
        assert res.state is TransferState.FAILED and "checksum" in res.reason
        assert torch.equal(dst, before), "a corrupted body reached the cache"
        await transfer(tx, rx, addr, "t2", [3, 4], [0, 6])
        assert (await rx.wait("t2", 5)).state is TransferState.DONE
        assert torch.equal(dst[:, :, [0, 6]], src[:, :, [3, 4]])
        assert mitm.connects == 1
        await tx.close(); await rx.close()
    run(main())


@pytest.mark.parametrize("kind,change", [("body", truncate), ("header", bad_magic)],
                         ids=["truncated-body", "bad-header"])
def test_malformed_message_drops_the_connection_and_fails_the_transfer_at_once(kind, change):
    """A truncated body (it no longer matches its header's size) or a header with bad magic
    on the transfer's second layer: the receiver drops the connection and fails the transfer
    it was feeding at once (not at its 30 s deadline), writing nothing of the bad message;
    the sender drops the connection from its cache and reconnects for the next transfer."""
    async def main():
        mitm = MitmTransport()
        seen = {"n": 0}

        async def second(k, data):
            if k == kind:
                seen["n"] += 1
                if seen["n"] == 2:
                    return change(data)
            return data
        mitm.tamper = second
        rx, tx, addr, src, dst = await pair(mitm)
        try:
            await transfer(tx, rx, addr, "t1", [7, 2], [1, 5])
        except TransportError:
            pass                        # or the sender notices while sending
        res = await rx.wait("t1", 5)
        assert res.state is TransferState.FAILED and "connection was dropped" in res.reason
        assert res.blocks_received == 2                        # layer 0 only
        for _ in range(200):
            if addr not in tx._peers:
                break
            await asyncio.sleep(0.01)
        assert addr not in tx._peers, "the sender kept the broken connection"
        mitm.tamper = _pass
        await transfer(tx, rx, addr, "t2", [3, 4], [0, 6])
        assert (await rx.wait("t2", 5)).state is TransferState.DONE
        assert torch.equal(dst[:, :, [0, 6]], src[:, :, [3, 4]])
        assert mitm.connects == 2
        await tx.close(); await rx.close()
    run(main())


def test_delayed_messages_arrive_intact():
    async def main():
        mitm = MitmTransport()

        async def slow(k, data):
            await asyncio.sleep(0.05)
            return data
        mitm.tamper = slow
        rx, tx, addr, src, dst = await pair(mitm)
        await transfer(tx, rx, addr, "t1", [7, 2, 9], [1, 5, 11])
        assert (await rx.wait("t1", 5)).state is TransferState.DONE
        assert torch.equal(dst[:, :, [1, 5, 11]], src[:, :, [7, 2, 9]])
        await tx.close(); await rx.close()
    run(main())


def test_a_send_that_never_completes_times_out_and_the_peer_is_dropped():
    """A peer that stops taking messages (a stalled decode worker): the send times out
    after send_timeout_s, the transfer fails, the connection leaves the sender's cache and
    the next transfer opens a new one."""
    async def main():
        mitm = MitmTransport()

        async def black_hole(k, data):
            if k == "body":
                await asyncio.Event().wait()
            return data
        mitm.tamper = black_hole
        rx, tx, addr, src, dst = await pair(mitm, send_timeout_s=0.3)
        t0 = asyncio.get_running_loop().time()
        with pytest.raises(TransportError, match="not done after 0.3s"):
            await transfer(tx, rx, addr, "t1", [7, 2], [1, 5], finish_s=10)
        assert asyncio.get_running_loop().time() - t0 < 5
        assert addr not in tx._peers
        rx.abort("t1")
        mitm.tamper = _pass
        await transfer(tx, rx, addr, "t2", [3, 4], [0, 6])
        assert (await rx.wait("t2", 5)).state is TransferState.DONE
        assert mitm.connects == 2
        await tx.close(); await rx.close()
    run(main())


def test_the_send_queue_is_bounded_in_bytes():
    """A peer not keeping up: messages beyond max_queued_bytes fail at once (and so their
    transfer) instead of piling up staging buffers."""
    async def main():
        mitm = MitmTransport()
        release = asyncio.Event()

        async def held(k, data):
            if k == "body":
                await release.wait()
            return data
        mitm.tamper = held
        one_block = ids_bytes(1) + cache().shape[3] * cache().shape[4] * cache().shape[5] * 2 * 2
        rx, tx, addr, src, dst = await pair(mitm, max_inflight=1, max_queued_bytes=2 * one_block)
        rx.reserve("t1", list(range(8)))
        h = await tx.open("t1", addr, list(range(8)), list(range(8)))
        futs = [tx.push_layer_threadsafe(h, layer, b, b + 1) for layer in range(L) for b in range(8)]
        await asyncio.sleep(0.1)
        full = [f for f in futs if f.done() and f.exception() is not None]
        assert full and "queue" in str(full[0].exception())
        assert tx._peers[addr].queued_bytes <= 2 * one_block
        release.set()
        with pytest.raises(TransportError, match="full"):
            await tx.finish(h, 5)
        rx.abort("t1")
        await tx.close(); await rx.close()
    run(main())


# -- a whole system: gateway, prefill worker (through the man in the middle), decode worker ---

@pytest.fixture(scope="module")
def mitm():
    return MitmTransport()


@pytest.fixture(scope="module")
def system(model_dir, mitm):
    with System.started(model_dir, prefill_transport=mitm) as s:
        yield s


@pytest.fixture(scope="module")
def model_dir():
    from engine.tiny_model import ensure_default_model
    return str(ensure_default_model())


@pytest.fixture(scope="module")
def offline(model_dir):
    from engine.offline import LLM
    from tests.unit.test_pd_inprocess import BS
    llm = LLM(model_dir, block_size=BS, num_blocks=64)

    def ref(prompt, n):
        return llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=n,
                                                     ignore_eos=True))[0].token_ids
    return ref


async def _generate(system, prompt, n):
    tokens = []
    inp = GenerateInput("kvf-" + uuid.uuid4().hex, prompt,
                        SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True))
    async for ev in system.gateway.generate(inp):
        tokens += ev.token_ids
    return tokens


async def _healthy_again(system, within: float = 10.0) -> None:
    async def poll():
        while not all(w.healthy for p in (system.gateway.prefill, system.gateway.decode)
                      for w in p.workers.values()):
            await asyncio.sleep(0.05)
    await asyncio.wait_for(poll(), within)


def test_corrupted_kv_through_the_gateway_fails_cleanly(system, mitm, offline):
    """The decode worker's default policy (fail): the request ends with an error naming the
    checksum, not with tokens computed from corrupt KV; every block is freed, and the next
    request is served exactly."""
    prompt, n = _prompt(40, 5), 12

    async def main():
        mitm.tamper = once("body", flip_last_byte)
        with pytest.raises(GatewayError) as e:
            await _generate(system, prompt, n)
        assert e.value.code == grpc.StatusCode.INTERNAL and "checksum" in e.value.message
        await system.wait_all_free()
        assert await _generate(system, prompt, n) == offline(prompt, n)
        await system.wait_all_free()
    system.run(main())


def test_corrupted_kv_with_policy_recompute_gives_the_exact_tokens(system, mitm, offline):
    """Policy recompute: the decode worker drops the corrupt transfer and computes the prompt
    itself; the stream equals the offline engine's greedy tokens."""
    prompt, n = _prompt(40, 6), 12
    ref = offline(prompt, n)

    async def main():
        mitm.tamper = once("body", flip_last_byte)
        rid = "kvf-" + uuid.uuid4().hex
        stream = system.dec.Decode(decode_pb2.DecodeRequest(
            request_id=rid, prompt_token_ids=prompt, sampling=_greedy(n),
            kv_failure_policy=decode_pb2.KV_FAILURE_POLICY_RECOMPUTE), timeout=RPC_S)
        kv = (await asyncio.wait_for(stream.read(), RPC_S)).kv_ready
        resp = await system.pre.Prefill(prefill_pb2.PrefillRequest(
            request_id=rid, prompt_token_ids=prompt, sampling=_greedy(n), destination=_dest(kv)),
            timeout=RPC_S)
        assert (await system.dec.SubmitFirstToken(decode_pb2.SubmitFirstTokenRequest(
            request_id=rid, first_token=resp.first_token), timeout=RPC_S)).accepted
        tokens = [resp.first_token.token_id]
        msgs = await _rest(stream)
        for m in msgs:
            tokens += [t.token_id for t in m.tokens.tokens]
        assert tokens == ref
        assert msgs[-1].tokens.finish_reason == common_pb2.FINISH_REASON_LENGTH
        st = await system.dec.Stats(common_pb2.StatsRequest(), timeout=RPC_S)
        assert st.transfers.failures >= 1
        await system.wait_all_free()
    system.run(main())


def test_unreachable_kv_endpoint_is_blamed_on_the_decode_worker(system, mitm, offline,
                                                                 monkeypatch):
    """The prefill worker cannot connect to the decode worker's KV endpoint: the gateway
    holds the decode worker out of routing (its KV endpoint is at fault) for KV_FAULT_HOLD_S,
    though its probes pass, and not the prefill worker; with no other decode worker the
    request fails UNAVAILABLE; blocks are freed and, after the hold, with the endpoint back,
    the next request is served."""
    from gateway import segment
    monkeypatch.setattr(segment, "KV_FAULT_HOLD_S", 2.0)
    prompt, n = _prompt(40, 7), 6

    async def main():
        mitm.tamper = _pass
        await mitm.cut_all()                   # the cached connection breaks: reconnect next time
        await asyncio.sleep(0.1)
        mitm.refuse = True
        try:
            with pytest.raises(GatewayError) as e:
                await _generate(system, prompt, n)
            assert e.value.code == grpc.StatusCode.UNAVAILABLE, e.value
            (d,), (p,) = system.gateway.decode.workers.values(), system.gateway.prefill.workers.values()
            assert not d.healthy and "KV endpoint" in d.last_error
            assert p.healthy, f"the prefill worker was blamed: {p.last_error}"
            await system.wait_all_free()
            await asyncio.sleep(1.0)                     # two health intervals: probes pass
            assert not d.healthy, "a probe brought it back during its hold"
        finally:
            mitm.refuse = False
        await _healthy_again(system)
        assert await _generate(system, prompt, n) == offline(prompt, n)
        await system.wait_all_free()
    system.run(main())
