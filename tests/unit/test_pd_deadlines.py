"""Deadlines that follow the work, over the real P/D path in one process (test_pd_inprocess's
System: both workers, the gateway, loopback KV). The prefill is slowed by a pause in its KV
connector after each layer (`slow`), so a prompt's compute outlasts the reservation's idle
window by construction, whatever this machine's speed; the window itself is sized from an
unslowed run of the same prompt, so a slow machine gets a longer one.

    keeps alive    layers every idle/4, 16 of them: the reservation outlives 4 idle windows
                   and the greedy tokens are the offline engine's
    control        one pause of 1.5 idle windows: both sides give up, the prefill stops
    abort          the client goes away mid-prefill: the prefill stops within a layer
    hard bound     a prompt the worker cannot compute before the bound: refused up front
    queued         a prompt queued behind a long one for 2+ idle windows keeps its
                   reservation by KEEPALIVEs and completes with the offline engine's tokens
"""
from __future__ import annotations

import asyncio
import threading
import time
import uuid

import grpc
import pytest

from engine.sampling_params import SamplingParams
from gateway.config import GatewayConfig
from gateway.core import Gateway
from gateway.request import GatewayError, GenerateInput
from prefill_worker.kv_push import KVPush
from protos.pdserve.v1 import common_pb2, decode_pb2, prefill_pb2

from .test_pd_inprocess import LAYERS, RPC_S, System, _dest, _greedy, _prompt, _rest
from .test_pd_inprocess import model_dir, offline  # noqa: F401  (fixtures)

pytestmark = pytest.mark.timeout(300)
CHUNK = 16                                  # System's prefill max_num_batched_tokens
PROMPT = 4 * CHUNK                          # 4 chunks x LAYERS layers pushed


@pytest.fixture(scope="module")
def system(model_dir):  # noqa: F811
    with System.started(model_dir) as s:
        yield s


class Slow:
    """Patches KVPush.save_kv_layer: `pause(layer)` seconds after each layer pushed, and
    a log of (time, request ids) per call, from the prefill worker's engine thread."""

    def __init__(self, monkeypatch, pause):
        self.pause, self.calls, self.lock = pause, [], threading.Lock()
        original = KVPush.save_kv_layer

        def save_kv_layer(push, layer, sched):
            original(push, layer, sched)
            with self.lock:
                self.calls.append((time.monotonic(), [s.request.request_id for s in sched.scheduled]))
            time.sleep(self.pause(layer, len(self.calls)))
        monkeypatch.setattr(KVPush, "save_kv_layer", save_kv_layer)

    def layers_of(self, rid, after=0.0) -> int:
        with self.lock:
            return sum(1 for t, ids in self.calls if t > after and any(i.startswith(rid) for i in ids))


async def _decode(system, rid, prompt, n, idle_s):
    stream = system.dec.Decode(decode_pb2.DecodeRequest(
        request_id=rid, prompt_token_ids=prompt, sampling=_greedy(n),
        kv_timeout_ms=int(idle_s * 1000), kv_failure_policy=decode_pb2.KV_FAILURE_POLICY_FAIL),
        timeout=RPC_S * 3)
    return stream, (await asyncio.wait_for(stream.read(), RPC_S)).kv_ready


async def _one(system, prompt, n, idle_s):
    """Decode -> Prefill -> SubmitFirstToken -> the stream: (tokens, last chunk, seconds
    from the reservation to the first token)."""
    rid = "dl-" + uuid.uuid4().hex
    stream, kv = await _decode(system, rid, prompt, n, idle_s)
    t0 = time.monotonic()
    resp = await system.pre.Prefill(prefill_pb2.PrefillRequest(
        request_id=rid, prompt_token_ids=prompt, sampling=_greedy(n), destination=_dest(kv)),
        timeout=RPC_S * 3)
    took = time.monotonic() - t0
    assert (await system.dec.SubmitFirstToken(decode_pb2.SubmitFirstTokenRequest(
        request_id=rid, first_token=resp.first_token), timeout=RPC_S)).accepted
    msgs = await _rest(stream)
    return [resp.first_token.token_id] + [t.token_id for m in msgs for t in m.tokens.tokens], msgs[-1].tokens, took


def _idle_window(system) -> float:
    """5x an unslowed prefill of a PROMPT-token prompt (at least 1 s)."""
    async def main():
        _, _, took = await _one(system, _prompt(PROMPT, 90), 2, 30.0)
        return took
    return max(1.0, 5 * system.run(main()))


async def _expirations(system):
    d = await system.dec.Stats(common_pb2.StatsRequest(), timeout=RPC_S)
    p = await system.pre.Stats(common_pb2.StatsRequest(), timeout=RPC_S)
    return d.transfers.expirations, p.transfers.expirations


def test_progress_keeps_a_reservation_alive_past_its_idle_window(system, offline, monkeypatch):  # noqa: F811
    idle = _idle_window(system)
    prompt, n = _prompt(PROMPT, 91), 6
    ref = offline(prompt, n)
    slow = Slow(monkeypatch, lambda layer, k: idle / 4)

    async def main():
        before = await _expirations(system)
        tokens, last, took = await _one(system, prompt, n, idle)
        assert tokens == ref.token_ids
        assert last.finish_reason == common_pb2.FINISH_REASON_LENGTH
        assert took > 3 * idle, f"the prefill took {took:.2f}s, the idle window is {idle:.2f}s"
        assert slow.layers_of("dl-") == 4 * LAYERS
        assert await _expirations(system) == before
        await system.wait_all_free()
    system.run(main(), 120)


def test_no_progress_for_the_idle_window_ends_it_on_both_sides(system, monkeypatch):
    """One pause of 1.5 idle windows after the first chunk's last layer: the decode worker
    expires the reservation (no progress), the prefill worker drops the call
    (DEADLINE_EXCEEDED) and computes no further chunk; every block comes back."""
    idle = _idle_window(system)
    slow = Slow(monkeypatch, lambda layer, k: 1.5 * idle if k == LAYERS else 0.0)

    async def main():
        before = await _expirations(system)
        rid = "stall-" + uuid.uuid4().hex
        prompt = _prompt(PROMPT, 92)
        stream, kv = await _decode(system, rid, prompt, 4, idle)
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await system.pre.Prefill(prefill_pb2.PrefillRequest(
                request_id=rid, prompt_token_ids=prompt, sampling=_greedy(4), destination=_dest(kv)),
                timeout=RPC_S * 3)
        assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED, e.value.details()
        assert "no progress" in e.value.details()
        msgs = await _rest(stream)
        assert msgs[-1].tokens.finish_reason == common_pb2.FINISH_REASON_ERROR
        assert "no progress" in msgs[-1].tokens.error
        assert slow.layers_of("stall-") <= LAYERS + 1       # the 2nd chunk stopped at its 1st layer
        after = await _expirations(system)
        assert after == (before[0] + 1, before[1] + 1)
        await system.wait_all_free()
    system.run(main(), 120)


def test_a_client_gone_mid_prefill_stops_the_prefill_within_a_layer(system, monkeypatch):
    """Through the gateway: the caller cancels while the prefill computes its second chunk;
    at most one more layer runs, then every block is back on both workers."""
    pause = 0.2
    slow = Slow(monkeypatch, lambda layer, k: pause)
    prompt = _prompt(8 * CHUNK, 93)

    async def main():
        inp = GenerateInput("gone-" + uuid.uuid4().hex, prompt,
                            SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))

        async def consume():
            async for _ in system.gateway.generate(inp):
                pass
        task = asyncio.ensure_future(consume())
        while slow.layers_of("gone-") < LAYERS + 1:       # into the second chunk
            await asyncio.sleep(0.01)
        t_cancel = time.monotonic()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await system.wait_all_free(within=10.0)
        freed = time.monotonic() - t_cancel
        assert slow.layers_of("gone-", after=t_cancel) <= 1, "more than one layer after the cancel"
        print(f"blocks freed {freed:.2f}s after the cancel (one layer: {pause}s)")
    system.run(main(), 120)


def test_a_prompt_that_cannot_finish_within_the_bound_is_refused_before_any_compute(system, monkeypatch):
    """The worker has measured itself (one slowed prompt, 4 chunks x LAYERS pauses), and is
    busy with another; a Prefill whose reservation's bound ends before the estimate says
    the prompt could be computed is refused with RESOURCE_EXHAUSTED, and its prompt never
    enters the engine."""
    pause = 0.05
    slow = Slow(monkeypatch, lambda layer, k: pause)

    async def main():
        await _one(system, _prompt(PROMPT, 94), 2, 30.0)     # measured: >= 16 pauses
        busy_rid = "busy-" + uuid.uuid4().hex
        busy_stream, busy_kv = await _decode(system, busy_rid, _prompt(PROMPT * 2, 95), 2, 30.0)
        busy = asyncio.ensure_future(system.pre.Prefill(prefill_pb2.PrefillRequest(
            request_id=busy_rid, prompt_token_ids=_prompt(PROMPT * 2, 95), sampling=_greedy(2),
            destination=_dest(busy_kv)), timeout=RPC_S * 3))
        while slow.layers_of("busy-") < 1:
            await asyncio.sleep(0.01)
        rid = "bound-" + uuid.uuid4().hex
        prompt = _prompt(PROMPT, 96)
        stream, kv = await _decode(system, rid, prompt, 2, 30.0)
        dest = _dest(kv)
        # a bound 4 pauses away: the same prompt took 16 pauses
        dest.max_expires_at_unix_ms = int((time.time() + 4 * pause) * 1000)
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await system.pre.Prefill(prefill_pb2.PrefillRequest(
                request_id=rid, prompt_token_ids=prompt, sampling=_greedy(2), destination=dest),
                timeout=RPC_S)
        assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, e.value.details()
        assert "in time" in e.value.details()
        assert slow.layers_of("bound-") == 0                  # no compute spent on it
        await system.dec.Abort(common_pb2.AbortRequest(request_id=rid), timeout=RPC_S)
        await _rest(stream)
        resp = await busy
        assert (await system.dec.SubmitFirstToken(decode_pb2.SubmitFirstTokenRequest(
            request_id=busy_rid, first_token=resp.first_token), timeout=RPC_S)).accepted
        await _rest(busy_stream)
        await system.wait_all_free()
    system.run(main(), 120)


def test_a_prompt_queued_past_its_idle_window_keeps_its_reservation(system, offline, monkeypatch):  # noqa: F811
    """Each step slowed to 1.5 idle windows (a step longer than the window, as a full token
    budget on a slow CPU): a 2-chunk prompt computes first; a 1-chunk one sent once its first
    layer was pushed waits, pushing nothing, for the step in progress (its add_request
    itself waits for it) and then the next, over 2 idle windows of its own reservation: its
    KEEPALIVEs (one per third of the window while the engine computes layers) hold it; no
    reservation expires and its greedy tokens are the offline engine's."""
    idle = _idle_window(system)
    slow = Slow(monkeypatch, lambda layer, k: 1.5 * idle / LAYERS)
    prompt, n = _prompt(CHUNK, 99), 4
    ref = offline(prompt, n)

    async def main():
        before = await _expirations(system)
        brid = "blocker-" + uuid.uuid4().hex
        bprompt = _prompt(2 * CHUNK, 100)
        bstream, bkv = await _decode(system, brid, bprompt, 2, 10 * idle)
        blocker = asyncio.ensure_future(system.pre.Prefill(prefill_pb2.PrefillRequest(
            request_id=brid, prompt_token_ids=bprompt, sampling=_greedy(2),
            destination=_dest(bkv)), timeout=RPC_S * 6))
        while slow.layers_of("blocker-") < 1:
            await asyncio.sleep(0.01)
        tokens, last, took = await _one(system, prompt, n, idle)
        assert tokens == ref.token_ids and last.finish_reason == common_pb2.FINISH_REASON_LENGTH
        assert took > 2 * idle, f"queued {took:.2f}s, the idle window is {idle:.2f}s"
        resp = await blocker
        assert (await system.dec.SubmitFirstToken(decode_pb2.SubmitFirstTokenRequest(
            request_id=brid, first_token=resp.first_token), timeout=RPC_S)).accepted
        await _rest(bstream)
        assert await _expirations(system) == before
        await system.wait_all_free()
    system.run(main(), 240)


def test_the_end_to_end_deadline_follows_the_tokens_asked_for(system, monkeypatch):
    """A gateway whose base deadline is shorter than a slowed prompt's prefill: with no
    per-token allowance the request gets DEADLINE_EXCEEDED; with one sized from the prompt,
    the same request completes. (request_timeout() itself: test_front_deadline.py.)"""
    pause = 0.05
    Slow(monkeypatch, lambda layer, k: pause)
    prompt = _prompt(PROMPT, 97)
    base = 2 * pause                         # the prefill takes >= 16 pauses

    async def run(per_token):
        gw = Gateway(GatewayConfig(model=system.model_dir, prefill=system.gateway.cfg.prefill,
                                   decode=system.gateway.cfg.decode, health_interval_s=0.5, disaggregation="always",
                                   request_timeout_s=base, request_timeout_per_token_s=per_token))
        await gw.start()
        try:
            inp = GenerateInput("e2e-" + uuid.uuid4().hex, prompt,
                                SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
            return [ev async for ev in gw.generate(inp)]
        finally:
            await gw.stop()

    async def main():
        with pytest.raises(GatewayError) as e:
            await run(0.0)
        assert e.value.code == grpc.StatusCode.DEADLINE_EXCEEDED
        await system.wait_all_free()
        evs = await run(4 * 16 * pause / len(prompt))   # 4x the pauses, spread per token
        assert evs[-1].finish_reason == "length" and evs[-1].usage.completion_tokens == 4
        await system.wait_all_free()
    system.run(main(), 120)


def test_unset_max_tokens_stops_at_the_contexts_end(model_dir):  # noqa: F811
    """Workers serving a 48-token context: a 30-token prompt with max_tokens unset (REST's
    default) gets exactly 48 - 30 tokens, finish_reason "length", within a deadline that
    counted those tokens."""
    ctx = {"max_model_len": 48}
    with System.started(model_dir, prefill_options=ctx, decode_options=ctx) as s:
        async def main():
            prompt = _prompt(30, 98)
            inp = GenerateInput("ctx-" + uuid.uuid4().hex, prompt,
                                SamplingParams(temperature=0.0, max_tokens=None, ignore_eos=True))
            evs = [ev async for ev in s.gateway.generate(inp)]
            assert s.gateway.max_model_len == 48
            assert evs[-1].finish_reason == "length"
            assert evs[-1].usage.completion_tokens == sum(len(e.token_ids) for e in evs) == 48 - 30
            cfg = s.gateway.cfg
            assert s.gateway.request_timeout(30, None) == pytest.approx(
                cfg.request_timeout_s + 48 * cfg.request_timeout_per_token_s)
            await s.wait_all_free()
        s.run(main(), 120)


def test_keepalives_go_only_while_queued_and_the_engine_computes():
    """KVPush.keep_alive with a recording sender: nothing before a third of the idle window,
    one per third while the engine computes layers (of any request), none while it stands
    still (a wedged engine lets the reservation expire), none once a layer was pushed."""
    from prefill_worker.kv_push import KEEPALIVES_PER_WINDOW, Push

    class Sender:
        sent = 0

        def keepalive(self, handle):
            self.sent += 1
            return True

    kv = KVPush.__new__(KVPush)
    kv.sender, kv.layers_run = Sender(), 5
    idle, every = 3.0, 3.0 / KEEPALIVES_PER_WINDOW
    p = Push("r", handle=None, first_block=0, opened_at=100.0)
    assert not kv.keep_alive(p, idle, now=100.0)                   # the first poll: a baseline
    kv.layers_run = 9
    assert not kv.keep_alive(p, idle, now=100.0 + every / 2)
    assert kv.keep_alive(p, idle, now=100.0 + every)
    assert p.last_progress == 100.0 + every
    assert not kv.keep_alive(p, idle, now=100.0 + 3 * every)       # no layer since
    kv.layers_run = 10
    assert kv.keep_alive(p, idle, now=100.0 + 3 * every)
    kv.layers_run = 11
    assert not kv.keep_alive(p, 0.0, now=200.0)                    # a fixed deadline: no use
    p.progress_at = 100.0 + 3.5 * every                             # its layers flow: progress
    assert not kv.keep_alive(p, idle, now=200.0)
    assert kv.sender.sent == 2
