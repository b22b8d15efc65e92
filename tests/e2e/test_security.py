"""Security end to end: one system (1 prefill + 1 decode + gateway, real processes) with API
keys from a key file, TLS on the public ports and mTLS between the roles, certificates made
at test time (tests/certs.py).

- keys: none / wrong / revoked at run time -> 401 and UNAUTHENTICATED; per-key rpm and
  concurrency -> 429 and RESOURCE_EXHAUSTED; a good key is served
- mTLS: without a certificate of the operator's CA (none, or one of another CA) no worker RPC
  gets past the TLS handshake: no Stats, no Abort of a stream by its public id, no Decode
  reserving blocks; with the CA's certificate an Abort by the public id finds nothing
- the gateway with its certificate works: greedy output equals transformers'
- a Prefill naming a destination no known decode worker announces is refused, and nothing
  connects to it (a listener on 127.0.0.2 records accepts)
"""
from __future__ import annotations

import socket
import threading
import time
from pathlib import Path

import grpc
import httpx
import pytest

from pdserve.launcher import free_port
from protos.pdserve.v1 import (common_pb2, decode_pb2, decode_pb2_grpc, generation_pb2,
                               generation_pb2_grpc, prefill_pb2, prefill_pb2_grpc)
from tests.certs import CA
from tests.hf_models import hf_greedy

pytestmark = pytest.mark.e2e

GOOD, LIMITED, SLOW, REVOKED = "sk-good", "sk-one-at-a-time", "sk-two-per-minute", "sk-revoked"
PROMPT = list(range(5, 37))


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    d = tmp_path_factory.mktemp("pki")
    ca, rogue = CA(d / "operator"), CA(d / "rogue", "not the operator")
    return {"ca": ca.cert_path, "internal": ca.issue("internal"), "public": ca.issue("public"),
            "rogue": rogue.issue("rogue"), "colleague": ca.issue("some-other-service"), "dir": d}


@pytest.fixture(scope="module")
def key_file(tmp_path_factory):
    p = tmp_path_factory.mktemp("keys") / "keys.txt"
    p.write_text(f"# test keys\n{GOOD}\n{LIMITED} concurrency=1\n{SLOW} rpm=2\n{REVOKED}\n")
    return p


@pytest.fixture(scope="module")
def system(start_system, pki, key_file):
    http = free_port()
    launcher = start_system(1, 1, http_port=http, mtls=(pki["ca"], *pki["internal"]),
                            tls_cert=pki["public"][0], tls_key=pki["public"][1],
                            gateway_args=["--api-key-file", str(key_file), "--health-interval-s", "0.5"],
                            prefill_args=["--mtls-callers", "internal"],
                            decode_args=["--mtls-callers", "internal"])
    launcher.http_base = f"https://127.0.0.1:{http}"
    return launcher


def public_channel(system, pki) -> grpc.Channel:
    creds = grpc.ssl_channel_credentials(Path(pki["ca"]).read_bytes())
    return grpc.secure_channel(system.grpc_address, creds)


def worker_channel(address: str, pki, cert=None) -> grpc.Channel:
    """To a worker: TLS verifying it against the CA, presenting `cert` (cert, key) or none."""
    ca = Path(pki["ca"]).read_bytes()
    if cert is None:
        creds = grpc.ssl_channel_credentials(ca)
    else:
        creds = grpc.ssl_channel_credentials(ca, Path(cert[1]).read_bytes(), Path(cert[0]).read_bytes())
    return grpc.secure_channel(address, creds)


def bearer(key):
    return [("authorization", f"Bearer {key}")] if key else []


def generate(ch, key, max_tokens=8, request_id=""):
    stub = generation_pb2_grpc.GenerationStub(ch)
    req = generation_pb2.GenerateRequest(
        request_id=request_id, token_ids=common_pb2.TokenIds(ids=PROMPT),
        sampling=common_pb2.SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True))
    return stub.Generate(req, metadata=bearer(key), timeout=60)


def rest(system, pki, key, **body):
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.post(system.http_base + "/v1/completions", verify=pki["ca"], timeout=60,
                      headers=headers, json={"model": Path(system.model_dir).name, "prompt": PROMPT,
                                             "max_tokens": 4, "temperature": 0, **body})


# -- API keys ---------------------------------------------------------------------------------

def test_keys_on_rest_and_grpc(system, pki, key_file):
    for key, status in ((None, 401), ("sk-wrong", 401), (GOOD, 200)):
        r = rest(system, pki, key)
        assert r.status_code == status, r.text
        if status == 401:
            assert r.json()["error"]["type"] == "authentication_error"
    with public_channel(system, pki) as ch:
        for key in (None, "sk-wrong"):
            with pytest.raises(grpc.RpcError) as e:
                list(generate(ch, key))
            assert e.value.code() is grpc.StatusCode.UNAUTHENTICATED
        assert sum(len(m.token_ids) for m in generate(ch, GOOD)) == 8
        # health stays open (probes carry no key)
        from grpc_health.v1 import health_pb2, health_pb2_grpc
        assert health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=10).status \
            == health_pb2.HealthCheckResponse.SERVING


def test_revoked_key_is_refused_without_restart(system, pki, key_file):
    assert rest(system, pki, REVOKED).status_code == 200
    key_file.write_text(key_file.read_text().replace(f"{REVOKED}\n", ""))
    deadline = time.monotonic() + 10
    while rest(system, pki, REVOKED).status_code == 200:      # re-read within ~0.5 s
        assert time.monotonic() < deadline, "the revoked key is still accepted"
        time.sleep(0.2)
    assert rest(system, pki, REVOKED).status_code == 401
    with public_channel(system, pki) as ch, pytest.raises(grpc.RpcError) as e:
        list(generate(ch, REVOKED))
    assert e.value.code() is grpc.StatusCode.UNAUTHENTICATED
    assert rest(system, pki, GOOD).status_code == 200


def test_per_key_request_rate(system, pki):
    assert [rest(system, pki, SLOW).status_code for _ in range(2)] == [200, 200]
    r = rest(system, pki, SLOW)
    assert r.status_code == 429 and "2 requests per minute" in r.json()["error"]["message"]
    with public_channel(system, pki) as ch, pytest.raises(grpc.RpcError) as e:
        list(generate(ch, SLOW))
    assert e.value.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
    assert rest(system, pki, GOOD).status_code == 200            # other keys unaffected


def test_per_key_concurrency(system, pki):
    with public_channel(system, pki) as ch:
        stream = generate(ch, LIMITED, max_tokens=200)
        first = next(stream)                                     # its slot is held now
        assert first.token_ids
        r = rest(system, pki, LIMITED)
        assert r.status_code == 429 and "in flight" in r.json()["error"]["message"]
        with pytest.raises(grpc.RpcError) as e:
            list(generate(ch, LIMITED))
        assert e.value.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
        assert sum(len(m.token_ids) for m in stream) + len(first.token_ids) == 200
    assert rest(system, pki, LIMITED).status_code == 200         # released when it ended


# -- mTLS between the roles -------------------------------------------------------------------

def _refused(call):
    with pytest.raises(grpc.RpcError) as e:
        call()
    assert e.value.code() is grpc.StatusCode.UNAVAILABLE, e.value   # the TLS handshake failed


def test_workers_refuse_peers_without_the_operators_certificate(system, pki):
    for role in ("prefill", "decode"):
        address = system.workers(role)[0].address
        with grpc.insecure_channel(address) as plain:            # plain text: no TLS at all
            stub = (prefill_pb2_grpc.PrefillWorkerStub if role == "prefill"
                    else decode_pb2_grpc.DecodeWorkerStub)(plain)
            _refused(lambda: stub.Stats(common_pb2.StatsRequest(), timeout=5))
        for cert in (None, pki["rogue"]):                        # TLS, but no / a foreign cert
            with worker_channel(address, pki, cert) as ch:
                stub = (prefill_pb2_grpc.PrefillWorkerStub if role == "prefill"
                        else decode_pb2_grpc.DecodeWorkerStub)(ch)
                _refused(lambda: stub.Stats(common_pb2.StatsRequest(), timeout=5))
                _refused(lambda: stub.Abort(common_pb2.AbortRequest(request_id="x"), timeout=5))


def test_outsider_cannot_abort_or_reserve(system, pki):
    decode = system.workers("decode")[0].address
    with public_channel(system, pki) as ch:
        stream = generate(ch, GOOD, max_tokens=120, request_id="victim")
        got = len(next(stream).token_ids)
        with worker_channel(decode, pki, pki["rogue"]) as rogue:
            stub = decode_pb2_grpc.DecodeWorkerStub(rogue)
            _refused(lambda: stub.Abort(common_pb2.AbortRequest(request_id="victim"), timeout=5))
            _refused(lambda: list(stub.Decode(decode_pb2.DecodeRequest(
                request_id="hog", prompt_token_ids=PROMPT * 8), timeout=5)))
        # even the gateway's identity finds no stream by the public id
        with worker_channel(decode, pki, pki["internal"]) as inside:
            found = decode_pb2_grpc.DecodeWorkerStub(inside).Abort(
                common_pb2.AbortRequest(request_id="victim"), timeout=5).found
        assert not found
        got += sum(len(m.token_ids) for m in stream)
    assert got == 120                                            # the victim's stream finished


def test_a_certificate_of_the_ca_that_is_not_the_gateways_reads_stats_only(system, pki):
    """--mtls-callers internal: another holder of the operator's CA (CN some-other-service)
    passes the handshake and may read Stats, but Abort, Decode, Prefill and SubmitFirstToken
    are PERMISSION_DENIED (nothing reserved, nothing aborted)."""
    for role in ("prefill", "decode"):
        with worker_channel(system.workers(role)[0].address, pki, pki["colleague"]) as ch:
            stub = (prefill_pb2_grpc.PrefillWorkerStub if role == "prefill"
                    else decode_pb2_grpc.DecodeWorkerStub)(ch)
            stats = stub.Stats(common_pb2.StatsRequest(), timeout=5)
            assert stats.total_kv_blocks > 0 and stats.free_kv_blocks == stats.total_kv_blocks
            calls = [lambda: stub.Abort(common_pb2.AbortRequest(request_id="x"), timeout=5)]
            if role == "decode":
                calls += [lambda: list(stub.Decode(decode_pb2.DecodeRequest(
                              request_id="hog", prompt_token_ids=PROMPT), timeout=5)),
                          lambda: stub.SubmitFirstToken(decode_pb2.SubmitFirstTokenRequest(
                              request_id="hog"), timeout=5)]
            else:
                calls.append(lambda: stub.Prefill(prefill_pb2.PrefillRequest(
                    request_id="p", prompt_token_ids=PROMPT), timeout=5))
            for call in calls:
                with pytest.raises(grpc.RpcError) as e:
                    call()
                assert e.value.code() is grpc.StatusCode.PERMISSION_DENIED, e.value
                assert "some-other-service" in e.value.details()
            assert stub.Stats(common_pb2.StatsRequest(), timeout=5).free_kv_blocks == stats.total_kv_blocks


def test_greedy_output_through_mtls_equals_transformers(system, pki):
    with public_channel(system, pki) as ch:
        ids = [t for m in generate(ch, GOOD, max_tokens=12) for t in m.token_ids]
    [(ref, _)] = hf_greedy(Path(system.model_dir), [PROMPT], 12)
    assert ids == ref


# -- KV destinations --------------------------------------------------------------------------

class AcceptRecorder:
    """A TCP listener on 127.0.0.2 that records every connection made to it."""

    def __init__(self):
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.2", 0))
        self.sock.listen()
        self.sock.settimeout(0.2)
        self.port = self.sock.getsockname()[1]
        self.accepted = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self):
        while not self._stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except OSError:
                continue
            self.accepted += 1
            conn.close()

    def close(self):
        self._stop.set()
        self._thread.join(5)
        self.sock.close()


def test_prefill_refuses_a_destination_no_decode_worker_announced(system, pki):
    rec = AcceptRecorder()
    try:
        prefill = system.workers("prefill")[0].address
        decode = system.workers("decode")[0].address
        with worker_channel(decode, pki, pki["internal"]) as dch:
            compat = decode_pb2_grpc.DecodeWorkerStub(dch).Stats(common_pb2.StatsRequest(), timeout=10).compat
        with worker_channel(prefill, pki, pki["internal"]) as ch:
            stub = prefill_pb2_grpc.PrefillWorkerStub(ch)
            dest = prefill_pb2.KvDestination(
                decode_worker_id="evil", kv_endpoint=f"ucx://127.0.0.2:{rec.port}",
                transfer_id="t" * 48, dst_block_ids=list(range(len(PROMPT) // 16)), compat=compat)
            with pytest.raises(grpc.RpcError) as e:
                stub.Prefill(prefill_pb2.PrefillRequest(
                    request_id="p1", prompt_token_ids=PROMPT, destination=dest,
                    sampling=common_pb2.SamplingParams(temperature=0.0, max_tokens=1)), timeout=30)
            assert e.value.code() is grpc.StatusCode.PERMISSION_DENIED, e.value
            assert "not announced" in e.value.details()
        time.sleep(0.5)                  # a connection attempt would have arrived by now
        assert rec.accepted == 0
    finally:
        rec.close()
