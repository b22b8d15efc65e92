"""KV blocks between two real processes on 127.0.0.1 over UCX (kvtransfer.ucx)."""
import asyncio
import multiprocessing as mp
import queue

import pytest
import torch

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(60)]

SHAPE = (4, 2, 64, 16, 8, 128)          # layers, K/V, blocks, block_size, kv heads, head_dim
SRC_BLOCKS = list(range(40, 8, -1))     # 32 blocks, reversed order on purpose
DST_BLOCKS = list(range(0, 64, 2))      # 32 blocks, every other one


def source_cache(shape=SHAPE, dtype=torch.bfloat16):
    g = torch.Generator().manual_seed(1234)
    return torch.randn(shape, generator=g).to(dtype)


def _receiver_main(to_parent, from_parent):
    """Child process: a KVReceiver with a zeroed cache; reports what arrived."""
    import os
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    from kvtransfer import CompatKey, KVReceiver
    from kvtransfer.ucx import UcxTransport

    async def main():
        cache = torch.zeros(SHAPE, dtype=torch.bfloat16)
        rx = KVReceiver(cache, CompatKey.from_cache(cache, "tiny-llama"), UcxTransport(), expiry_s=20)
        to_parent.put(await rx.start())
        rx.reserve("e2e-1", DST_BLOCKS)
        res = await rx.wait("e2e-1", 30)
        src = source_cache()
        exact = all(torch.equal(cache[:, :, d], src[:, :, s]) for s, d in zip(SRC_BLOCKS, DST_BLOCKS))
        untouched = bool((cache[:, :, [b for b in range(SHAPE[2]) if b not in DST_BLOCKS]] == 0).all())
        to_parent.put({"state": res.state.value, "reason": res.reason, "exact": exact,
                       "untouched": untouched})
        await asyncio.to_thread(from_parent.get, True, 30)   # wait for "stop"
        to_parent.put(rx.counters())
        await rx.close()

    asyncio.run(main())


@pytest.fixture(scope="module")
def receiver():
    ctx = mp.get_context("spawn")
    to_parent, from_parent = ctx.Queue(), ctx.Queue()
    proc = ctx.Process(target=_receiver_main, args=(to_parent, from_parent), daemon=True)
    proc.start()
    try:
        addr = to_parent.get(timeout=30)
        yield addr, to_parent, from_parent
    finally:
        from_parent.put("stop")
        proc.join(10)
        if proc.is_alive():
            proc.kill()
            proc.join(5)


def test_blocks_arrive_exactly_over_ucx(receiver):
    from kvtransfer import CompatKey, KVSender
    from kvtransfer.ucx import UcxTransport
    addr, to_parent, _ = receiver
    assert addr.startswith("ucx://127.0.0.1:")

    async def push():
        src = source_cache()
        tx = KVSender(src, CompatKey.from_cache(src, "tiny-llama"), UcxTransport())
        try:
            h = await tx.open("e2e-1", addr, SRC_BLOCKS, DST_BLOCKS)
            for layer in range(SHAPE[0]):          # as the engine's per-layer hook would
                await asyncio.to_thread(tx.push_layer_threadsafe, h, layer)
            return await tx.finish(h, 20)
        finally:
            await tx.close()

    stats = asyncio.run(push())
    assert stats.messages == SHAPE[0] and stats.blocks_sent == SHAPE[0] * len(DST_BLOCKS)
    report = to_parent.get(timeout=30)
    assert report == {"state": "done", "reason": "", "exact": True, "untouched": True}


def test_compat_mismatch_over_ucx(receiver):
    from kvtransfer import CompatKey, IncompatibleKV, KVSender
    from kvtransfer.ucx import UcxTransport
    addr, to_parent, from_parent = receiver
    wrong = torch.zeros(SHAPE[0], 2, 8, 32, 8, 128, dtype=torch.float16)

    async def connect():
        tx = KVSender(wrong, CompatKey.from_cache(wrong, "tiny-llama"), UcxTransport())
        try:
            with pytest.raises(IncompatibleKV) as e:
                await tx.open("e2e-2", addr, [0], [0])
            return str(e.value)
        finally:
            await tx.close()

    msg = asyncio.run(connect())
    assert "block_size: decode=16 prefill=32" in msg
    assert "dtype: decode='bfloat16' prefill='float16'" in msg
    from_parent.put("stop")
    try:
        counters = to_parent.get(timeout=30)
    except queue.Empty:
        pytest.fail("receiver process did not report its counters")
    assert counters["rejected_connections"] == 1 and counters["transfers_done"] == 1
    assert counters["blocks_received"] == SHAPE[0] * len(DST_BLOCKS)


def test_unreachable_endpoint_is_a_clear_error():
    from kvtransfer import CompatKey, KVSender, TransportError
    from kvtransfer.ucx import UcxTransport
    import socket
    with socket.socket() as s:              # a free port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    src = torch.zeros(1, 2, 2, 4, 1, 8)

    async def connect():
        tx = KVSender(src, CompatKey.from_cache(src, "m"), UcxTransport(), connect_timeout_s=3)
        try:
            with pytest.raises(TransportError, match=f"127.0.0.1:{port}"):
                await tx.open("x", f"ucx://127.0.0.1:{port}", [0], [0])
        finally:
            await tx.close()
    asyncio.run(connect())
