"""The prefill worker's KV connector (prefill_worker.kv_push.KVPush) in a real engine with
chunked prefill, into a KVReceiver over the loopback and the UCX tcp transports: every chunk's
completed blocks arrive while the prompt is still being computed, in chunk order, and the
transfer is DONE (what the decode worker admits on) only after the final chunk; the sender's
staging buffers are reused, but never while a send still reads them."""
import asyncio

import pytest
import torch

from engine.llm_engine import LLMEngine
from engine.sampling_params import SamplingParams
from engine.tiny_model import ensure_default_model
from kvtransfer import CompatKey, KVReceiver, LoopbackTransport, TransferState
from kvtransfer.transport import Connection, Transport
from prefill_worker.kv_push import KVPush

pytestmark = pytest.mark.timeout(120)

BS, CHUNK, PROMPT = 8, 16, 61            # chunks end at tokens 16, 32, 48, 61
FIRST_BLOCK = 1                          # the decoder had the prompt's first block cached
DST = [20, 3, 7, 11, 30, 2, 9]           # its reservation for prompt blocks 1..7


def _ucx():
    from kvtransfer.ucx import UcxTransport
    return UcxTransport()


class _LateConnection(Connection):
    """Loopback whose send reads the buffer only a few loop turns after it was called, as
    UCX's zero-copy sends do: a buffer reused before the send completed corrupts the data."""

    def __init__(self, inner):
        self.inner, self.peer = inner, inner.peer

    async def send(self, buffer):
        for _ in range(10):
            await asyncio.sleep(0)
        await self.inner.send(buffer)

    async def recv(self, nbytes=None, *, into=None):
        return await self.inner.recv(nbytes, into=into)

    async def close(self):
        await self.inner.close()

    @property
    def closed(self):
        return self.inner.closed


class _LateLoopback(Transport):
    def __init__(self):
        self.inner = LoopbackTransport()

    async def listen(self, handler):
        return await self.inner.listen(handler)

    async def connect(self, address, timeout=5.0):
        return _LateConnection(await self.inner.connect(address, timeout))

    async def close(self):
        await self.inner.close()


async def _until(cond, what, timeout=20.0):
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout
    while not cond():
        if loop.time() > end:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.001)


async def _run(sender_transport, receiver_transport, drain_each_step: bool):
    push = KVPush(sender_transport)
    engine = LLMEngine.from_model_dir(str(ensure_default_model()), kv_connector=push, block_size=BS,
                                      num_blocks=32, max_num_batched_tokens=CHUNK)
    layers = engine.config.model.num_layers
    dst_cache = torch.zeros_like(engine.kv_cache)
    rx = KVReceiver(dst_cache, CompatKey.from_cache(dst_cache, engine.config.model.name),
                    receiver_transport, expiry_s=60)
    try:
        addr = await rx.start()
        rx.reserve("t1", DST, 60)
        p = await push.open("r1", "t1", addr, DST, FIRST_BLOCK)
        engine.add_request("r1", [(i * 37) % 500 + 3 for i in range(PROMPT)],
                           SamplingParams(temperature=0.0, max_tokens=1), prefill_only=True)
        ends = []
        while engine.has_unfinished_requests():
            engine.step()
            req = engine.requests["r1"]
            ends.append(req.num_computed_tokens)
            final = req.num_computed_tokens == PROMPT
            # blocks this prefill has completed so far, past the decoder's cached one
            done_blocks = len(DST) if final else req.num_computed_tokens // BS - FIRST_BLOCK
            if not drain_each_step:       # the previous step's sends complete, this one's do not
                for _ in range(6):
                    await asyncio.sleep(0)
                continue
            await _until(lambda: rx.blocks_received == layers * done_blocks,
                         f"{done_blocks} blocks x {layers} layers after the chunk ending at {ends[-1]}")
            if not final:
                assert rx.poll("t1").state is TransferState.RECEIVING
            src = engine.kv_cache[:, :, req.block_ids[FIRST_BLOCK:FIRST_BLOCK + done_blocks]]
            assert torch.equal(dst_cache[:, :, DST[:done_blocks]], src), f"after tokens {ends[-1]}"
        assert ends == [16, 32, 48, 61]
        stats = await push.finish(p, 20)
        res = await rx.wait("t1", 20)
        assert res.state is TransferState.DONE, res.reason
        assert stats.messages == layers * 4           # one message per layer per chunk
        blocks = engine.requests["r1"].block_ids[FIRST_BLOCK:]
        assert torch.equal(dst_cache[:, :, DST], engine.kv_cache[:, :, blocks])
        untouched = [b for b in range(dst_cache.shape[2]) if b not in DST]
        assert not dst_cache[:, :, untouched].any()
        return push.sender.pool
    finally:
        await push.close()
        await rx.close()


@pytest.mark.parametrize("transport", [LoopbackTransport, _ucx], ids=["loopback", "ucx-tcp"])
def test_every_chunk_arrives_as_it_completes(transport):
    asyncio.run(asyncio.wait_for(_run(transport(), transport(), drain_each_step=True), 90))


def test_staging_buffers_reused_but_never_in_flight():
    pool = asyncio.run(asyncio.wait_for(_run(_LateLoopback(), LoopbackTransport(),
                                             drain_each_step=False), 90))
    assert pool.in_use == 0
    assert pool.allocated < 4 * 4        # fewer buffers than the 16 messages: they were reused
