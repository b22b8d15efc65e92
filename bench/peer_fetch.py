"""Peer fetch against computing (issue 31): one decode and two prefill workers (A, B) as
real processes on 127.0.0.1, the default model (SmolLM2-135M) unless --model.

Each round, for each prompt length, two fresh prompts of that length get the same
treatment except one field: A computes prompt P (untimed; the decode worker caches it
too), then B prefills P + a 16-token suffix, timed from the Decode call to the
PrefillResponse:
    compute   no peer_prefix: B computes the whole prompt (today's path)
    fetch     peer_prefix = A: B fetches P's blocks from A over UCX, computes the suffix
Rounds alternate the order of the two. The table prints the median and the first token's
equality between the two (greedy).

    python bench/peer_fetch.py [--model PATH] [--rounds 5] [--lengths 256,1024]
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from pdserve.launcher import free_port  # noqa: E402
from protos.pdserve.v1 import common_pb2, decode_pb2, decode_pb2_grpc, prefill_pb2, prefill_pb2_grpc  # noqa: E402

BS = 16
SUFFIX = 16


def spawn(module, model, log, **opts):
    port = free_port()
    args = [sys.executable, "-m", module, "--model-dir", model, "--port", str(port), "--host", "127.0.0.1"]
    for k, v in opts.items():
        args += [f"--{k.replace('_', '-')}", str(v)]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    proc = subprocess.Popen(args, cwd=ROOT, env=env, stdout=open(log, "wb"), stderr=subprocess.STDOUT)
    ch = grpc.insecure_channel(f"127.0.0.1:{port}")
    return proc, ch, port


def wait_serving(ch, proc, timeout=300.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError("a worker exited")
        try:
            if health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=1).status == 1:
                return
        except grpc.RpcError:
            pass
        time.sleep(0.2)   # poll interval of a bounded health wait
    raise TimeoutError("worker not serving")


def prefill(pre, dec, prompt, peer=None):
    """-> (seconds from Decode to PrefillResponse, first token, tokens fetched)."""
    rid, sampling = uuid.uuid4().hex, common_pb2.SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    t0 = time.perf_counter()
    d = decode_pb2_grpc.DecodeWorkerStub(dec)
    stream = d.Decode(decode_pb2.DecodeRequest(request_id=rid, prompt_token_ids=prompt, sampling=sampling),
                      timeout=120)
    kv = next(stream).kv_ready
    dest = prefill_pb2.KvDestination(decode_worker_id=kv.decode_worker_id, kv_endpoint=kv.kv_endpoint,
                                     transfer_id=kv.transfer_id, dst_block_ids=kv.block_ids,
                                     num_cached_tokens=kv.num_cached_tokens, compat=kv.compat,
                                     expires_at_unix_ms=kv.expires_at_unix_ms,
                                     idle_timeout_ms=kv.idle_timeout_ms,
                                     max_expires_at_unix_ms=kv.max_expires_at_unix_ms)
    resp = prefill_pb2_grpc.PrefillWorkerStub(pre).Prefill(prefill_pb2.PrefillRequest(
        request_id=rid, prompt_token_ids=prompt, sampling=sampling, destination=dest, peer_prefix=peer),
        timeout=120)
    took = time.perf_counter() - t0
    d.SubmitFirstToken(decode_pb2.SubmitFirstTokenRequest(request_id=rid, first_token=resp.first_token),
                       timeout=10)
    for _ in stream:
        pass
    return took, resp.first_token.token_id, resp.peer_fetched_tokens


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--lengths", default="256,1024")
    args = ap.parse_args()
    if not args.model:
        from pdserve.default_model import resolve_default_model
        args.model = str(resolve_default_model())
    lengths = [int(x) for x in args.lengths.split(",")]
    logs = Path(tempfile.mkdtemp(prefix="peer-fetch-"))
    blocks = 4 * (max(lengths) + SUFFIX) // BS * 2
    procs = []
    try:
        dec = spawn("decode_worker.server", args.model, logs / "d.log", block_size=BS, num_blocks=blocks)
        procs.append(dec)
        opts = dict(block_size=BS, num_blocks=blocks, decode=f"127.0.0.1:{dec[2]}")
        a = spawn("prefill_worker.server", args.model, logs / "a.log", **opts)
        b = spawn("prefill_worker.server", args.model, logs / "b.log", **opts)
        procs += [a, b]
        for p, ch, _ in procs:
            wait_serving(ch, p)
        peer = prefill_pb2.PeerPrefix(worker_address=f"127.0.0.1:{a[2]}")
        res = {(n, k): [] for n in lengths for k in ("compute", "fetch")}
        same, checks = {n: 0 for n in lengths}, []
        seed = 0
        for r in range(args.rounds):
            for n in lengths:
                order = ("compute", "fetch") if r % 2 == 0 else ("fetch", "compute")
                for kind in order:
                    seed += 1
                    prompt = [(seed * 7919 + i * 104729) % 900 + 3 for i in range(n + SUFFIX)]
                    prefill(a[1], dec[1], prompt[:n])               # A (and the decoder) hold P
                    pp = None
                    if kind == "fetch":
                        pp = prefill_pb2.PeerPrefix(worker_address=peer.worker_address, num_blocks=n // BS)
                    took, first, fetched = prefill(b[1], dec[1], prompt, pp)
                    assert (fetched == n) == (kind == "fetch"), (kind, fetched)
                    res[(n, kind)].append(took)
                    if kind == "fetch":
                        checks.append((n, prompt, first))
    finally:
        for p, ch, _ in procs:
            ch.close()
            p.terminate()
        for p, _, _ in procs:
            try:
                p.wait(20)
            except subprocess.TimeoutExpired:
                p.kill()
    # each fetched prompt's first token against the engine computing it whole, in this process
    from engine.offline import LLM
    from engine.sampling_params import SamplingParams
    llm = LLM(args.model, block_size=BS, num_blocks=blocks)
    outs = llm.generate([p for _, p, _ in checks], SamplingParams(temperature=0.0, max_tokens=1))
    for (n, _, first), out in zip(checks, outs):
        same[n] += out.token_ids[0] == first
    print(f"model: {args.model}; block size {BS}; suffix {SUFFIX} tokens; {args.rounds} rounds, "
          "order alternating; shared 2-core VM loaded by other sessions")
    print("| prompt tokens | B's path | median Decode->PrefillResponse ms | vs compute | first token = engine |")
    print("| --- | --- | --- | --- | --- |")
    for n in lengths:
        base = statistics.median(res[(n, "compute")])
        for kind in ("compute", "fetch"):
            m = statistics.median(res[(n, kind)])
            eq = f"{same[n]}/{args.rounds}" if kind == "fetch" else ""
            print(f"| {n + SUFFIX} | {kind} | {m * 1e3:.1f} | {base / m:.2f}x | {eq} |")
    return 0 if all(same[n] == args.rounds for n in lengths) else 1


if __name__ == "__main__":
    sys.exit(main())
