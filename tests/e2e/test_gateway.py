"""The gateway end to end: real prefill/decode worker processes, KV over UCX on loopback.

Greedy outputs through gateway -> P -> UCX -> D must equal engine.LLM's on the same model;
routing must use every worker; prefix affinity must shrink transfers; cancel and worker
death must free everything and fail (or migrate) loudly and quickly.
"""
from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from engine.sampling_params import SamplingParams
from protos.pdserve.v1 import (common_pb2, decode_pb2_grpc, generation_pb2, generation_pb2_grpc,
                               prefill_pb2_grpc)
from tests.helpers import wait_until

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

TEXTS = [
    "The city council voted to build a new park with trees, benches, and a playground.",
    "Light travels faster than sound, which is why we see lightning before we hear thunder.",
    "def add(a, b): return a + b  # a small example of Python code with a comment",
    "Good morning! How are you today? I am fine, thank you, and I hope you are well too.",
    "Prefill computes the prompt; decode produces new tokens; transfer moves the cache.",
    "It was the best of times, it was the worst of times, it was the age of wisdom.",
    "Rain fell softly on the roof, and the whole family gathered in the kitchen.",
    "Travelers should carry a map, some water, a warm jacket, and a charged phone.",
]


# -- helpers ------------------------------------------------------------------------------

def gen_stub(address):
    return generation_pb2_grpc.GenerationStub(grpc.insecure_channel(address))


def stats(launcher, role):
    stub_cls = (prefill_pb2_grpc.PrefillWorkerStub if role == "prefill"
                else decode_pb2_grpc.DecodeWorkerStub)
    out = {}
    for c in launcher.workers(role):
        if c.popen.poll() is None:
            with grpc.insecure_channel(c.address) as ch:
                out[c.address] = stub_cls(ch).Stats(common_pb2.StatsRequest(), timeout=5)
    return out


def request(ids, max_tokens, **sampling):
    sampling.setdefault("temperature", 0.0)
    return generation_pb2.GenerateRequest(
        token_ids=common_pb2.TokenIds(ids=ids),
        sampling=common_pb2.SamplingParams(max_tokens=max_tokens, **sampling),
        stream_options=generation_pb2.StreamOptions(stream=True, include_usage=True))


def collect(stub, req, timeout=60):
    ids, last = [], None
    for msg in stub.Generate(req, timeout=timeout):
        ids += list(msg.token_ids)
        last = msg
    return ids, last


@pytest.fixture(scope="module")
def llm(model_dir):
    from engine import LLM
    return LLM(model_dir)


def prompts(llm, n):
    tok = llm.tokenizer
    out = []
    for i in range(n):
        ids = tok.encode(TEXTS[i % len(TEXTS)] + " " + TEXTS[(i * 3 + 1) % len(TEXTS)])
        out.append(ids[: 6 + (i * 7) % max(1, len(ids) - 6)])
    return out


# -- tests on a 2 prefill + 2 decode system --------------------------------------------------

def test_concurrent_greedy_matches_engine_and_uses_every_worker(system_2p2d, llm):
    before_p, before_d = stats(system_2p2d, "prefill"), stats(system_2p2d, "decode")
    ps = prompts(llm, 16)
    lens = [4 + (i * 5) % 29 for i in range(16)]
    want = llm.generate(ps, [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True)
                             for m in lens])
    stub = gen_stub(system_2p2d.grpc_address)
    with ThreadPoolExecutor(16) as pool:
        got = list(pool.map(lambda a: collect(stub, request(*a, ignore_eos=True)),
                            zip(ps, lens)))
    for i, ((ids, last), ref) in enumerate(zip(got, want)):
        assert ids == ref.token_ids, f"request {i}: gateway {ids} != engine {ref.token_ids}"
        assert last.finish_reason == common_pb2.FINISH_REASON_LENGTH
        assert last.usage.prompt_tokens == len(ps[i])
        assert last.usage.completion_tokens == lens[i]
    after_p, after_d = stats(system_2p2d, "prefill"), stats(system_2p2d, "decode")
    for before, after in ((before_p, after_p), (before_d, after_d)):
        used = {a: after[a].transfers.transfers_done - before[a].transfers.transfers_done
                for a in after}
        assert all(n > 0 for n in used.values()), f"a worker was never used: {used}"
        assert sum(used.values()) >= 16


def test_n_choices_stream_with_their_indices(system_2p2d, llm):
    """n=3 seeded sampling: three choices interleaved on one stream, each its own request,
    each reproducing the offline engine's tokens for its seed (seed + index)."""
    from engine import SamplingParams
    stub = gen_stub(system_2p2d.grpc_address)
    prompt = list(range(40, 60))
    req = request(prompt, 6, n=3, temperature=0.8, seed=11, ignore_eos=True)
    got, finished = {0: [], 1: [], 2: []}, set()
    for msg in stub.Generate(req, timeout=60):
        got[msg.index] += list(msg.token_ids)
        if msg.finish_reason:
            finished.add(msg.index)
    assert finished == {0, 1, 2}
    for i in range(3):
        ref = llm.generate([prompt], SamplingParams(max_tokens=6, temperature=0.8, seed=11 + i,
                                                    ignore_eos=True))[0]
        assert got[i] == ref.token_ids, f"choice {i}"


def test_text_prompt_and_stop_string(system_2p2d, llm):
    stub = gen_stub(system_2p2d.grpc_address)
    ids, last = collect(stub, request(llm.tokenizer.encode(TEXTS[0]), 24, ignore_eos=True))
    full = llm.tokenizer.decode(ids)
    # a stop string taken from the middle of the greedy text: cut there, decoder stopped
    mid = len(full) // 2
    stop = next(full[i:i + 3] for i in range(mid, len(full) - 3)
                if full[i:i + 3].strip() and "\ufffd" not in full[i:i + 3]
                and full.index(full[i:i + 3]) == i)     # its first occurrence
    req = request(llm.tokenizer.encode(TEXTS[0]), 24, ignore_eos=True, stop=[stop])
    msgs = list(stub.Generate(req, timeout=60))
    text = "".join(m.text for m in msgs)
    assert msgs[-1].finish_reason == common_pb2.FINISH_REASON_STOP
    assert msgs[-1].stop_reason == stop
    assert stop not in text and full.startswith(text)
    wait_until(lambda: (all(s.num_running == 0 for s in stats(system_2p2d, "decode").values()),
                        None), 2, "decoders idle after a stop string")


def test_shared_prefix_transfers_fewer_blocks(system_2p2d, llm):
    tok = llm.tokenizer
    base = tok.encode(" ".join(TEXTS[4:8]))[:96]
    other = tok.encode(" ".join(TEXTS[:2]))[:20]
    stub = gen_stub(system_2p2d.grpc_address)

    def blocks_for(ids):
        before = stats(system_2p2d, "decode")
        _, last = collect(stub, request(ids, 2))
        after = stats(system_2p2d, "decode")
        return sum(after[a].transfers.blocks - before[a].transfers.blocks for a in after), last

    first, _ = blocks_for(base)
    second, last = blocks_for(base[:80] + other)   # same first 5 blocks (block size 16)
    assert first >= 5
    assert second < first, f"shared prefix moved {second} blocks, the first prompt {first}"
    assert last.usage.cached_tokens >= 64


def test_shared_prefix_under_load_spreads_over_both_decode_workers(system_2p2d, llm):
    """Eight long streams at once, all with one 4-block prefix (a chat template's system
    prompt): affinity is a preference, so both decode workers serve some (the default
    --decode-affinity-slack 2 keeps them within a few of each other; before, all eight
    went to the affine one). Each output equals the engine's greedy one."""
    tok = llm.tokenizer
    base = tok.encode(" ".join(TEXTS))[:64]
    ps = [base + tok.encode(TEXTS[i])[:8] for i in range(8)]
    n_tokens = 96
    want = [o.token_ids for o in llm.generate(ps, SamplingParams(
        temperature=0.0, max_tokens=n_tokens, ignore_eos=True))]
    stub = gen_stub(system_2p2d.grpc_address)
    collect(stub, request(base + [7], 2))              # the prefix is now affine to one
    before = stats(system_2p2d, "decode")
    with ThreadPoolExecutor(len(ps)) as pool:
        got = list(pool.map(lambda ids: collect(stub, request(ids, n_tokens, ignore_eos=True)), ps))
    assert [ids for ids, _ in got] == want
    after = stats(system_2p2d, "decode")
    used = {a: after[a].transfers.transfers_done - before[a].transfers.transfers_done for a in after}
    assert sum(used.values()) == len(ps) and min(used.values()) >= 2, used


def test_cancel_frees_all_blocks_within_2s(system_2p2d, llm):
    stub = gen_stub(system_2p2d.grpc_address)
    call = stub.Generate(request(prompts(llm, 3)[2], 2000, ignore_eos=True), timeout=60)
    for i, _ in enumerate(call):
        if i == 3:
            break
    call.cancel()
    t0 = time.monotonic()

    def idle():
        s = {**stats(system_2p2d, "prefill"), **stats(system_2p2d, "decode")}
        busy = {a: (x.free_kv_blocks, x.total_kv_blocks, x.num_running, x.num_waiting)
                for a, x in s.items()
                if x.free_kv_blocks != x.total_kv_blocks or x.num_running or x.num_waiting}
        return not busy, busy
    wait_until(idle, 2.0, "no held blocks on any worker after cancel")
    assert time.monotonic() - t0 < 2.0


def test_decode_worker_killed_mid_stream(system_2p2d, llm, model_dir):
    """SIGKILL the decoder holding two streams: the gateway's stream migrates to the other
    decoder and completes (greedy tokens unchanged); a gateway with migration off gives its
    caller UNAVAILABLE quickly; new requests keep working on the remaining decoder."""
    from gateway.config import GatewayConfig
    from gateway.core import Gateway
    from gateway.request import GatewayError, GenerateInput

    prompt, n_tokens = prompts(llm, 6)[5], 300
    want = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=n_tokens,
                                                 ignore_eos=True))[0].token_ids
    stub = gen_stub(system_2p2d.grpc_address)
    call = stub.Generate(request(prompt, n_tokens, ignore_eos=True), timeout=90)
    got = list(next(call).token_ids)
    running = wait_until(lambda: (lambda s: (any(x.num_running for x in s.values()), s))(
        stats(system_2p2d, "decode")), 10, "the stream running on a decoder")
    victim_addr = next(a for a, x in running.items() if x.num_running)
    victim = next(c for c in system_2p2d.workers("decode") if c.address == victim_addr)
    prefill = ",".join(c.address for c in system_2p2d.workers("prefill"))

    async def no_migration_stream(started: threading.Event):
        gw = Gateway(GatewayConfig(model=model_dir, prefill=prefill,
                                   decode=victim_addr, migrate_on_decode_failure=False,
                                   request_timeout_s=30))
        await gw.start()
        try:
            n = 0
            async for ev in gw.generate(GenerateInput("no-migrate", prompt, SamplingParams(
                    temperature=0.0, max_tokens=n_tokens, ignore_eos=True))):
                n += len(ev.token_ids)
                if not started.is_set():
                    started.set()
            return None, n
        except GatewayError as e:
            return e, time.monotonic()
        finally:
            await gw.stop()

    started = threading.Event()
    result = {}
    th = threading.Thread(target=lambda: result.update(r=asyncio.run(no_migration_stream(started))))
    th.start()
    assert started.wait(30), "the no-migration stream did not start"
    for msg in call:                       # let the gateway stream make some progress
        got += list(msg.token_ids)
        if len(got) >= 10:
            break
    os.kill(victim.pid, signal.SIGKILL)
    t_kill = time.monotonic()
    for msg in call:
        got += list(msg.token_ids)
        last = msg
    assert got == want, "the migrated stream diverged from the engine's greedy output"
    assert last.finish_reason == common_pb2.FINISH_REASON_LENGTH
    th.join(30)
    assert not th.is_alive()
    err, when = result["r"]
    assert err is not None, "the no-migration caller got no error"
    assert err.code == grpc.StatusCode.UNAVAILABLE and "failed mid-stream" in err.message, err
    assert when - t_kill < 5, f"the error came {when - t_kill:.1f}s after the kill"
    # new requests go to the remaining decoder
    for ids in prompts(llm, 3):
        out, last = collect(stub, request(ids, 5, ignore_eos=True), timeout=30)
        assert len(out) == 5 and last.finish_reason == common_pb2.FINISH_REASON_LENGTH


# -- no workers, in process -------------------------------------------------------------------

def test_no_workers_unavailable_quickly(model_dir):
    from gateway.config import GatewayConfig
    from gateway.grpc_server import serve
    from pdserve.launcher import free_port

    port = free_port()
    dead = ",".join(f"127.0.0.1:{free_port()}" for _ in range(2))

    async def main():
        ready, stop = asyncio.Event(), asyncio.Event()
        cfg = GatewayConfig(model=model_dir, grpc_port=port, prefill=dead, decode=dead)
        server = asyncio.create_task(serve(cfg, ready, stop))
        await asyncio.wait_for(ready.wait(), 30)
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
                stub = generation_pb2_grpc.GenerationStub(ch)
                t0 = time.monotonic()
                with pytest.raises(grpc.aio.AioRpcError) as e:
                    async for _ in stub.Generate(request([1, 2, 3], 4), timeout=30):
                        pass
                assert time.monotonic() - t0 < 2
                assert e.value.code() == grpc.StatusCode.UNAVAILABLE
                assert "no healthy" in e.value.details()
                models = await stub.ListModels(generation_pb2.ListModelsRequest(), timeout=5)
                assert models.models[0].max_model_len > 0
        finally:
            stop.set()
            await asyncio.wait_for(server, 30)
    asyncio.run(main())


def test_a_stop_while_waiting_for_workers_stops_at_once(model_dir):
    """--wait-for-workers-s 300 and workers that never answer (`pdserve up` interrupted while
    they load): a stop ends serve() within seconds, not after the wait (it took `pdserve up`
    35 s, its SIGKILL grace, to stop after a Ctrl-C during start-up)."""
    from gateway.config import GatewayConfig
    from gateway.grpc_server import serve
    from pdserve.launcher import free_port

    dead = f"127.0.0.1:{free_port()}"

    async def main():
        ready, stop = asyncio.Event(), asyncio.Event()
        port = free_port()
        cfg = GatewayConfig(model=model_dir, grpc_port=port, prefill=dead, decode=dead,
                            wait_for_workers_s=300)
        server = asyncio.create_task(serve(cfg, ready, stop))
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:   # listening, waiting
            await asyncio.wait_for(ch.channel_ready(), 30)
        stop.set()
        t0 = time.monotonic()
        await asyncio.wait_for(server, 30)
        assert time.monotonic() - t0 < 10 and not ready.is_set()
    asyncio.run(main())


# -- pdserve up --------------------------------------------------------------------------------

def _children(pid):
    out = []
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat") as f:
                    if int(f.read().rsplit(")", 1)[1].split()[1]) == pid:
                        out.append(int(d))
            except (OSError, ValueError, IndexError):
                pass
    return out


def test_pdserve_up_smoke(model_dir):
    from pdserve.launcher import free_port

    port, http_port = free_port(), free_port()
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.Popen([sys.executable, "-m", "pdserve.cli", "up", "--model", model_dir,
                             "--grpc-port", str(port), "--http-port", str(http_port)],
                            stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, env=env, text=True)
    try:
        lines = []
        reader = threading.Thread(target=lambda: lines.extend(iter(proc.stdout.readline, "")),
                                  daemon=True)
        reader.start()
        deadline = time.monotonic() + 120
        while not any(l.startswith("pdserve ready") for l in lines):
            assert proc.poll() is None, f"pdserve up exited: {lines}"
            assert time.monotonic() < deadline, "no ready line within 120s"
            time.sleep(0.1)
        ready = next(l for l in lines if l.startswith("pdserve ready"))
        assert f"grpc=127.0.0.1:{port}" in ready and f"http=http://127.0.0.1:{http_port}/v1" in ready
        import httpx
        models = httpx.get(f"http://127.0.0.1:{http_port}/v1/models", timeout=10).json()
        assert models["object"] == "list" and len(models["data"]) == 1
        children = _children(proc.pid)
        assert len(children) == 3, children
        ids, last = collect(gen_stub(f"127.0.0.1:{port}"), request([5, 6, 7, 8], 4,
                                                                   ignore_eos=True))
        assert len(ids) == 4 and last.finish_reason == common_pb2.FINISH_REASON_LENGTH
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
        for pid in children:
            assert not os.path.exists(f"/proc/{pid}"), f"child {pid} still running"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)


def test_kv_layout_mismatch_between_pools_is_a_clear_error(start_system):
    """A prefill pool whose KV layout differs from the decoders' (block size 16 vs 8):
    FAILED_PRECONDITION naming the layout, fast, and the gateway stays up."""
    launcher = start_system(1, 1, prefill_args=["--block-size", "16"],
                            decode_args=["--block-size", "8"])
    stub = gen_stub(launcher.grpc_address)
    t = time.monotonic()
    with pytest.raises(grpc.RpcError) as e:
        collect(stub, request(list(range(5, 40)), 4), timeout=30)
    assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION, e.value.details()
    assert "block_size" in e.value.details() or "blockSize" in e.value.details()
    assert time.monotonic() - t < 10
    models = stub.ListModels(generation_pb2.ListModelsRequest(), timeout=10)
    assert len(models.models) == 1
    for role in ("prefill", "decode"):
        assert all(c.popen.poll() is None for c in launcher.workers(role))
