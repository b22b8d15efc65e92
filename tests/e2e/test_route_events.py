"""Routing on what the workers really hold (issue 31, K2), end to end: real processes (a
gateway, two prefill workers, one decode worker, the tiny model), the gateway's index fed by
the workers' own KvEvents streams. After prefill worker A computed a long prompt, later
prompts sharing its prefix go to A (the least-loaded rule alone would send the next one to B,
which has served fewer), each a prefix hit there, each output the engine's greedy one; the
gateway counts the picks as prefix decisions with the blocks matched."""
from __future__ import annotations

import re

import grpc
import httpx
import pytest

from engine.sampling_params import SamplingParams
from pdserve.launcher import free_port
from protos.pdserve.v1 import common_pb2, generation_pb2, generation_pb2_grpc, prefill_pb2_grpc
from tests.helpers import wait_until

pytestmark = [pytest.mark.e2e]

BLOCKS = 20                  # the shared prefix, in KV blocks
N_OUT = 4


@pytest.fixture(scope="module")
def system(start_system):
    return start_system(2, 1, http_port=free_port(), gateway_args=["--health-interval-s", "0.5"])


@pytest.fixture(scope="module")
def llm(model_dir):
    from engine import LLM
    return LLM(model_dir)


def _prefill_stats(system) -> dict:
    out = {}
    for c in system.workers("prefill"):
        with grpc.insecure_channel(c.address) as ch:
            out[c.address] = prefill_pb2_grpc.PrefillWorkerStub(ch).Stats(
                common_pb2.StatsRequest(), timeout=10)
    return out


def _generate(system, ids) -> list[int]:
    req = generation_pb2.GenerateRequest(
        token_ids=common_pb2.TokenIds(ids=ids),
        sampling=common_pb2.SamplingParams(temperature=0.0, max_tokens=N_OUT, ignore_eos=True))
    with grpc.insecure_channel(system.grpc_address) as ch:
        return [t for m in generation_pb2_grpc.GenerationStub(ch).Generate(req, timeout=60)
                for t in m.token_ids]


def _metric(system, name: str, **labels) -> float:
    text = httpx.get(f"http://127.0.0.1:{system.http_port}/metrics", timeout=10).text
    total = 0.0
    for got, value in re.findall(rf'^pdserve:{name}\{{([^}}]*)\}} (\S+)$', text, re.M):
        if all(f'{k}="{v}"' in got for k, v in labels.items()):
            total += float(value)
    return total


def test_a_prompt_sharing_a_cached_prefix_goes_where_it_is_cached(system, llm):
    stats = _prefill_stats(system)
    block = next(iter(stats.values())).compat.block_size
    base = [(i * 37) % 900 + 3 for i in range(BLOCKS * block)]
    prompts = [base + [(i * 11 + k) % 900 + 3 for k in range(5)] for i in range(4)]
    want = [o.token_ids for o in llm.generate(prompts, SamplingParams(
        temperature=0.0, max_tokens=N_OUT, ignore_eos=True))]

    def done() -> dict:
        now = _prefill_stats(system)
        return {a: now[a].transfers.transfers_done - stats[a].transfers.transfers_done for a in now}

    assert _generate(system, prompts[0]) == want[0]
    first = [a for a, n in done().items() if n]
    assert len(first) == 1, done()
    wait_until(lambda: (_metric(system, "kv_index_blocks", pool="prefill", tier="device")
                        >= BLOCKS, None), 10, "the gateway's index learns the prefill worker's blocks")
    prefix_picks = _metric(system, "route_decisions_total", pool="prefill", reason="prefix")
    hit_blocks = _metric(system, "route_prefix_hit_blocks_total", pool="prefill")
    for ids, expect in zip(prompts[1:], want[1:]):
        assert _generate(system, ids) == expect
    assert done() == {a: (4 if a == first[0] else 0) for a in stats}, done()
    assert _metric(system, "route_decisions_total", pool="prefill", reason="prefix") - prefix_picks == 3
    assert _metric(system, "route_prefix_hit_blocks_total", pool="prefill") - hit_blocks == 3 * BLOCKS
