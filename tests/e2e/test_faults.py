"""Faults over real processes: workers killed, stopped, restarted under supervision.

After each fault every worker's KV pool must be back to full (checked through Stats), and
the system must keep serving; greedy outputs must equal the offline engine's.
"""
from __future__ import annotations

import asyncio
import os
import random
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import httpx
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from engine.sampling_params import SamplingParams
from protos.pdserve.v1 import common_pb2, generation_pb2_grpc
from tests.e2e.test_gateway import collect, gen_stub, prompts, request, stats
from tests.helpers import supervising, wait_until

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


@pytest.fixture(scope="module")
def llm(model_dir):
    from engine import LLM
    return LLM(model_dir)


@pytest.fixture(scope="module")
def supervised(start_system):
    """2 prefill + 2 decode workers and a gateway, supervised as `pdserve up` does."""
    from pdserve.launcher import free_port
    launcher = start_system(2, 2, gateway_args=["--health-interval-s", "0.5"],
                            restart_backoff_s=0.5, http_port=free_port())
    with supervising(launcher):
        yield launcher


def pools_full(launcher, timeout_s: float = 5.0) -> None:
    """Every live worker's KV pool back to full, nothing running or waiting."""
    def idle():
        s = {**stats(launcher, "prefill"), **stats(launcher, "decode")}
        busy = {a: (x.free_kv_blocks, x.total_kv_blocks, x.num_running, x.num_waiting)
                for a, x in s.items()
                if x.free_kv_blocks != x.total_kv_blocks or x.num_running or x.num_waiting}
        return not busy, busy
    wait_until(idle, timeout_s, "every worker's KV pool full again")


def serving_within(address: str, timeout_s: float) -> bool:
    try:
        with grpc.insecure_channel(address) as ch:
            r = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(),
                                                      timeout=timeout_s)
            return r.status == health_pb2.HealthCheckResponse.SERVING
    except grpc.RpcError:
        return False


def serving(address: str) -> bool:
    return serving_within(address, 1.0)


def fallbacks(launcher, kind: str, text: str | None = None) -> float:
    """The gateway's count of KV fallbacks of `kind` (migrate, retry): from its /metrics,
    or from `text` (metrics in the text format)."""
    from prometheus_client.parser import text_string_to_metric_families
    if text is None:
        text = httpx.get(f"http://127.0.0.1:{launcher.http_port}/metrics", timeout=10).text
    return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples
               if s.name.endswith("kv_transfer_fallbacks_total") and s.labels.get("kind") == kind)


def stream(stub, ids, n_tokens: int, started: threading.Event, timeout_s: float = 120):
    """One greedy stream of n_tokens; `started` is set after its third token.
    -> (tokens, last message)."""
    got = []
    for msg in stub.Generate(request(ids, n_tokens, ignore_eos=True), timeout=timeout_s):
        got += list(msg.token_ids)
        if len(got) >= 3:
            started.set()
        last = msg
    return got, last


def greedy(llm, ps, n_tokens: int) -> list[list[int]]:
    """The engine's greedy continuations of `ps`, n_tokens each (EOS ignored): what every
    stream must equal, however a fault was handled."""
    return [o.token_ids for o in llm.generate(ps, SamplingParams(
        temperature=0.0, max_tokens=n_tokens, ignore_eos=True))]


def child(supervised, role: str, address: str):
    """The launcher's child process of the `role` worker at `address`."""
    return next(c for c in supervised.workers(role) if c.address == address)


def test_sigkill_decode_under_supervision(supervised, llm):
    """SIGKILL the busier decode worker mid-stream: every stream migrates or completes with
    the engine's greedy tokens, the supervisor restarts the worker, and the gateway routes
    to it again within a few health intervals of it serving."""
    ps, n_tokens = prompts(llm, 6), 120
    want = greedy(llm, ps, n_tokens)
    stub = gen_stub(supervised.grpc_address)
    started = [threading.Event() for _ in ps]
    with ThreadPoolExecutor(len(ps)) as pool:
        futs = [pool.submit(stream, stub, ps[i], n_tokens, started[i]) for i in range(len(ps))]
        for e in started:
            assert e.wait(60), "a stream did not start"
        running = stats(supervised, "decode")
        victim_addr = max(running, key=lambda a: running[a].num_running)
        victim = child(supervised, "decode", victim_addr)
        os.kill(victim.pid, signal.SIGKILL)
        t_kill = time.monotonic()
        results = [f.result(timeout=120) for f in futs]
    for i, ((got, last), ref) in enumerate(zip(results, want)):
        assert got == ref, f"stream {i} diverged from the engine's greedy output"
        assert last.finish_reason == common_pb2.FINISH_REASON_LENGTH
    wait_until(lambda: (victim.restarts == 1 and serving(victim_addr), victim.restarts), 90,
               "the killed decode worker restarted and SERVING")
    t_back = time.monotonic()
    served_before = stats(supervised, "decode")[victim_addr].transfers.transfers_done

    def used_again():
        collect(stub, request(ps[0], 2, ignore_eos=True), timeout=30)
        n = stats(supervised, "decode")[victim_addr].transfers.transfers_done
        return n > served_before, n
    wait_until(used_again, 10, "the gateway routing to the restarted worker")
    assert time.monotonic() - t_back < 10
    assert time.monotonic() - t_kill < 120
    assert all(c.popen.poll() is None for c in supervised.children)
    pools_full(supervised)


def test_sigstop_decode_streams_migrate(supervised, llm):
    """SIGSTOP the busier decode worker mid-stream and keep it stopped: once its probes go
    unanswered for --stall-timeout-s the gateway cuts its streams and migrates them, so
    every stream completes with the engine's greedy tokens while it is still stopped. After
    SIGCONT the stopped worker frees the blocks of the streams it lost and serves again."""
    ps = prompts(llm, 6)
    # streams long enough to outlast the pick of the victim, sized from the engine's speed
    # (400 tokens took ~0.1 s on the tiny model once the CPU step got fast, and a run found
    # every stream done before the pick): about 4 s of the offline engine's decode
    t0 = time.monotonic()
    greedy(llm, ps, 64)
    n_tokens = min(3000, max(400, int(4.0 * 64 / max(time.monotonic() - t0, 1e-3))))
    want = greedy(llm, ps, n_tokens)
    stub = gen_stub(supervised.grpc_address)
    started = [threading.Event() for _ in ps]
    with ThreadPoolExecutor(len(ps)) as pool:
        futs = [pool.submit(stream, stub, ps[i], n_tokens, started[i]) for i in range(len(ps))]
        for e in started:
            assert e.wait(60), "a stream did not start"
        def busy():
            r = stats(supervised, "decode")
            return any(s.num_running for s in r.values()), r
        running = wait_until(busy, 10, "a stream on a decode worker")
        victim_addr = max(running, key=lambda a: running[a].num_running)
        victim = child(supervised, "decode", victim_addr)
        restarts, migrated = victim.restarts, fallbacks(supervised, "migrate")
        os.kill(victim.pid, signal.SIGSTOP)
        t_stop = time.monotonic()
        try:
            # Its streams can only finish by migrating; 20 s at least, as a stall would last.
            results = [f.result(timeout=110) for f in futs]
            time.sleep(max(0.0, 20 - (time.monotonic() - t_stop)))
            assert victim.popen.poll() is None and not serving_within(victim_addr, 1.0)
        finally:
            os.kill(victim.pid, signal.SIGCONT)
    for i, ((got, last), ref) in enumerate(zip(results, want)):
        assert got == ref, f"stream {i} diverged from the engine's greedy output"
        assert last.finish_reason == common_pb2.FINISH_REASON_LENGTH
    assert fallbacks(supervised, "migrate") - migrated >= 1, "no stream was migrated"
    wait_until(lambda: (serving(victim_addr), None), 30, "the resumed decode worker SERVING")
    pools_full(supervised, timeout_s=15.0)
    assert victim.restarts == restarts, "the stopped worker was restarted, not resumed"


def _long_prompt_burst(llm, seed: int, n_tokens: int = 4):
    """10 prompts of 1,200 random tokens, the engine's greedy continuations of them
    (n_tokens each), and n_tokens."""
    rng = random.Random(seed)
    ps = [[rng.randrange(3, 900) for _ in range(1200)] for _ in range(10)]
    want = greedy(llm, ps, n_tokens)
    return ps, want, n_tokens


def _busiest_prefill(supervised):
    """The launcher's child of the prefill worker holding the most requests, once one holds
    at least 2 (waited for up to 60 s)."""
    def queued():
        s = stats(supervised, "prefill")
        busy = {a: x.num_running + x.num_waiting for a, x in s.items()}
        return max(busy.values()) >= 2, busy
    busy = wait_until(queued, 60, "a prefill worker with queued work")
    address = max(busy, key=busy.get)
    return child(supervised, "prefill", address)


def test_sigkill_prefill_during_a_burst_of_long_prompts(supervised, llm):
    """SIGKILL the prefill worker with queued work while a burst of long prompts runs: every
    Prefill it held is retried on the other prefill worker, no request is lost and each
    equals the engine's greedy output; the supervisor restarts the killed worker."""
    ps, want, n_tokens = _long_prompt_burst(llm, seed=12)
    stub = gen_stub(supervised.grpc_address)
    retried = fallbacks(supervised, "retry")
    with ThreadPoolExecutor(len(ps)) as pool:
        futs = [pool.submit(collect, stub, request(ids, n_tokens, ignore_eos=True), 120)
                for ids in ps]
        victim = _busiest_prefill(supervised)
        victim_addr = victim.address
        restarts = victim.restarts
        os.kill(victim.pid, signal.SIGKILL)
        results = [f.result(timeout=120) for f in futs]
    for i, ((got, last), ref) in enumerate(zip(results, want)):
        assert got == ref, f"request {i} diverged from the engine's greedy output"
        assert last.finish_reason == common_pb2.FINISH_REASON_LENGTH
    assert fallbacks(supervised, "retry") - retried >= 1, "no Prefill was retried"
    wait_until(lambda: (victim.restarts == restarts + 1 and serving(victim_addr), victim.restarts),
               90, "the killed prefill worker restarted and SERVING")
    pools_full(supervised, timeout_s=10.0)


def test_sigstop_prefill_during_a_burst_is_retried_elsewhere(supervised, llm):
    """SIGSTOP the prefill worker with queued work during a burst of long prompts and keep
    it stopped: once its probes go unanswered for --stall-timeout-s the gateway cuts its
    Prefills and retries them on the other prefill worker, so every request completes with
    the engine's greedy output while it is still stopped. After SIGCONT it frees
    everything it held and serves again."""
    ps, want, n_tokens = _long_prompt_burst(llm, seed=13)
    stub = gen_stub(supervised.grpc_address)
    retried = fallbacks(supervised, "retry")
    with ThreadPoolExecutor(len(ps)) as pool:
        futs = [pool.submit(collect, stub, request(ids, n_tokens, ignore_eos=True), 120)
                for ids in ps]
        victim = _busiest_prefill(supervised)
        victim_addr = victim.address
        restarts = victim.restarts
        os.kill(victim.pid, signal.SIGSTOP)
        try:
            results = [f.result(timeout=110) for f in futs]   # only by a retry elsewhere
            assert victim.popen.poll() is None and not serving_within(victim_addr, 1.0)
        finally:
            os.kill(victim.pid, signal.SIGCONT)
    for i, ((got, last), ref) in enumerate(zip(results, want)):
        assert got == ref, f"request {i} diverged from the engine's greedy output"
        assert last.finish_reason == common_pb2.FINISH_REASON_LENGTH
    assert fallbacks(supervised, "retry") - retried >= 1, "no Prefill was retried"
    wait_until(lambda: (serving(victim_addr), None), 30, "the resumed prefill worker SERVING")
    pools_full(supervised, timeout_s=15.0)
    assert victim.restarts == restarts, "the stopped worker was restarted, not resumed"


def test_draining_decode_worker_removed_from_discovery_finishes_its_streams(supervised, llm,
                                                                          model_dir):
    """SIGTERM a decode worker (it drains: NOT_SERVING, refuses new work, finishes what it
    has) and remove it from a gateway's discovery while its streams run: the gateway keeps
    its channel, so they finish on it with the engine's greedy tokens (none cut, none
    migrated), and nothing new is routed to it."""
    from gateway.config import GatewayConfig
    from gateway.core import Gateway
    from gateway.request import GenerateInput

    ps, n_tokens = prompts(llm, 4), 80
    want = greedy(llm, ps, n_tokens)
    loop = asyncio.new_event_loop()
    th = threading.Thread(target=loop.run_forever, name="removal-gateway", daemon=True)
    th.start()

    def run(coro, timeout_s=60):
        return asyncio.run_coroutine_threadsafe(asyncio.wait_for(coro, timeout_s), loop).result()
    gw = Gateway(GatewayConfig(
        model=model_dir, health_interval_s=0.5,
        prefill=",".join(c.address for c in supervised.workers("prefill")),
        decode=",".join(c.address for c in supervised.workers("decode"))))
    run(gw.start())
    started = [threading.Event() for _ in ps]

    async def one(i):
        got, fin = [], None
        async for ev in gw.generate(GenerateInput(f"removal-{i}", ps[i], SamplingParams(
                temperature=0.0, max_tokens=n_tokens, ignore_eos=True))):
            got += ev.token_ids
            fin = ev.finish_reason or fin
            if len(got) >= 3:
                started[i].set()
        return got, fin

    try:
        futs = [asyncio.run_coroutine_threadsafe(one(i), loop) for i in range(len(ps))]
        for e in started:
            assert e.wait(60), "a stream did not start"
        running = stats(supervised, "decode")
        victim_addr = max(running, key=lambda a: running[a].num_running)
        assert running[victim_addr].num_running, "no stream on a decode worker"
        victim = child(supervised, "decode", victim_addr)
        restarts, w = victim.restarts, gw.decode.workers[victim_addr]
        os.kill(victim.pid, signal.SIGTERM)
        run(gw.decode.on_change([], [victim_addr]))
        assert victim_addr not in gw.decode.workers and w.in_flight
        results = [f.result(timeout=120) for f in futs]
        for i, ((got, fin), ref) in enumerate(zip(results, want)):
            assert got == ref and fin == "length", f"stream {i} did not finish as the engine's"
        assert not w.streams and w.in_flight == 0
        from prometheus_client import generate_latest
        assert fallbacks(None, "migrate", generate_latest(gw.metrics.registry).decode()) == 0
    finally:
        run(gw.stop())
        loop.call_soon_threadsafe(loop.stop)
        th.join(10)
    wait_until(lambda: (victim.restarts == restarts + 1 and serving(victim_addr), victim.restarts),
               90, "the drained decode worker back (supervisor) and SERVING")
    pools_full(supervised, timeout_s=10.0)


def _gateway_process(launcher, model_dir, log_path, *args) -> tuple[subprocess.Popen, str]:
    """A gateway process of its own over the launcher's workers, SERVING."""
    from pdserve.launcher import free_port
    address = f"127.0.0.1:{free_port()}"
    with open(log_path, "ab") as log:
        proc = subprocess.Popen([
            sys.executable, "-m", "pdserve.cli", "gateway", "--model", model_dir, "--host",
            "127.0.0.1", "--grpc-port", address.rsplit(":", 1)[1], "--health-interval-s", "0.5",
            "--prefill", ",".join(c.address for c in launcher.workers("prefill")),
            "--decode", ",".join(c.address for c in launcher.workers("decode")), *args],
            stdout=log, stderr=subprocess.STDOUT, env=dict(os.environ, OMP_NUM_THREADS="1"))
    try:
        wait_until(lambda: (serving(address), proc.poll()), 60, "the gateway process SERVING")
    except BaseException:
        proc.kill()
        proc.wait(10)
        raise
    return proc, address


@pytest.mark.parametrize("drain_s,n_tokens", [(120, 2000), (1, 4000)], ids=["drained", "cut"])
def test_gateway_drains_on_sigterm(supervised, llm, model_dir, tmp_path, drain_s, n_tokens):
    """SIGTERM a gateway process with streams in flight: it stops serving at once (health,
    new requests refused) and exits once its streams are done (drained: each equals the
    engine's greedy output), or after --drain-timeout-s (cut: each ends with an error, never
    silently); either way every worker's KV pool is full afterwards."""
    ps = prompts(llm, 3)
    proc, address = _gateway_process(supervised, model_dir, tmp_path / "gateway.log",
                                     "--drain-timeout-s", str(drain_s))
    try:
        stub = gen_stub(address)
        started = [threading.Event() for _ in ps]
        with ThreadPoolExecutor(len(ps)) as pool:
            futs = [pool.submit(stream, stub, ps[i], n_tokens, started[i]) for i in range(len(ps))]
            for e in started:
                assert e.wait(60), "a stream did not start"
            proc.send_signal(signal.SIGTERM)
            t_term = time.monotonic()
            wait_until(lambda: (not serving(address), None), 5, "the gateway not SERVING")
            # a new client (its own connection: channels share subchannels by default)
            with grpc.insecure_channel(address, [("grpc.use_local_subchannel_pool", 1)]) as ch, \
                    pytest.raises(grpc.RpcError) as refused:
                collect(generation_pb2_grpc.GenerationStub(ch), request(ps[0], 2), timeout=10)
            assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
            outcomes = []
            for f in futs:
                try:
                    outcomes.append(f.result(timeout=drain_s + 60))
                except grpc.RpcError as e:
                    outcomes.append(e.code())
        rc = proc.wait(drain_s + 30)
        took = time.monotonic() - t_term
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    assert rc == 0
    if drain_s > 1:
        want = greedy(llm, ps, n_tokens)
        assert [o[0] for o in outcomes] == want, "a drained stream did not finish as the engine's"
    else:
        assert all(isinstance(o, grpc.StatusCode) for o in outcomes), \
            "a stream outlived the drain timeout"
        assert took < drain_s + 20, f"exit {took:.1f}s after SIGTERM with --drain-timeout-s 1"
    pools_full(supervised, timeout_s=10.0)


def test_unstreamed_request_aborted_when_its_client_leaves(supervised):
    """A non-streaming request whose client disconnects (here: its read timeout, a quarter of
    the time the request needs at the rate a shorter one just ran) is aborted on both
    workers: every block is free within 2 s, long before it would have finished."""
    base = f"http://127.0.0.1:{supervised.http_port}"
    name = httpx.get(base + "/v1/models", timeout=10).json()["data"][0]["id"]
    body = {"model": name, "prompt": "The quick brown fox", "max_tokens": 400,
            "ignore_eos": True, "temperature": 0}
    t0 = time.monotonic()
    assert httpx.post(base + "/v1/completions", json=body, timeout=60).status_code == 200
    per_token = (time.monotonic() - t0) / 400
    body["max_tokens"] = 4000           # the tiny model's context: 4096
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(base + "/v1/completions", json=body,
                   timeout=httpx.Timeout(10, read=min(1.0, 4000 * per_token / 4)))
    t0 = time.monotonic()
    pools_full(supervised, timeout_s=2.0)
    assert time.monotonic() - t0 < 2.0


def _cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")   # utime + stime


def test_idle_processes_use_no_cpu(supervised):
    """After the faults above, with nothing running or waiting, no process spins: each uses
    under 10% of one core over an idle interval (a spinning one uses ~100%)."""
    pools_full(supervised)
    pids = {f"{c.role}@{c.address}": c.pid for c in supervised.children}
    before, t0 = {k: _cpu_seconds(p) for k, p in pids.items()}, time.monotonic()
    time.sleep(3.0)
    wall = time.monotonic() - t0
    used = {k: round(_cpu_seconds(p) - before[k], 3) for k, p in pids.items()}
    assert all(u < 0.1 * wall for u in used.values()), f"CPU seconds in {wall:.1f}s idle: {used}"
