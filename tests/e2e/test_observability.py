"""Operators' view end to end: gateway + 1 prefill + 1 decode as real processes.

One request -> ONE trace id across the three processes (W3C context through gRPC metadata)
with the expected parent-child structure; after N known requests the scraped counters equal
what was sent.
"""
from __future__ import annotations

import time
import urllib.request
from pathlib import Path

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

from services import tracing
from pdserve.launcher import free_port
from protos.pdserve.v1 import common_pb2, generation_pb2, generation_pb2_grpc

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


def scrape(port: int) -> dict[tuple, float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        text = r.read().decode()
    return {(s.name, frozenset(s.labels.items())): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


@pytest.fixture(scope="module")
def system(start_system, tmp_path_factory):
    d = tmp_path_factory.mktemp("observability")
    files = {role: str(d / f"{role}.jsonl") for role in ("gateway", "prefill", "decode")}
    ports = {role: free_port() for role in files}
    ports["http"] = free_port()
    launcher = start_system(
        1, 1,
        prefill_args=["--trace-file", files["prefill"], "--metrics-port", str(ports["prefill"])],
        decode_args=["--trace-file", files["decode"], "--metrics-port", str(ports["decode"])],
        gateway_args=["--trace-file", files["gateway"], "--metrics-port", str(ports["gateway"]),
                      "--http-port", str(ports["http"])])
    return launcher, files, ports


def generate(address: str, ids: list[int], max_tokens: int, request_id: str):
    with grpc.insecure_channel(address) as ch:
        stub = generation_pb2_grpc.GenerationStub(ch)
        req = generation_pb2.GenerateRequest(
            request_id=request_id, token_ids=common_pb2.TokenIds(ids=ids),
            sampling=common_pb2.SamplingParams(max_tokens=max_tokens, temperature=0.0,
                                               ignore_eos=True),
            stream_options=generation_pb2.StreamOptions(stream=True, include_usage=True))
        return list(stub.Generate(req, timeout=60))


def wait_spans(path: str, name: str, request_id: str, timeout_s: float = 10.0) -> list[dict]:
    deadline = time.monotonic() + timeout_s
    while True:
        spans = tracing.read_span_file(path)
        if any(s["name"] == name and s["attributes"].get("request_id") == request_id for s in spans):
            return spans
        if time.monotonic() > deadline:
            raise AssertionError(f"no {name} span for {request_id} in {path}: {spans}")
        time.sleep(0.05)


def test_one_trace_across_three_processes(system):
    launcher, files, _ = system
    rid = "trace-me"
    resps = generate(launcher.grpc_address, list(range(5, 45)), 4, rid)
    usage = resps[-1].usage
    assert (usage.prompt_tokens, usage.completion_tokens) == (40, 4)
    # CPU workers have no power reading: energy is absent, not zero.
    assert not usage.HasField("energy_joules")
    gw = wait_spans(files["gateway"], "pdserve.generate", rid)
    root = next(s for s in gw if s["name"] == "pdserve.generate" and s["attributes"]["request_id"] == rid)
    internal = root["attributes"]["internal_id"]     # what the workers know it by
    assert internal != rid
    pf = wait_spans(files["prefill"], "pdserve.prefill", internal)
    dc = wait_spans(files["decode"], "pdserve.decode", internal)
    trace = root["trace_id"]
    assert root["parent_span_id"] is None and root["service"] == "pdserve-gateway"
    assert root["attributes"]["prompt_tokens"] == 40 and root["attributes"]["completion_tokens"] == 4
    mine = [s for s in gw + pf + dc if s["trace_id"] == trace]
    by_name = {}
    for s in mine:
        by_name.setdefault(s["name"], []).append(s)
    prefill, decode = by_name["pdserve.prefill"][0], by_name["pdserve.decode"][0]
    assert prefill["service"] == "pdserve-prefill" and decode["service"] == "pdserve-decode"
    # Both worker spans hang directly under the gateway's span (remote parents).
    assert prefill["parent_span_id"] == root["span_id"]
    assert decode["parent_span_id"] == root["span_id"]
    for child in ("pdserve.prefill.queue", "pdserve.prefill.compute", "pdserve.kv.send"):
        assert [s["parent_span_id"] for s in by_name[child]] == [prefill["span_id"]], child
    assert any(e["name"] == "layer" for e in by_name["pdserve.kv.send"][0]["events"])
    for child in ("pdserve.decode.reservation", "pdserve.decode.transfer_wait",
                  "pdserve.decode.generate"):
        assert [s["parent_span_id"] for s in by_name[child]] == [decode["span_id"]], child
    # The TTFT waterfall (gateway/waterfall.py): one child span of the root per phase, in
    # order, tiling the interval from the request to its first token
    phases = sorted((s for s in gw if s["trace_id"] == trace and s["name"].startswith("pdserve.phase.")),
                    key=lambda s: s["start_ns"])
    assert [s["name"].removeprefix("pdserve.phase.") for s in phases] == [
        "gateway_queue", "routing", "decode_reservation", "routing", "prefill_queue",
        "prefill_compute", "kv_transfer", "decode_admission", "first_token_out"]
    assert all(s["parent_span_id"] == root["span_id"] for s in phases)
    assert all(a["end_ns"] == b["start_ns"] for a, b in zip(phases, phases[1:]))
    # Nothing of this request leaked into another trace.
    assert not [s for s in pf + dc if s["attributes"].get("request_id") == internal and s["trace_id"] != trace]


def test_scraped_counters_equal_what_was_sent(system):
    launcher, _, ports = system
    g = {"role": "gateway", "model_name": Path(launcher.model_dir).name}   # gateway/models.py
    before = scrape(ports["gateway"])

    def get(s, name, **labels):
        return s.get((name, frozenset({**g, **labels}.items())), 0.0)

    sent = [(list(range(3, 3 + n)), m) for n, m in ((8, 3), (21, 5), (33, 1), (17, 6))]
    for i, (ids, max_tokens) in enumerate(sent):
        generate(launcher.grpc_address, ids, max_tokens, f"count-{i}")
    after = scrape(ports["gateway"])
    assert get(after, "pdserve:prompt_tokens_total") - get(before, "pdserve:prompt_tokens_total") == \
        sum(len(ids) for ids, _ in sent)
    assert get(after, "pdserve:generation_tokens_total") - get(before, "pdserve:generation_tokens_total") == \
        sum(m for _, m in sent)
    key = ("pdserve:request_success_total",)
    assert get(after, *key, finished_reason="length") - get(before, *key, finished_reason="length") == len(sent)
    assert get(after, "pdserve:time_to_first_token_seconds_count") - \
        get(before, "pdserve:time_to_first_token_seconds_count") == len(sent)
    # The workers export their own view: engine gauges and the KV transfer's bytes.
    p, d = scrape(ports["prefill"]), scrape(ports["decode"])
    assert p[("pdserve:kv_transfer_bytes_total", frozenset({"role": "prefill"}.items()))] > 0
    assert p[("pdserve:request_prefill_time_seconds_count", frozenset({"role": "prefill"}.items()))] >= len(sent)
    assert d[("pdserve:request_decode_time_seconds_count", frozenset({"role": "decode"}.items()))] >= len(sent)
    assert 0.0 <= d[("pdserve:kv_cache_usage_perc", frozenset({"role": "decode"}.items()))] <= 1.0


def test_rest_request_continues_the_callers_trace(system):
    """A W3C `traceparent` header on the REST shim becomes the parent of the gateway's span,
    and the workers' spans join the same trace."""
    import httpx
    launcher, files, ports = system
    trace_id, parent = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"
    base = f"http://127.0.0.1:{ports['http']}/v1"
    model = httpx.get(f"{base}/models", timeout=10).json()["data"][0]["id"]
    r = httpx.post(f"{base}/completions", headers={"traceparent": f"00-{trace_id}-{parent}-01"},
                   json={"model": model, "prompt": "hello there", "max_tokens": 3,
                         "temperature": 0}, timeout=60)
    assert r.status_code == 200, r.text
    deadline = time.monotonic() + 10
    while True:
        gw = [s for s in tracing.read_span_file(files["gateway"]) if s["trace_id"] == trace_id]
        dc = [s for s in tracing.read_span_file(files["decode"]) if s["trace_id"] == trace_id]
        names = {s["name"] for s in gw + dc}
        if {"pdserve.generate", "pdserve.decode"} <= names or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    root = next(s for s in gw if s["name"] == "pdserve.generate")
    assert root["parent_span_id"] == parent
    assert any(s["name"] == "pdserve.decode" for s in dc)
