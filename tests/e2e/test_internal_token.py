"""The per-deployment internal credential with real processes (Launcher(internal_token=True),
what `pdserve up` runs): 1 prefill + 1 decode worker and a gateway, plain text on loopback.

- no worker RPC (KvEvents too) is served without the token (UNAUTHENTICATED, none or a
  wrong one); health stays open; with the token Stats answers; the public API works (the
  gateway sends it)
- the token is on no process's command line (`ps`), only its file's path, mode 0600
- a Prefill sent straight to the worker with the token, a real destination and a made-up
  transfer id is refused and computes nothing: the prefill engine's prefix-cache lookups
  (one per prompt token it schedules, its /metrics) move by exactly one legitimate
  request's count across the forged Prefill and one more legitimate request
"""
from __future__ import annotations

import os
import secrets
import stat
import urllib.request
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client.parser import text_string_to_metric_families

from pdserve.launcher import free_port
from protos.pdserve.v1 import (common_pb2, decode_pb2, decode_pb2_grpc, generation_pb2,
                               generation_pb2_grpc, prefill_pb2, prefill_pb2_grpc)
from services.security import read_token
from tests.helpers import wait_until

pytestmark = pytest.mark.e2e

PROMPT = list(range(5, 37))


@pytest.fixture(scope="module")
def system(start_system):
    port = free_port()
    launcher = start_system(1, 1, internal_token=True, prefill_args=["--metrics-port", str(port)],
                            gateway_args=["--health-interval-s", "0.5"])
    launcher.prefill_metrics = port
    return launcher


def stubs(system, token: str):
    """(prefill stub, decode stub, channels) with `token` as metadata ("" : none)."""
    md = [("authorization", f"Bearer {token}")] if token else None
    chans = [grpc.insecure_channel(system.workers(r)[0].address) for r in ("prefill", "decode")]
    return (prefill_pb2_grpc.PrefillWorkerStub(chans[0]), decode_pb2_grpc.DecodeWorkerStub(chans[1]),
            chans, md)


def generate(system, prompt) -> list[int]:
    with grpc.insecure_channel(system.grpc_address) as ch:
        req = generation_pb2.GenerateRequest(token_ids=common_pb2.TokenIds(ids=prompt),
                                             sampling=common_pb2.SamplingParams(
                                                 temperature=0.0, max_tokens=4, ignore_eos=True))
        return [t for m in generation_pb2_grpc.GenerationStub(ch).Generate(req, timeout=60)
                for t in m.token_ids]


def prefix_lookups(system) -> float:
    with urllib.request.urlopen(f"http://127.0.0.1:{system.prefill_metrics}/metrics", timeout=10) as r:
        text = r.read().decode()
    return sum(s.value for fam in text_string_to_metric_families(text) for s in fam.samples
               if s.name.endswith("prefix_cache_queries_total"))


@pytest.mark.parametrize("token", ["", "sk-not-the-deployments-token"], ids=["none", "wrong"])
def test_worker_rpcs_need_the_token(system, token):
    pre, dec, chans, md = stubs(system, token)
    calls = {
        "prefill Stats": lambda: pre.Stats(common_pb2.StatsRequest(), metadata=md, timeout=10),
        "prefill Abort": lambda: pre.Abort(common_pb2.AbortRequest(request_id="x"), metadata=md, timeout=10),
        "Prefill": lambda: pre.Prefill(prefill_pb2.PrefillRequest(request_id="x", prompt_token_ids=PROMPT),
                                       metadata=md, timeout=10),
        "ExportPrefix": lambda: pre.ExportPrefix(prefill_pb2.ExportPrefixRequest(
            token_ids=PROMPT, kv_endpoint="ucx://127.0.0.1:1", transfer_id="x"), metadata=md, timeout=10),
        "decode Stats": lambda: dec.Stats(common_pb2.StatsRequest(), metadata=md, timeout=10),
        "Decode": lambda: list(dec.Decode(decode_pb2.DecodeRequest(
            request_id="hog", prompt_token_ids=PROMPT * 8), metadata=md, timeout=10)),
        "SubmitFirstToken": lambda: dec.SubmitFirstToken(decode_pb2.SubmitFirstTokenRequest(
            request_id="hog"), metadata=md, timeout=10),
        "prefill KvEvents": lambda: next(pre.KvEvents(common_pb2.KvEventsRequest(), metadata=md,
                                                      timeout=10)),
        "decode KvEvents": lambda: next(dec.KvEvents(common_pb2.KvEventsRequest(), metadata=md,
                                                     timeout=10)),
    }
    try:
        for name, call in calls.items():
            with pytest.raises(grpc.RpcError) as e:
                call()
            assert e.value.code() is grpc.StatusCode.UNAUTHENTICATED, (name, e.value)
        for ch in chans:
            r = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=10)
            assert r.status == health_pb2.HealthCheckResponse.SERVING
    finally:
        for ch in chans:
            ch.close()


def test_with_the_token_stats_answer_and_the_public_api_serves(system):
    token = read_token(system.token_file)
    pre, dec, chans, md = stubs(system, token)
    try:
        st = dec.Stats(common_pb2.StatsRequest(), metadata=md, timeout=10)
        assert st.total_kv_blocks > 0 and st.free_kv_blocks == st.total_kv_blocks
        assert pre.Stats(common_pb2.StatsRequest(), metadata=md, timeout=10).total_kv_blocks > 0
    finally:
        for ch in chans:
            ch.close()
    assert len(generate(system, PROMPT)) == 4


def test_the_token_is_on_no_command_line(system):
    token = read_token(system.token_file)
    assert stat.S_IMODE(os.stat(system.token_file).st_mode) == 0o600
    for c in system.children:
        cmdline = Path(f"/proc/{c.popen.pid}/cmdline").read_bytes()
        # a worker forked from the zygote shows the zygote's command line (pdserve/zygote.py);
        # its own argv went over the zygote's pipe: the token file's path, never the token
        assert system.token_file in c.argv, c.role
        assert token not in " ".join(c.argv), c.role
        assert token.encode() not in cmdline, c.role


def test_a_made_up_transfer_id_is_refused_before_any_compute(system):
    token = read_token(system.token_file)
    pre, dec, chans, md = stubs(system, token)
    try:
        start = prefix_lookups(system)
        generate(system, PROMPT)
        one = wait_until(lambda: (prefix_lookups(system) > start, prefix_lookups(system)), 30,
                         "the prefill's lookups counting a request") - start
        # a real reservation, so the destination is genuine except for its transfer id
        stream = dec.Decode(decode_pb2.DecodeRequest(
            request_id="forged", prompt_token_ids=PROMPT[::-1],
            sampling=common_pb2.SamplingParams(temperature=0.0, max_tokens=2)), metadata=md, timeout=30)
        kv = next(stream).kv_ready
        dest = prefill_pb2.KvDestination(
            decode_worker_id=kv.decode_worker_id, kv_endpoint=kv.kv_endpoint,
            transfer_id=secrets.token_hex(24), dst_block_ids=kv.block_ids,
            num_cached_tokens=kv.num_cached_tokens, compat=kv.compat,
            expires_at_unix_ms=kv.expires_at_unix_ms)
        before = prefix_lookups(system)
        with pytest.raises(grpc.RpcError) as e:
            pre.Prefill(prefill_pb2.PrefillRequest(
                request_id="forged", prompt_token_ids=PROMPT[::-1], destination=dest,
                sampling=common_pb2.SamplingParams(temperature=0.0, max_tokens=2)), metadata=md, timeout=30)
        assert e.value.code() is grpc.StatusCode.PERMISSION_DENIED, e.value
        assert dec.Abort(common_pb2.AbortRequest(request_id="forged"), metadata=md, timeout=10).found
        list(stream)
        generate(system, [t + 1 for t in PROMPT])       # a legitimate request after it
        after = wait_until(lambda: (prefix_lookups(system) >= before + one, prefix_lookups(system)),
                           30, "the prefill's lookups counting the next request")
        assert after - before == one                    # the forged Prefill looked nothing up
        def all_free():
            st = dec.Stats(common_pb2.StatsRequest(), metadata=md, timeout=10)
            return st.free_kv_blocks == st.total_kv_blocks, st
        wait_until(all_free, 10, "every decode KV block free")
    finally:
        for ch in chans:
            ch.close()
