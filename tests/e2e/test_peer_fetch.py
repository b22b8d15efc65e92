"""Peer fetch (issue 31): two prefill workers A and B and one decode worker as real
processes on 127.0.0.1, the gateway's half driven by hand (tests/e2e/test_workers.py's way).
A prompt computed on A, then sent to B with peer_prefix = A: B fetches A's blocks over UCX
and computes only the rest; greedy output equals computing it; a dead peer falls back to
compute; no block is leaked on any worker.
"""
from __future__ import annotations

import os
import signal
import time
import urllib.request
import uuid

import grpc
import pytest

from engine.offline import LLM
from engine.sampling_params import SamplingParams
from protos.pdserve.v1 import decode_pb2, decode_pb2_grpc, prefill_pb2, prefill_pb2_grpc

from tests.e2e.test_workers import BS, Worker, _dest, _free_port, _greedy, _held, _prompt, _stats

pytestmark = pytest.mark.e2e
OK = 'pdserve:peer_fetch_total{result="ok",role="prefill"}'
FALLBACK = 'pdserve:peer_fetch_total{result="fallback",role="prefill"}'


def _cluster(model_dir, logs):
    started = []
    try:
        dec = Worker("decode_worker.server", model_dir, logs / "decode.log", block_size=BS, num_blocks=64,
                     kv_expiry_s=10)
        started.append(dec)
        opts = dict(block_size=BS, num_blocks=64, decode=f"127.0.0.1:{dec.port}")
        a = Worker("prefill_worker.server", model_dir, logs / "prefill_a.log", **opts)
        port = _free_port()
        b = Worker("prefill_worker.server", model_dir, logs / "prefill_b.log", metrics_port=port, **opts)
        b.metrics_port = port
        started += [a, b]
        for w in started:
            w.wait_serving(180)
        yield a, b, dec
    finally:
        for w in started:       # all at once: interpreter teardown takes seconds each
            w.terminate()
        for w in started:
            w.stop()


@pytest.fixture(scope="module")
def cluster(model_dir, tmp_path_factory):
    yield from _cluster(model_dir, tmp_path_factory.mktemp("logs"))


@pytest.fixture(scope="module")
def smollm2(tmp_path_factory):
    from pdserve.default_model import resolve_default_model
    model = str(resolve_default_model())
    for parts in _cluster(model, tmp_path_factory.mktemp("smol-logs")):
        yield parts, model


def _run(pre, dec, prompt, peer=None, max_tokens=6):
    """Decode -> KvReady -> Prefill(peer_prefix) on `pre` -> tokens. -> (tokens, PrefillResponse)."""
    rid = uuid.uuid4().hex
    sampling = _greedy(max_tokens)
    d = decode_pb2_grpc.DecodeWorkerStub(dec.channel)
    stream = d.Decode(decode_pb2.DecodeRequest(request_id=rid, prompt_token_ids=prompt, sampling=sampling),
                      timeout=30)
    kv = next(stream).kv_ready
    resp = prefill_pb2_grpc.PrefillWorkerStub(pre.channel).Prefill(prefill_pb2.PrefillRequest(
        request_id=rid, prompt_token_ids=prompt, sampling=sampling, destination=_dest(kv),
        peer_prefix=peer), timeout=30)
    assert d.SubmitFirstToken(decode_pb2.SubmitFirstTokenRequest(
        request_id=rid, first_token=resp.first_token), timeout=5).accepted
    tokens = [resp.first_token.token_id]
    for msg in stream:
        tokens += [t.token_id for t in msg.tokens.tokens]
    return tokens, resp


def _metric(w, sample: str) -> float:
    """One sample of the worker's /metrics (0 when absent)."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{w.metrics_port}/metrics", timeout=5).read().decode()
    for line in text.splitlines():
        if line.startswith(sample + " "):
            return float(line.split()[-1])
    return 0.0


def _no_blocks_held(prefills, dec, within=5.0):
    deadline = time.monotonic() + within
    while True:
        held = [_held(_stats(w, "p")) for w in prefills] + [_held(_stats(dec, "d"))]
        if not any(held):
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"blocks still held after {within}s (prefills, decode): {held}")
        time.sleep(0.05)   # poll interval of a bounded wait


def _reference(model_dir, prompts, max_tokens=6):
    llm = LLM(model_dir, block_size=BS, num_blocks=64)
    return [r.token_ids for r in llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=max_tokens,
                                                                       ignore_eos=True))]


def _fetch_then_local_hit(a, b, dec, model_dir):
    base = _prompt(48, 21)                        # 6 full blocks
    prompt2 = base + [7, 8, 9, 10, 11]
    ref1, ref2 = _reference(model_dir, [base + [5], prompt2])
    t1, r1 = _run(a, dec, base + [5])             # A computes and caches the 6 blocks
    assert t1 == ref1 and r1.num_cached_tokens == 0
    a_before, ok_before = _stats(a, "p").transfers.blocks, _metric(b, OK)
    layers = _stats(a, "p").compat.num_layers
    peer = prefill_pb2.PeerPrefix(worker_address=f"127.0.0.1:{a.port}", num_blocks=6)
    t2, r2 = _run(b, dec, prompt2, peer)
    assert t2 == ref2                              # greedy-identical to computing it
    assert r2.peer_fetched_tokens == 48 and r2.num_cached_tokens == 48   # B computed 5 tokens
    assert _stats(a, "p").transfers.blocks - a_before == 6 * layers      # A pushed, computed nothing
    assert _stats(a, "p").num_waiting == _stats(a, "p").num_running == 0
    assert _metric(b, OK) == ok_before + 1
    # the fetched blocks stay in B's cache: the same prompt again is a local hit, no fetch
    t3, r3 = _run(b, dec, prompt2, peer)
    assert t3 == ref2 and r3.num_cached_tokens == 48 and r3.peer_fetched_tokens == 0
    assert _metric(b, OK) == ok_before + 1
    _no_blocks_held((a, b), dec)


def test_fetch_from_peer_computes_only_the_suffix(cluster, model_dir):
    _fetch_then_local_hit(*cluster, model_dir)


def test_fetch_from_peer_on_smollm2(smollm2):
    (a, b, dec), model = smollm2
    _fetch_then_local_hit(a, b, dec, model)


def test_peer_without_the_blocks_or_dead_falls_back(cluster, model_dir):
    """A never saw the prompt (it refuses: NOT_FOUND), or nobody listens at the peer's address:
    B computes the prompt itself, within the fetch's deadline, counted as a fallback."""
    a, b, dec = cluster
    dead = f"127.0.0.1:{_free_port()}"
    prompts = [_prompt(40, 33), _prompt(40, 34)]
    refs = _reference(model_dir, prompts)
    for peer, prompt, ref in zip((f"127.0.0.1:{a.port}", dead), prompts, refs):
        before = _metric(b, FALLBACK)
        t0 = time.monotonic()
        tokens, resp = _run(b, dec, prompt, prefill_pb2.PeerPrefix(worker_address=peer, num_blocks=4))
        assert tokens == ref
        assert resp.peer_fetched_tokens == 0 and resp.num_cached_tokens == 0
        assert time.monotonic() - t0 < 10           # the fetch's deadline (2 s + bytes), then computed
        assert _metric(b, FALLBACK) == before + 1
    _no_blocks_held((a, b), dec)


def test_a_stalled_peer_falls_back_within_the_deadline(cluster, model_dir):
    """A holds the prefix but is stopped (SIGSTOP: connects, never answers): B waits out
    the fetch's deadline (2 s + the bytes at 100 MB/s), computes, and answers the same."""
    a, b, dec = cluster
    prompt = _prompt(40, 35)
    ref = _reference(model_dir, [prompt + [4]])[0]
    _run(a, dec, prompt)                           # A caches its 4 full blocks
    before = _metric(b, FALLBACK)
    os.kill(a.proc.pid, signal.SIGSTOP)
    try:
        t0 = time.monotonic()
        tokens, resp = _run(b, dec, prompt + [4], prefill_pb2.PeerPrefix(
            worker_address=f"127.0.0.1:{a.port}", num_blocks=5))
        elapsed = time.monotonic() - t0
        _cancelled_mid_fetch(b, dec, _prompt(40, 36), f"127.0.0.1:{a.port}")   # B lacks it: it asks A
    finally:
        os.kill(a.proc.pid, signal.SIGCONT)
    assert tokens == ref and resp.peer_fetched_tokens == 0
    assert 2.0 <= elapsed < 10
    assert _metric(b, FALLBACK) == before + 1
    _no_blocks_held((a, b), dec)


def _cancelled_mid_fetch(b, dec, prompt, peer):
    """A Prefill whose caller gives up (1 s) while B waits for the stalled peer; the decode
    stream cancelled too: every block comes back (checked by the caller)."""
    rid = uuid.uuid4().hex
    stream = decode_pb2_grpc.DecodeWorkerStub(dec.channel).Decode(decode_pb2.DecodeRequest(
        request_id=rid, prompt_token_ids=prompt, sampling=_greedy(6)), timeout=30)
    kv = next(stream).kv_ready
    with pytest.raises(grpc.RpcError) as e:
        prefill_pb2_grpc.PrefillWorkerStub(b.channel).Prefill(prefill_pb2.PrefillRequest(
            request_id=rid, prompt_token_ids=prompt, sampling=_greedy(6), destination=_dest(kv),
            peer_prefix=prefill_pb2.PeerPrefix(worker_address=peer, num_blocks=5)), timeout=1.0)
    assert e.value.code() is grpc.StatusCode.DEADLINE_EXCEEDED
    stream.cancel()
