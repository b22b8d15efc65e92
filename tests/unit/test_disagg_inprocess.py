"""Conditional disaggregation in one process (test_pd_inprocess.py's System: real workers and
gateway over gRPC on loopback, KV over the loopback transport): the decode worker's
local_prefill path against the offline engine's greedy tokens, its abort and its cached
tokens; the gateway's never and auto modes and their counts."""
from __future__ import annotations

import asyncio
import uuid

import pytest
from prometheus_client import generate_latest

from engine.sampling_params import SamplingParams
from gateway.disagg import DisaggPolicy
from gateway.placement import Placement
from gateway.request import GenerateInput
from protos.pdserve.v1 import common_pb2, decode_pb2

from .test_pd_inprocess import RPC_S, System, _greedy, _prompt, _rest, model_dir, offline  # noqa: F401

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def never(model_dir):  # noqa: F811
    # room for a stream long enough that an Abort sent after its first chunk always finds it
    with System.started(model_dir, gateway_config={"disaggregation": "never"},
                        decode_options={"num_blocks": 512}) as s:
        yield s


@pytest.fixture(scope="module")
def auto(model_dir):  # noqa: F811
    # short: <= 16 uncached tokens; a prefill of > 1 ms stalls running streams too long
    with System.started(model_dir, gateway_config={
            "disaggregation": "auto", "disagg_max_local_tokens": 16,
            "disagg_max_stall_ms": 1.0}) as s:
        yield s


async def _generate(system, prompt, n):
    inp = GenerateInput("d-" + uuid.uuid4().hex, prompt,
                        SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True))
    tokens, last = [], None
    async for ev in system.gateway.generate(inp):
        tokens += ev.token_ids
        last = ev
    return tokens, last


def _local_decode(system, rid, prompt, n):
    return system.dec.Decode(decode_pb2.DecodeRequest(
        request_id=rid, prompt_token_ids=prompt, sampling=_greedy(n), local_prefill=True),
        timeout=RPC_S)


def test_a_local_prefill_streams_every_token_from_the_first(never, offline):  # noqa: F811
    prompt, n = _prompt(37, 11), 9
    ref = offline(prompt, n)

    async def main():
        msgs = await _rest(_local_decode(never, "loc-" + uuid.uuid4().hex, prompt, n))
        assert all(m.WhichOneof("msg") == "tokens" for m in msgs)       # no KvReady
        tokens = [t.token_id for m in msgs for t in m.tokens.tokens]
        assert tokens == ref.token_ids
        last = msgs[-1].tokens
        assert last.finish_reason == common_pb2.FINISH_REASON_LENGTH
        assert (last.usage.prompt_tokens, last.usage.completion_tokens) == (len(prompt), n)
        # the same prompt again: the decode worker's prefix cache holds its full blocks
        again = await _rest(_local_decode(never, "loc-" + uuid.uuid4().hex, prompt, n))
        assert [t.token_id for m in again for t in m.tokens.tokens] == ref.token_ids
        assert again[-1].tokens.usage.cached_tokens == (len(prompt) - 1) // 8 * 8 > 0
        await never.wait_all_free()
    never.run(main())


def test_aborting_a_local_request_frees_every_block(never):
    async def main():
        rid = "loc-abort-" + uuid.uuid4().hex
        stream = _local_decode(never, rid, _prompt(40, 12), 3000)
        assert (await asyncio.wait_for(stream.read(), RPC_S)).tokens.tokens   # streaming
        assert (await never.held())[1] > 0
        assert (await never.dec.Abort(common_pb2.AbortRequest(request_id=rid, reason="test"),
                                      timeout=RPC_S)).found
        rest = await _rest(stream)
        assert rest[-1].tokens.finish_reason == common_pb2.FINISH_REASON_ABORT
        await never.wait_all_free()
        # and the caller's cancel, mid-stream
        stream = _local_decode(never, "loc-cancel-" + uuid.uuid4().hex, _prompt(40, 13), 3000)
        assert (await asyncio.wait_for(stream.read(), RPC_S)).tokens.tokens
        stream.cancel()
        await never.wait_all_free()
    never.run(main())


def test_never_serves_the_offline_engines_tokens_without_the_prefill_worker(never, offline):  # noqa: F811
    prompts = [_prompt(30, 2), _prompt(5, 3), _prompt(70, 4)]
    refs = [offline(p, 10) for p in prompts]

    async def main():
        before = dict(never.gateway.prefill_counts)
        sent = (await never.pre.Stats(common_pb2.StatsRequest(), timeout=RPC_S)).transfers.transfers_done
        got = await asyncio.gather(*(_generate(never, p, 10) for p in prompts))
        for (tokens, last), ref in zip(got, refs):
            assert tokens == ref.token_ids
            assert last.finish_reason == "length" and last.usage.completion_tokens == 10
        assert never.gateway.prefill_counts == {"disaggregated": before["disaggregated"],
                                                 "local": before["local"] + 3}
        after = (await never.pre.Stats(common_pb2.StatsRequest(), timeout=RPC_S)).transfers
        assert after.transfers_done == sent                       # no KV moved
        text = generate_latest(never.gateway.metrics.registry).decode()
        assert f'pdserve:prefills_total{{kind="local",role="gateway"}} {before["local"] + 3}.0' in text
        await never.wait_all_free()
    never.run(main())


def test_auto_keeps_a_short_prompt_local_and_sends_a_long_one_to_the_prefill_worker(auto, offline):  # noqa: F811
    short, long_ = _prompt(12, 21), _prompt(90, 22)
    ref_short, ref_long = offline(short, 300), offline(long_, 6)

    async def main():
        c0 = dict(auto.gateway.prefill_counts)
        running = asyncio.create_task(_generate(auto, short, 300))    # local: 12 <= 16
        while auto.gateway.prefill_counts["local"] == c0["local"]:     # bounded by the test's deadline
            await asyncio.sleep(0.01)
        # the decode worker streams `short`: a 90-token prefill there would stall it > 1 ms
        tokens, _ = await _generate(auto, long_, 6)
        assert tokens == ref_long.token_ids
        assert (await running)[0] == ref_short.token_ids
        assert auto.gateway.prefill_counts == {"disaggregated": c0["disaggregated"] + 1,
                                                "local": c0["local"] + 1}
        await auto.wait_all_free()
    auto.run(main(), 120)


def test_both_workers_report_their_measured_prompt_cost_and_auto_is_seeded_by_it(auto):
    """Each worker's warm-up timed a long and a short prompt (services/prefill_cost.py);
    their Stats carry the line, and a placement whose lines are not observed yet takes it
    as its seeds (the prefill worker's plus the handover's)."""
    async def main():
        p = await auto.pre.Stats(common_pb2.StatsRequest(), timeout=RPC_S)
        d = await auto.dec.Stats(common_pb2.StatsRequest(), timeout=RPC_S)
        for s in (p, d):
            assert s.HasField("prefill_cost") and s.prefill_cost.per_token_s > 0
            assert s.prefill_cost.fixed_s >= 0
        gw = auto.gateway
        fresh = Placement(DisaggPolicy(), gw.prefill, gw.metrics)
        w, = gw.decode.healthy()
        pw, = gw.prefill.healthy()
        assert w.stats is not None and pw.stats is not None      # probed before SERVING
        fresh.choose(w, _prompt(40, 23), 0)
        c, pc, ha = w.stats.prefill_cost, pw.stats.prefill_cost, fresh.policy.handover
        assert fresh.policy.seeds == {
            "local": pytest.approx((c.fixed_s, c.per_token_s)),
            "remote": pytest.approx((pc.fixed_s + ha[0], pc.per_token_s + ha[1]))}
        assert fresh.policy.local.cost(100) == pytest.approx(c.fixed_s + 100 * c.per_token_s)
    auto.run(main(), 60)
