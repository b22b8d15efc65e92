"""Peer fetch through the gateway (issue 31): 2 prefill + 1 decode workers and a gateway as
real processes (`pdserve up`'s launcher), the KV events feeding the gateway's index. With
--prefix-routing none the prefill picks alternate (least loaded, ties by calls opened), so
a prompt's prefix computed on one prefill worker is asked of the other next: the gateway
names the first as its peer_prefix, the second fetches instead of computing, and the
tokens equal those of the worker that computed it itself."""
from __future__ import annotations

import urllib.request

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

from pdserve.launcher import free_port
from protos.pdserve.v1 import common_pb2, generation_pb2, generation_pb2_grpc
from tests.helpers import wait_until

pytestmark = pytest.mark.e2e
PROMPT = [(i * 29) % 700 + 5 for i in range(16 * 8 + 3)]       # 8 full blocks of 16 + 3


@pytest.fixture(scope="module")
def system(start_system):
    port = free_port()
    launcher = start_system(2, 1, gateway_args=["--health-interval-s", "0.5", "--metrics-port", str(port),
                                                "--prefix-routing", "none"])
    launcher.gateway_metrics = port
    return launcher


def _samples(url: str, name: str, **labels) -> float:
    with urllib.request.urlopen(url, timeout=10) as r:
        text = r.read().decode()
    return sum(s.value for fam in text_string_to_metric_families(text) for s in fam.samples
               if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()))


def _fetches(system, result: str) -> float:
    return sum(_samples(c.metrics.partition("=")[2], "pdserve:peer_fetch_total", result=result)
               for c in system.workers("prefill"))


def _generate(system, prompt) -> list[int]:
    with grpc.insecure_channel(system.grpc_address) as ch:
        req = generation_pb2.GenerateRequest(token_ids=common_pb2.TokenIds(ids=prompt),
                                             sampling=common_pb2.SamplingParams(
                                                 temperature=0.0, max_tokens=6, ignore_eos=True))
        return [t for m in generation_pb2_grpc.GenerationStub(ch).Generate(req, timeout=60)
                for t in m.token_ids]


def test_the_gateway_names_the_peer_and_the_other_worker_fetches(system):
    gw = f"http://127.0.0.1:{system.gateway_metrics}/metrics"
    ok0, fb0 = _fetches(system, "ok"), _fetches(system, "fallback")
    _generate(system, PROMPT)                                  # computed on one prefill worker
    wait_until(lambda: ((n := _samples(gw, "pdserve:kv_index_blocks", pool="prefill", tier="device")) >= 8, n),
               10, "the prefix's blocks in the gateway's index")
    fetched = _generate(system, PROMPT + [9, 10])              # the other one: fetched from the first
    assert _fetches(system, "ok") == ok0 + 1 and _fetches(system, "fallback") == fb0
    computed = _generate(system, PROMPT + [9, 10])             # the first again: its own prefix hit
    assert fetched == computed and len(fetched) == 6
    assert _fetches(system, "ok") == ok0 + 1                   # it held the prefix: nothing fetched
