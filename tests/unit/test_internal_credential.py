"""Internal RPCs closed by the deployment's credential (services/security.py), in one
process: a prefill and a decode worker and a gateway (test_pd_inprocess.System, real gRPC on
127.0.0.1) sharing a token file.

- every worker RPC (KvEvents too) without the token, or with another one, is
  UNAUTHENTICATED; health stays open (probes); with the token (the gateway's channels) a
  request is served and its greedy tokens equal the offline engine's
- a Prefill naming a transfer id no decode worker made, or a real one with its expiry
  moved, is PERMISSION_DENIED and nothing is held afterwards
- one caller holds at most --max-reservations-per-caller reservations (RESOURCE_EXHAUSTED
  past it); one ending frees a slot
"""
from __future__ import annotations

import asyncio
import secrets
import uuid

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from engine.sampling_params import SamplingParams
from gateway.request import GenerateInput
from protos.pdserve.v1 import common_pb2, decode_pb2, decode_pb2_grpc, prefill_pb2, prefill_pb2_grpc
from services.security import channel, write_token
from tests.unit.test_pd_inprocess import RPC_S, System, _dest, _greedy, _prompt, _rest
from tests.unit.test_pd_inprocess import model_dir, offline  # noqa: F401  (fixtures)

CAP = 2


@pytest.fixture(scope="module")
def system(model_dir, tmp_path_factory):
    token_file = tmp_path_factory.mktemp("internal") / "token"
    write_token(str(token_file))
    with System.started(model_dir, token_file=str(token_file),
                        decode_config={"max_reservations_per_caller": CAP}) as s:
        yield s


def _calls(pre, dec):
    """One call of every worker RPC (unary ones awaited, Decode's first message read)."""
    req = dict(request_id="x-" + uuid.uuid4().hex, prompt_token_ids=_prompt(12), sampling=_greedy(2))
    return {
        "Prefill": lambda: pre.Prefill(prefill_pb2.PrefillRequest(**req), timeout=RPC_S),
        "prefill Abort": lambda: pre.Abort(common_pb2.AbortRequest(request_id="x"), timeout=RPC_S),
        "prefill Stats": lambda: pre.Stats(common_pb2.StatsRequest(), timeout=RPC_S),
        "Decode": lambda: dec.Decode(decode_pb2.DecodeRequest(**req), timeout=RPC_S).read(),
        "SubmitFirstToken": lambda: dec.SubmitFirstToken(decode_pb2.SubmitFirstTokenRequest(
            request_id="x", first_token=common_pb2.TokenLogprob(token_id=1)), timeout=RPC_S),
        "decode Abort": lambda: dec.Abort(common_pb2.AbortRequest(request_id="x"), timeout=RPC_S),
        "decode Stats": lambda: dec.Stats(common_pb2.StatsRequest(), timeout=RPC_S),
        "prefill KvEvents": lambda: pre.KvEvents(common_pb2.KvEventsRequest(), timeout=RPC_S).read(),
        "decode KvEvents": lambda: dec.KvEvents(common_pb2.KvEventsRequest(), timeout=RPC_S).read(),
    }


@pytest.mark.parametrize("token", ["", "not-the-deployments-token"], ids=["none", "wrong"])
def test_every_worker_rpc_needs_the_credential(system, token):
    async def main():
        pre_ch, dec_ch = channel(system.pre_addr, None, token=token), channel(system.dec_addr, None, token=token)
        try:
            calls = _calls(prefill_pb2_grpc.PrefillWorkerStub(pre_ch), decode_pb2_grpc.DecodeWorkerStub(dec_ch))
            for name, call in calls.items():
                with pytest.raises(grpc.aio.AioRpcError) as e:
                    await call()
                assert e.value.code() is grpc.StatusCode.UNAUTHENTICATED, (name, e.value.details())
                assert "internal credential" in e.value.details()
            for ch in (pre_ch, dec_ch):        # probes need no credential
                r = await health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=RPC_S)
                assert r.status == health_pb2.HealthCheckResponse.SERVING
        finally:
            await pre_ch.close()
            await dec_ch.close()
        await system.wait_all_free()
    system.run(main())


def test_with_the_credential_the_gateway_serves_the_offline_engines_tokens(system, offline):
    async def main():
        prompt = _prompt(21, 3)
        ref = offline(prompt, 6)
        tokens = []
        params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
        async for out in system.gateway.generate(GenerateInput("cred-" + uuid.uuid4().hex, prompt, params)):
            tokens.extend(out.token_ids)
        assert tokens == ref.token_ids
        stats = await system.pre.Stats(common_pb2.StatsRequest(), timeout=RPC_S)   # the test's token
        assert stats.transfers.transfers_done >= 1
        await system.wait_all_free()
    system.run(main())


@pytest.mark.parametrize("forge", ["made-up id", "expiry moved"])
def test_a_prefill_whose_transfer_id_no_decode_worker_made_is_refused(system, forge):
    async def main():
        rid, prompt = "forged-" + uuid.uuid4().hex, _prompt(20, 5)
        stream = system.dec.Decode(decode_pb2.DecodeRequest(
            request_id=rid, prompt_token_ids=prompt, sampling=_greedy(4)), timeout=RPC_S)
        kv = (await asyncio.wait_for(stream.read(), RPC_S)).kv_ready
        dest = _dest(kv)
        if forge == "made-up id":
            dest.transfer_id = secrets.token_hex(24)
        else:
            dest.expires_at_unix_ms += 60_000
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await system.pre.Prefill(prefill_pb2.PrefillRequest(
                request_id=rid, prompt_token_ids=prompt, sampling=_greedy(4), destination=dest),
                timeout=RPC_S)
        assert e.value.code() is grpc.StatusCode.PERMISSION_DENIED, e.value.details()
        assert "not reserved by a decode worker" in e.value.details()
        # the real destination still works: the refusal was the signature's, not the call's
        r = await system.pre.Prefill(prefill_pb2.PrefillRequest(
            request_id=rid, prompt_token_ids=prompt, sampling=_greedy(4), destination=_dest(kv)),
            timeout=RPC_S)
        await system.dec.SubmitFirstToken(decode_pb2.SubmitFirstTokenRequest(
            request_id=rid, first_token=r.first_token), timeout=RPC_S)
        msgs = await _rest(stream)
        assert msgs[-1].tokens.finish_reason == common_pb2.FINISH_REASON_LENGTH
        await system.wait_all_free()
    system.run(main())


def test_one_caller_holds_at_most_the_cap_of_reservations(system):
    async def main():
        def decode(rid):
            return system.dec.Decode(decode_pb2.DecodeRequest(
                request_id=rid, prompt_token_ids=_prompt(20, 9), sampling=_greedy(4)), timeout=RPC_S)
        rids = [f"cap-{i}-{uuid.uuid4().hex}" for i in range(CAP + 1)]
        held = [decode(r) for r in rids[:CAP]]
        for s in held:
            assert (await asyncio.wait_for(s.read(), RPC_S)).HasField("kv_ready")
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await decode(rids[CAP]).read()
        assert e.value.code() is grpc.StatusCode.RESOURCE_EXHAUSTED, e.value.details()
        assert f"holds {CAP} KV reservations" in e.value.details()
        assert (await system.dec.Abort(common_pb2.AbortRequest(request_id=rids[0]), timeout=RPC_S)).found
        await _rest(held[0])
        again = decode(rids[CAP])                        # a slot is free again
        assert (await asyncio.wait_for(again.read(), RPC_S)).HasField("kv_ready")
        for rid, s in ((rids[1], held[1]), (rids[CAP], again)):
            assert (await system.dec.Abort(common_pb2.AbortRequest(request_id=rid), timeout=RPC_S)).found
            await _rest(s)
        await system.wait_all_free()
    system.run(main())
