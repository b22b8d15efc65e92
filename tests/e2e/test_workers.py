"""One prefill and one decode worker as real processes on 127.0.0.1; the gateway's half of
the lifecycle driven by hand with grpc stubs:

    Decode -> KvReady -> Prefill(destination) -> SubmitFirstToken -> tokens 2..n
"""
from __future__ import annotations

import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from engine.offline import LLM
from engine.sampling_params import SamplingParams
from engine.tiny_model import make_tiny_model
from protos.pdserve.v1 import common_pb2, decode_pb2, decode_pb2_grpc, prefill_pb2, prefill_pb2_grpc

pytestmark = pytest.mark.e2e
ROOT = Path(__file__).resolve().parents[2]
BS = 8


def _free_port() -> int:
    from pdserve.launcher import free_port
    return free_port()


class Worker:
    def __init__(self, module: str, model_dir: str, log_path: Path, drain_timeout_s: float = 3.0,
                 port: int = 0, **opts):
        self.port = port or _free_port()
        self.log_path = log_path
        args = [sys.executable, "-m", module, "--model-dir", model_dir, "--port", str(self.port),
                "--host", "127.0.0.1", "--drain-timeout-s", str(drain_timeout_s)]
        for k, v in opts.items():
            args += [f"--{k.replace('_', '-')}", str(v)]
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
        self._log = open(log_path, "wb")
        self.proc = subprocess.Popen(args, cwd=ROOT, env=env, stdout=self._log, stderr=subprocess.STDOUT)
        self.channel = grpc.insecure_channel(f"127.0.0.1:{self.port}")

    def wait_serving(self, timeout: float = 60.0) -> None:
        stub = health_pb2_grpc.HealthStub(self.channel)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"worker exited with {self.proc.returncode}:\n{self.log()}")
            try:
                r = stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=1.0)
                if r.status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.RpcError:
                pass
            time.sleep(0.1)   # poll interval of a bounded health wait
        raise TimeoutError(f"worker not SERVING within {timeout}s:\n{self.log()}")

    def log(self) -> str:
        self._log.flush()
        return self.log_path.read_text(errors="replace")[-4000:]

    def terminate(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()                 # SIGTERM: drain, then exit

    def stop(self) -> None:
        self.channel.close()
        self.terminate()
        try:
            self.proc.wait(20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(5)
        self._log.close()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return str(make_tiny_model(tmp_path_factory.mktemp("tiny") / "m"))


@pytest.fixture(scope="module")
def workers(model_dir, tmp_path_factory):
    logs = tmp_path_factory.mktemp("logs")
    started = []
    try:
        dec = Worker("decode_worker.server", model_dir, logs / "decode.log", block_size=BS, num_blocks=64,
                     kv_expiry_s=10)
        started.append(dec)
        bad = Worker("decode_worker.server", model_dir, logs / "decode_bs16.log", block_size=16, num_blocks=32)
        started.append(bad)
        drain_port = _free_port()       # a decode worker test_sigterm_... starts later
        pre = Worker("prefill_worker.server", model_dir, logs / "prefill.log", block_size=BS, num_blocks=64,
                     max_num_batched_tokens=16,      # prompts > 16 tokens: chunked prefill
                     decode=",".join(f"127.0.0.1:{p}" for p in (dec.port, bad.port, drain_port)))
        pre.drain_port = drain_port
        started.append(pre)
        for w in started:
            w.wait_serving()
        yield pre, dec, bad
    finally:
        for w in started:       # all at once: interpreter teardown takes seconds each
            w.terminate()
        for w in started:
            w.stop()


def _greedy(max_tokens=10, **kw):
    return common_pb2.SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **kw)


def _dest(kv: decode_pb2.KvReady) -> prefill_pb2.KvDestination:
    return prefill_pb2.KvDestination(decode_worker_id=kv.decode_worker_id, kv_endpoint=kv.kv_endpoint,
                                     transfer_id=kv.transfer_id, dst_block_ids=kv.block_ids,
                                     num_cached_tokens=kv.num_cached_tokens, compat=kv.compat)


def _generate(pre, dec, prompt, sampling, rid=None):
    """The gateway's job, by hand. Returns (all tokens, PrefillResponse, last chunk, KvReady)."""
    rid = rid or uuid.uuid4().hex
    d = decode_pb2_grpc.DecodeWorkerStub(dec.channel)
    p = prefill_pb2_grpc.PrefillWorkerStub(pre.channel)
    stream = d.Decode(decode_pb2.DecodeRequest(request_id=rid, prompt_token_ids=prompt, sampling=sampling),
                      timeout=30)
    first_msg = next(stream)
    assert first_msg.WhichOneof("msg") == "kv_ready"
    kv = first_msg.kv_ready
    resp = p.Prefill(prefill_pb2.PrefillRequest(request_id=rid, prompt_token_ids=prompt, sampling=sampling,
                                                destination=_dest(kv)), timeout=30)
    assert d.SubmitFirstToken(decode_pb2.SubmitFirstTokenRequest(
        request_id=rid, first_token=resp.first_token), timeout=5).accepted
    tokens, last = [resp.first_token.token_id], None
    for msg in stream:
        tokens += [t.token_id for t in msg.tokens.tokens]
        last = msg.tokens
    return tokens, resp, last, kv


def _stats(w, kind):
    stub = (prefill_pb2_grpc.PrefillWorkerStub if kind == "p" else decode_pb2_grpc.DecodeWorkerStub)(w.channel)
    return stub.Stats(common_pb2.StatsRequest(), timeout=5)


def _held(stats) -> int:
    return stats.total_kv_blocks - stats.free_kv_blocks


def _prompt(n, seed=0):
    return [(seed * 7 + i * 13) % 900 + 3 for i in range(n)]


def test_greedy_tokens_match_engine_llm(workers, model_dir):
    pre, dec, _ = workers
    prompts = [_prompt(21, 1), _prompt(5, 2), _prompt(40, 3)]
    ref = LLM(model_dir, block_size=BS, num_blocks=64).generate(
        prompts, SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True))
    for prompt, r in zip(prompts, ref):
        tokens, resp, last, kv = _generate(pre, dec, prompt, _greedy(10, logprobs=2))
        assert tokens == r.token_ids
        assert abs(resp.first_token.logprob - r.logprobs[0]) < 1e-4
        assert len(resp.first_token.top_logprobs) == 2
        assert last.finish_reason == common_pb2.FINISH_REASON_LENGTH
        assert last.usage.prompt_tokens == len(prompt) and last.usage.completion_tokens == 10
        assert resp.blocks_transferred == len(kv.block_ids) * 4        # 4 layers
        assert kv.compat.block_size == BS


def test_shared_prefix_transfers_fewer_blocks(workers):
    pre, dec, _ = workers
    base = _prompt(32, 9)                       # 4 full blocks
    t0 = _stats(dec, "d").transfers.blocks
    _, r1, _, kv1 = _generate(pre, dec, base + [5, 6, 7], _greedy(3))
    t1 = _stats(dec, "d").transfers.blocks
    _, r2, _, kv2 = _generate(pre, dec, base + [8, 9], _greedy(3))
    t2 = _stats(dec, "d").transfers.blocks
    assert kv1.num_cached_tokens == 0 and kv2.num_cached_tokens == 32
    assert len(kv2.block_ids) == 1 < len(kv1.block_ids) == 5
    assert r2.blocks_transferred < r1.blocks_transferred
    assert t2 - t1 < t1 - t0
    assert t2 - t1 == r2.blocks_transferred


def _wait_no_held_blocks(pre, dec, within=2.0):
    deadline = time.monotonic() + within
    while True:
        p, d = _stats(pre, "p"), _stats(dec, "d")
        if _held(p) == 0 and _held(d) == 0 and d.num_running == 0 and d.num_waiting == 0:
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"blocks still held after {within}s: prefill {_held(p)}, decode {_held(d)}")
        time.sleep(0.05)


def test_abort_mid_stream_frees_blocks_on_both_workers(workers):
    pre, dec, _ = workers
    rid = "abort-" + uuid.uuid4().hex
    d = decode_pb2_grpc.DecodeWorkerStub(dec.channel)
    p = prefill_pb2_grpc.PrefillWorkerStub(pre.channel)
    prompt = _prompt(30, 4)
    sampling = _greedy(400)
    stream = d.Decode(decode_pb2.DecodeRequest(request_id=rid, prompt_token_ids=prompt, sampling=sampling),
                      timeout=60)
    kv = next(stream).kv_ready
    resp = p.Prefill(prefill_pb2.PrefillRequest(request_id=rid, prompt_token_ids=prompt, sampling=sampling,
                                                destination=_dest(kv)), timeout=30)
    assert d.SubmitFirstToken(decode_pb2.SubmitFirstTokenRequest(request_id=rid, first_token=resp.first_token)).accepted
    got = next(stream)
    assert got.tokens.tokens                                  # streaming
    assert d.Abort(common_pb2.AbortRequest(request_id=rid, reason="test"), timeout=5).found
    rest = list(stream)
    assert rest[-1].tokens.finish_reason == common_pb2.FINISH_REASON_ABORT
    _wait_no_held_blocks(pre, dec)
    # cancelling the call (client gone) frees everything too
    stream = d.Decode(decode_pb2.DecodeRequest(request_id=rid + "c", prompt_token_ids=prompt,
                                               sampling=sampling), timeout=60)
    next(stream)
    stream.cancel()
    _wait_no_held_blocks(pre, dec)


def test_reservation_without_kv_expires(workers):
    pre, dec, _ = workers
    d = decode_pb2_grpc.DecodeWorkerStub(dec.channel)
    before = _stats(dec, "d").transfers.expirations
    stream = d.Decode(decode_pb2.DecodeRequest(
        request_id="expire-" + uuid.uuid4().hex, prompt_token_ids=_prompt(20, 5), sampling=_greedy(4),
        kv_timeout_ms=300, kv_failure_policy=decode_pb2.KV_FAILURE_POLICY_FAIL), timeout=10)
    kv = next(stream).kv_ready
    assert kv.block_ids
    msgs = list(stream)                                       # nobody prefills
    assert msgs[-1].tokens.finish_reason == common_pb2.FINISH_REASON_ERROR
    assert "expired" in msgs[-1].tokens.error
    after = _stats(dec, "d")
    assert after.transfers.expirations == before + 1
    assert _held(after) == 0


def test_recompute_policy_falls_back_and_matches(workers, model_dir):
    pre, dec, _ = workers
    d = decode_pb2_grpc.DecodeWorkerStub(dec.channel)
    prompt = _prompt(19, 6)
    ref = LLM(model_dir, block_size=BS, num_blocks=64).generate(
        [prompt], SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True))[0]
    stream = d.Decode(decode_pb2.DecodeRequest(
        request_id="recompute-" + uuid.uuid4().hex, prompt_token_ids=prompt, sampling=_greedy(6),
        kv_timeout_ms=300, kv_failure_policy=decode_pb2.KV_FAILURE_POLICY_RECOMPUTE), timeout=20)
    next(stream)
    msgs = list(stream)
    tokens = [t.token_id for m in msgs for t in m.tokens.tokens]
    assert tokens == ref.token_ids                            # first token unknown: all from decode
    assert msgs[-1].tokens.finish_reason == common_pb2.FINISH_REASON_LENGTH
    assert _held(_stats(dec, "d")) == 0


def test_compat_mismatch_is_failed_precondition(workers):
    pre, _, bad = workers
    d = decode_pb2_grpc.DecodeWorkerStub(bad.channel)
    p = prefill_pb2_grpc.PrefillWorkerStub(pre.channel)
    prompt = _prompt(20, 7)
    rid = "compat-" + uuid.uuid4().hex
    stream = d.Decode(decode_pb2.DecodeRequest(request_id=rid, prompt_token_ids=prompt, sampling=_greedy(3)),
                      timeout=20)
    kv = next(stream).kv_ready
    with pytest.raises(grpc.RpcError) as e:
        p.Prefill(prefill_pb2.PrefillRequest(request_id=rid, prompt_token_ids=prompt, sampling=_greedy(3),
                                             destination=_dest(kv)), timeout=10)
    assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "block_size" in e.value.details() and "prefill" in e.value.details() and "decode" in e.value.details()
    # the handshake itself also rejects a lying destination (compat copied from a good peer)
    good = _stats(pre, "p").compat
    with pytest.raises(grpc.RpcError) as e:
        p.Prefill(prefill_pb2.PrefillRequest(request_id=rid + "b", prompt_token_ids=prompt, sampling=_greedy(3),
                                             destination=prefill_pb2.KvDestination(
                                                 kv_endpoint=kv.kv_endpoint, transfer_id=kv.transfer_id,
                                                 dst_block_ids=list(range(3)), compat=good)), timeout=10)
    assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION, e.value.details()
    assert d.Abort(common_pb2.AbortRequest(request_id=rid), timeout=5).found
    list(stream)
    assert _held(_stats(pre, "p")) == 0
    assert _held(_stats(bad, "d")) == 0
    assert pre.proc.poll() is None and bad.proc.poll() is None


def test_invalid_arguments(workers):
    pre, dec, _ = workers
    p = prefill_pb2_grpc.PrefillWorkerStub(pre.channel)
    d = decode_pb2_grpc.DecodeWorkerStub(dec.channel)
    with pytest.raises(grpc.RpcError) as e:
        next(d.Decode(decode_pb2.DecodeRequest(request_id="bad1", prompt_token_ids=[1, 2],
                                               sampling=common_pb2.SamplingParams(top_p=2.0)), timeout=5))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "top_p" in e.value.details()
    with pytest.raises(grpc.RpcError) as e:
        p.Prefill(prefill_pb2.PrefillRequest(request_id="bad2", prompt_token_ids=[1] * 5000,
                                             sampling=_greedy(2)), timeout=5)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "context length" in e.value.details()


def test_sigterm_lets_a_decoding_request_finish(workers, model_dir, tmp_path):
    """SIGTERM while a request is decoding: it runs to its last token (finish LENGTH), new
    work is refused with UNAVAILABLE meanwhile, and the worker then exits 0."""
    pre, _, _ = workers
    # The drain deadline is sized from the work, not from this machine's speed: 600 tokens
    # of the tiny model take a few seconds even on a loaded machine; the drain allows 120 s.
    dec = Worker("decode_worker.server", model_dir, tmp_path / "decode_drain.log", block_size=BS,
                 drain_timeout_s=120, num_blocks=256, kv_expiry_s=10,
                 port=pre.drain_port)           # a decode worker the prefill worker knows
    try:
        dec.wait_serving()
        d = decode_pb2_grpc.DecodeWorkerStub(dec.channel)
        p = prefill_pb2_grpc.PrefillWorkerStub(pre.channel)
        rid, prompt, n = "drain-" + uuid.uuid4().hex, _prompt(20, 9), 600
        stream = d.Decode(decode_pb2.DecodeRequest(request_id=rid, prompt_token_ids=prompt,
                                                   sampling=_greedy(n)), timeout=60)
        kv = next(stream).kv_ready
        resp = p.Prefill(prefill_pb2.PrefillRequest(request_id=rid, prompt_token_ids=prompt,
                                                    sampling=_greedy(n), destination=_dest(kv)), timeout=30)
        d.SubmitFirstToken(decode_pb2.SubmitFirstTokenRequest(request_id=rid, first_token=resp.first_token),
                           timeout=5)
        got = len(next(stream).tokens.tokens)          # decoding has started
        dec.terminate()
        with pytest.raises(grpc.RpcError) as e:         # refused while the old one runs
            deadline = time.monotonic() + 5
            while time.monotonic() < deadline:
                next(d.Decode(decode_pb2.DecodeRequest(request_id="late-" + uuid.uuid4().hex,
                                                       prompt_token_ids=[1, 2, 3], sampling=_greedy(2)),
                              timeout=5))
                time.sleep(0.02)                         # until the SIGTERM is handled
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE and "draining" in e.value.details()
        last = None
        for msg in stream:
            got += len(msg.tokens.tokens)
            last = msg.tokens
        assert last.finish_reason == common_pb2.FINISH_REASON_LENGTH and 1 + got == n
        assert dec.proc.wait(30) == 0
    finally:
        dec.stop()


def test_sigterm_drains_in_flight_then_exits(workers):
    """Last test: drains the block-size-16 decode worker. In flight: a reservation that
    expires after 1.5 s (nobody prefills it), unless the drain hands it back first. New calls
    are refused with UNAVAILABLE."""
    _, _, w = workers
    d = decode_pb2_grpc.DecodeWorkerStub(w.channel)
    stream = d.Decode(decode_pb2.DecodeRequest(
        request_id="drain-" + uuid.uuid4().hex, prompt_token_ids=_prompt(20, 8), sampling=_greedy(3),
        kv_timeout_ms=1500, kv_failure_policy=decode_pb2.KV_FAILURE_POLICY_FAIL), timeout=20)
    next(stream)
    w.terminate()
    health = health_pb2_grpc.HealthStub(w.channel)
    deadline = time.monotonic() + 5
    while health.Check(health_pb2.HealthCheckRequest(), timeout=2).status == health_pb2.HealthCheckResponse.SERVING:
        assert time.monotonic() < deadline, "still SERVING 5 s after SIGTERM"
        time.sleep(0.05)
    with pytest.raises(grpc.RpcError) as e:
        next(d.Decode(decode_pb2.DecodeRequest(request_id="late", prompt_token_ids=[1, 2, 3],
                                               sampling=_greedy(2)), timeout=5))
    assert e.value.code() == grpc.StatusCode.UNAVAILABLE and "draining" in e.value.details()
    # the in-flight call ends cleanly: handed back to its caller with UNAVAILABLE "worker
    # draining" (decode_worker/handoff.py: the gateway migrates it), or, had its reservation
    # lapsed first, with FINISH_REASON_ERROR; never left hanging
    try:
        msgs = list(stream)
        assert msgs[-1].tokens.finish_reason == common_pb2.FINISH_REASON_ERROR
    except grpc.RpcError as e:
        assert e.code() == grpc.StatusCode.UNAVAILABLE and "worker draining" in e.details()
    assert w.proc.wait(20) == 0
