"""Fuzzing the public and internal APIs of one running system (1 prefill + 1 decode).

- REST: schemathesis over /openapi.json, every check on, a bounded number of examples per
  operation: no response may be a 5xx (the other checks' findings are printed).
- gRPC: random and mutated messages (valid ones with bytes flipped, inserted, cut) sent to
  every method of Generation, PrefillWorker and DecodeWorker: every call ends with a status
  from the allowed set, every process stays up, a valid request is still served, and every
  KV block is back in both pools.
"""
from __future__ import annotations

import random
from collections import Counter
import shutil
import subprocess
import xml.etree.ElementTree as ET

import grpc
import pytest

from pdserve.launcher import free_port
from protos.pdserve.v1 import (common_pb2, decode_pb2, decode_pb2_grpc, generation_pb2,
                               generation_pb2_grpc, prefill_pb2)
from tests.helpers import wait_until

pytestmark = pytest.mark.e2e

ALLOWED = {grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND,
           grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.RESOURCE_EXHAUSTED,
           grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.DEADLINE_EXCEEDED,
           grpc.StatusCode.CANCELLED}


@pytest.fixture(scope="module")
def system(start_system):
    port = free_port()
    launcher = start_system(1, 1, http_port=port, decode_args=["--kv-expiry-s", "3"],
                            gateway_args=["--health-interval-s", "0.5"])
    launcher.http_base = f"http://127.0.0.1:{port}"
    return launcher


@pytest.mark.skipif(shutil.which("schemathesis") is None, reason="needs schemathesis (dev extra)")
def test_schemathesis_finds_no_server_error(system, tmp_path):
    junit = tmp_path / "junit.xml"
    cmd = ["schemathesis", "run", system.http_base + "/openapi.json", "--checks", "all",
           "--max-examples", "25", "--seed", "1", "--generation-database", "none",
           "--request-timeout", "60", "--report", "junit", "--report-junit-path", str(junit)]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=900, cwd=tmp_path)  # its cache
    print(out.stdout[-6000:])
    assert junit.exists(), out.stdout[-3000:] + out.stderr[-3000:]
    cases = ET.parse(junit).getroot().iter("testcase")
    failures = [(c.get("name"), f.get("message") or f.text or "")
                for c in cases for f in list(c.findall("failure")) + list(c.findall("error"))]
    server = [f for f in failures if "Server error" in f[1] or "500" in f[1].split("\n")[0]]
    assert not server, server


def _mutate(rng: random.Random, data: bytes) -> bytes:
    b = bytearray(data)
    for _ in range(rng.randint(1, 4)):
        op = rng.randrange(4)
        if op == 0 and b:
            b[rng.randrange(len(b))] ^= 1 << rng.randrange(8)
        elif op == 1:
            b.insert(rng.randrange(len(b) + 1), rng.randrange(256))
        elif op == 2 and b:
            del b[rng.randrange(len(b)):][:rng.randint(1, 8)]
        else:
            b += bytes(rng.randrange(256) for _ in range(rng.randint(1, 16)))
    return bytes(b)


def _seeds(compat) -> dict[str, tuple[bool, list[bytes]]]:
    """method path -> (server streaming, valid messages to mutate)."""
    sp = common_pb2.SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    ids = list(range(5, 40))
    dest = prefill_pb2.KvDestination(kv_endpoint="ucx://127.0.0.1:1", transfer_id="x" * 48,
                                     dst_block_ids=[0, 1, 2], compat=compat)
    return {
        "/pdserve.v1.Generation/Generate": (True, [generation_pb2.GenerateRequest(
            token_ids=common_pb2.TokenIds(ids=ids), sampling=sp).SerializeToString(),
            generation_pb2.GenerateRequest(text="Hello there", sampling=sp).SerializeToString()]),
        "/pdserve.v1.Generation/Tokenize": (False, [generation_pb2.TokenizeRequest(
            text="Hello").SerializeToString()]),
        "/pdserve.v1.Generation/ListModels": (False, [b""]),
        "/pdserve.v1.PrefillWorker/Prefill": (False, [prefill_pb2.PrefillRequest(
            request_id="f", prompt_token_ids=ids, sampling=sp, destination=dest).SerializeToString()]),
        "/pdserve.v1.PrefillWorker/Abort": (False, [common_pb2.AbortRequest(request_id="f").SerializeToString()]),
        "/pdserve.v1.DecodeWorker/Decode": (True, [decode_pb2.DecodeRequest(
            request_id="f", prompt_token_ids=ids, sampling=sp, kv_timeout_ms=500).SerializeToString()]),
        "/pdserve.v1.DecodeWorker/SubmitFirstToken": (False, [decode_pb2.SubmitFirstTokenRequest(
            request_id="f").SerializeToString()]),
        "/pdserve.v1.DecodeWorker/Abort": (False, [common_pb2.AbortRequest(request_id="f").SerializeToString()]),
    }


def _call(ch: grpc.Channel, method: str, streaming: bool, payload: bytes):
    ident = dict(request_serializer=lambda b: b, response_deserializer=lambda b: b)
    try:
        if streaming:
            for _ in ch.unary_stream(method, **ident)(payload, timeout=10):
                pass
        else:
            ch.unary_unary(method, **ident)(payload, timeout=10)
        return grpc.StatusCode.OK, ""
    except grpc.RpcError as e:
        return e.code(), e.details()


def test_grpc_fuzz_public_and_internal(system):
    rng = random.Random(1234)
    addr = {"Generation": system.grpc_address, "PrefillWorker": system.workers("prefill")[0].address,
            "DecodeWorker": system.workers("decode")[0].address}
    with grpc.insecure_channel(addr["DecodeWorker"]) as dch:
        compat = decode_pb2_grpc.DecodeWorkerStub(dch).Stats(common_pb2.StatsRequest(), timeout=10).compat
    bad, seen = [], Counter()
    for method, (streaming, seeds) in _seeds(compat).items():
        with grpc.insecure_channel(addr[method.split("/")[1].split(".")[-1]]) as ch:
            for i in range(30):
                seed = rng.choice(seeds)
                payload = (bytes(rng.randrange(256) for _ in range(rng.randint(0, 64))) if i % 5 == 0
                           else _mutate(rng, seed))
                code, details = _call(ch, method, streaming, payload)
                seen[code.name] += 1
                if code not in ALLOWED:
                    bad.append((method, payload.hex()[:80], code.name, details[:200]))
    print(dict(seen))
    assert not bad, bad
    assert seen["INVALID_ARGUMENT"] and seen["OK"], seen      # both kinds were reached
    assert all(c.popen.poll() is None for c in system.children)    # nothing crashed
    # still serving, and every KV block came back
    with grpc.insecure_channel(system.grpc_address) as ch:
        out = list(generation_pb2_grpc.GenerationStub(ch).Generate(generation_pb2.GenerateRequest(
            token_ids=common_pb2.TokenIds(ids=list(range(5, 30))),
            sampling=common_pb2.SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)), timeout=60))
    assert sum(len(m.token_ids) for m in out) == 4
    from protos.pdserve.v1 import prefill_pb2_grpc
    for role, stub_cls in (("prefill", prefill_pb2_grpc.PrefillWorkerStub),
                           ("decode", decode_pb2_grpc.DecodeWorkerStub)):
        with grpc.insecure_channel(system.workers(role)[0].address) as ch:
            stub = stub_cls(ch)

            def free():
                st = stub.Stats(common_pb2.StatsRequest(), timeout=10)
                return st.free_kv_blocks == st.total_kv_blocks, st
            wait_until(free, 15, f"every {role} KV block free")
