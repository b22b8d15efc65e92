"""The per-token path histogram (services/token_path.py): stages, the gap timer, the SSE
write timing; and on real workers in one process (test_pd_inprocess's System) one request
moves the decode worker's engine_step and to_loop series and the gateway's grpc_gap and
gateway series by the counts its messages imply."""
from __future__ import annotations

import asyncio
import urllib.request
import uuid

import pytest
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

from engine.sampling_params import SamplingParams
from gateway.request import GenerateInput
from pdserve.launcher import free_port
from services.token_path import STAGES, TokenPath
from tests.unit.test_pd_inprocess import System, _prompt
from tests.unit.test_pd_inprocess import model_dir  # noqa: F401  (fixture)


def _count(reg, role, stage):
    return reg.get_sample_value("pdserve:token_path_seconds_count", {"role": role, "stage": stage}) or 0


def test_stages_gaps_and_writes():
    reg = CollectorRegistry()
    path = TokenPath(reg, "gateway")
    gaps = path.gaps()
    t = gaps.tick()
    assert _count(reg, "gateway", "grpc_gap") == 0         # the first read has no gap
    gaps.tick()
    gaps.tick()
    assert _count(reg, "gateway", "grpc_gap") == 2
    path.since("gateway", t)
    path.since("gateway", 0.0)                               # not measured: nothing observed
    assert _count(reg, "gateway", "gateway") == 1
    with pytest.raises(ValueError, match="unknown token path stage"):
        path.observe("warp", 1.0)

    async def chunks():
        for c in ("a", "b", "c"):
            yield c

    async def consume():
        out = []
        async for c in path.timed_writes(chunks()):
            await asyncio.sleep(0.01)                       # the "write"
            out.append(c)
        return out
    assert asyncio.run(consume()) == ["a", "b", "c"]
    assert _count(reg, "gateway", "sse_write") == 3
    assert reg.get_sample_value("pdserve:token_path_seconds_sum",
                                {"role": "gateway", "stage": "sse_write"}) >= 0.03
    path.on_step(0.002, {"r": 1})
    assert _count(reg, "gateway", "engine_step") == 1 and set(STAGES) >= {"engine_step", "to_loop"}


@pytest.fixture(scope="module")
def system(model_dir):  # noqa: F811
    port = free_port()
    with System.started(model_dir, decode_config={"metrics_port": port}) as s:
        s.decode_metrics = f"http://127.0.0.1:{port}/metrics"
        yield s


def _decode_counts(system) -> dict[str, float]:
    text = urllib.request.urlopen(system.decode_metrics, timeout=10).read().decode()
    fams = {f.name: f for f in text_string_to_metric_families(text)}
    return {s.labels["stage"]: s.value for s in fams["pdserve:token_path_seconds"].samples
            if s.name.endswith("_count") and s.labels["role"] == "decode"}


def test_one_request_moves_each_stage(system):
    gw = system.gateway
    greg = gw.metrics.registry
    n = 12
    before = {s: _count(greg, "gateway", s) for s in ("grpc_gap", "gateway")}
    dbefore = _decode_counts(system)

    async def main():
        inp = GenerateInput("tp-" + uuid.uuid4().hex, _prompt(20, 7),
                            SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True))
        events = [ev async for ev in gw.generate(inp)]
        await system.wait_all_free()
        return events
    events = system.run(main())
    assert sum(len(e.token_ids) for e in events) == n
    reads = _count(greg, "gateway", "gateway") - before["gateway"]
    assert 1 <= reads <= n - 1                  # one per TokenChunk (tokens 2..n, maybe coalesced)
    assert _count(greg, "gateway", "grpc_gap") - before["grpc_gap"] == reads - 1
    # the decode worker: a step per token at least (the first came from the prefill worker),
    # and an output read on its loop per step that had this request
    dafter = _decode_counts(system)
    steps = dafter["engine_step"] - dbefore.get("engine_step", 0)
    outs = dafter["to_loop"] - dbefore.get("to_loop", 0)
    assert steps >= n - 1 and reads <= outs <= steps, (steps, outs, reads)
