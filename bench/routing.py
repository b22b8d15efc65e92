"""Prefix-affinity routing vs none, on a multi-turn chat workload over 2 prefill + 2 decode.

    python bench/routing.py [--model DIR] [--conversations 8] [--turns 5] [--context 256]
                            [--user-len 32] [--output-len 16]

Each conversation starts with its own context (random token ids, fixed seed) and sends
--turns requests; each resends the whole history (context, earlier user turns and the
replies it got) plus a new user turn, greedy, --output-len tokens. Conversations run at
once; turns within one run in order. The same workload runs three times, each against a
fresh system (`pdserve` processes, one torch thread each): the gateway's prefix affinity (its
default slack: the affine worker unless it has 2 more requests in flight than the least
loaded one); affinity that load never overrides (`--affinity-slack 1000000`); and no affinity
(`--affinity-slack -1000000`). Without affinity the gateway picks the least-loaded worker
(requests in flight, then the worker's queue, then most free KV blocks; fewest requests sent
only breaks exact ties): not a strict round robin, but for the prefix cache it is as blind as
one (a conversation's next turn finds its history on the chosen worker by chance).
With 2 workers whose caches hold everything, blind routing recomputes per later turn what
was added since the chosen worker last served the conversation (two turns' worth on
average), perfect affinity only the last turn's: their ratio nears 2x only as turns grow
(about 1.8x at 5 turns of the default shape, the first turn being computed by both).
Measured per run, from the workers' own counters:

- prefill tokens computed: prompt tokens the prefill workers looked up minus their prefix
  cache hits (`pdserve:prefix_cache_queries_total - hits`, both prefill workers);
- prefix-cache hit rate of each pool (hits / queries);
- KV blocks transferred (DecodeStats.transfers.blocks, both decode workers);
- TTFT p50/p99 seen by the client (first streamed token).
"""
from __future__ import annotations

import argparse
import asyncio
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

NO_AFFINITY = "-1000000"
ALWAYS_AFFINE = "1000000"


def percentile(xs, p):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, round(p / 100 * (len(xs) - 1))))]


class System:
    """2 prefill + 2 decode workers and a gateway as processes, each worker with a metrics port."""

    def __init__(self, model: str, gateway_args: list[str], log_dir: Path):
        from pdserve.launcher import free_port
        self.model, self.log_dir, self.procs = model, log_dir, []
        self.workers = {role: [(free_port(), free_port()) for _ in range(2)]
                        for role in ("prefill", "decode")}
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
        decode = ",".join(f"127.0.0.1:{p}" for p, _ in self.workers["decode"])
        for role, ports in self.workers.items():
            for i, (port, mport) in enumerate(ports):
                # prefill workers send KV only to the decode workers they are told of
                extra = ["--decode", decode] if role == "prefill" else []
                self._spawn(f"{role}-{i}", [role, "--model", model, "--port", str(port),
                                            "--metrics-port", str(mport), *extra], env)
        self.grpc = free_port()
        self._wait(lambda: all(self._serving(p) for ports in self.workers.values() for p, _ in ports))
        self._spawn("gateway", ["gateway", "--model", model, "--grpc-port", str(self.grpc),
                                "--prefill", ",".join(f"127.0.0.1:{p}" for p, _ in self.workers["prefill"]),
                                "--decode", decode,
                                *gateway_args], env)
        self._wait(lambda: self._serving(self.grpc))

    def _spawn(self, name, args, env):
        log = open(self.log_dir / f"{name}.log", "wb")
        self.procs.append(subprocess.Popen([sys.executable, "-m", "pdserve", *args], env=env,
                                           stdout=log, stderr=subprocess.STDOUT))

    def _wait(self, ready, timeout_s=300):
        deadline = time.monotonic() + timeout_s
        while not ready():
            if time.monotonic() > deadline or any(p.poll() is not None for p in self.procs):
                raise SystemExit(f"system did not start: see {self.log_dir}")
            time.sleep(0.5)

    @staticmethod
    def _serving(port) -> bool:
        import grpc
        from grpc_health.v1 import health_pb2, health_pb2_grpc
        with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
            try:
                r = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=2)
            except grpc.RpcError:
                return False
        return r.status == health_pb2.HealthCheckResponse.SERVING

    @staticmethod
    def _scrape(port) -> dict[str, float] | None:
        from prometheus_client.parser import text_string_to_metric_families
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
                text = r.read().decode()
        except OSError:
            return None
        return {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples}

    def counters(self) -> dict:
        import grpc
        from protos.pdserve.v1 import common_pb2, decode_pb2_grpc
        out = {}
        for role, ports in self.workers.items():
            scrapes = [self._scrape(m) for _, m in ports]
            out[role] = {k: sum(s.get(f"pdserve:prefix_cache_{k}_total", 0) for s in scrapes)
                         for k in ("queries", "hits")}
        blocks = 0
        for port, _ in self.workers["decode"]:
            with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
                st = decode_pb2_grpc.DecodeWorkerStub(ch).Stats(common_pb2.StatsRequest(), timeout=10)
                blocks += st.transfers.blocks
        out["kv_blocks"] = blocks
        return out

    def stop(self):
        for p in self.procs:
            p.terminate()
        for p in self.procs:
            try:
                p.wait(timeout=60)
            except subprocess.TimeoutExpired:
                p.kill()


async def conversations(grpc_address: str, args) -> list[float]:
    import grpc
    from protos.pdserve.v1 import common_pb2, generation_pb2, generation_pb2_grpc
    rng = random.Random(args.seed)
    vocab = 900
    ttfts = []
    async with grpc.aio.insecure_channel(grpc_address) as ch:
        stub = generation_pb2_grpc.GenerationStub(ch)

        async def turn(history):
            req = generation_pb2.GenerateRequest(
                token_ids=common_pb2.TokenIds(ids=history),
                sampling=common_pb2.SamplingParams(temperature=0.0, max_tokens=args.output_len,
                                                   ignore_eos=True),
                stream_options=generation_pb2.StreamOptions(stream=True))
            t0, ttft, reply = time.perf_counter(), None, []
            async for msg in stub.Generate(req, timeout=300):
                if ttft is None and msg.token_ids:
                    ttft = time.perf_counter() - t0
                reply += list(msg.token_ids)
            ttfts.append(ttft)
            return reply

        async def conversation(context):
            history = list(context)
            for _ in range(args.turns):
                history += [rng.randrange(3, vocab) for _ in range(args.user_len)]
                history += await turn(history)

        contexts = [[rng.randrange(3, vocab) for _ in range(args.context)]
                    for _ in range(args.conversations)]
        await turn(contexts[0][:8])          # warm-up, not counted
        ttfts.clear()
        await asyncio.gather(*(conversation(c) for c in contexts))
    return ttfts


def run(model, name, gateway_args, args) -> dict:
    log_dir = Path(tempfile.mkdtemp(prefix=f"routing-{name}-"))
    system = System(model, gateway_args, log_dir)
    try:
        before = system.counters()
        t0 = time.perf_counter()
        ttfts = asyncio.run(conversations(f"127.0.0.1:{system.grpc}", args))
        wall = time.perf_counter() - t0
        after = system.counters()
    finally:
        system.stop()
    d = {role: {k: after[role][k] - before[role][k] for k in ("queries", "hits")}
         for role in ("prefill", "decode")}
    return {"requests": len(ttfts),
            "prefill_computed": d["prefill"]["queries"] - d["prefill"]["hits"],
            "prefill_hit": d["prefill"]["hits"] / max(1, d["prefill"]["queries"]),
            "decode_hit": d["decode"]["hits"] / max(1, d["decode"]["queries"]),
            "kv_blocks": after["kv_blocks"] - before["kv_blocks"],
            "ttft_p50_ms": 1e3 * statistics.median(ttfts),
            "ttft_p99_ms": 1e3 * percentile(ttfts, 99), "wall_s": wall}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="")
    p.add_argument("--conversations", type=int, default=8)
    p.add_argument("--turns", type=int, default=5)
    p.add_argument("--context", type=int, default=256)
    p.add_argument("--user-len", type=int, default=32)
    p.add_argument("--output-len", type=int, default=16)
    p.add_argument("--seed", type=int, default=1)
    args = p.parse_args()
    if not args.model:
        from engine.tiny_model import ensure_default_model
        args.model = str(ensure_default_model())
    print(f"# bench/routing.py {' '.join(sys.argv[1:])}")
    print(f"# model {args.model}; {args.conversations} conversations x {args.turns} turns, "
          f"context {args.context}, user turn {args.user_len}, reply {args.output_len} tokens; "
          f"2 prefill + 2 decode workers, 1 torch thread each; cores: {os.cpu_count()}")
    results = {
        "prefix affinity": run(args.model, "affinity", [], args),
        "prefix affinity, no load override": run(args.model, "always",
                                                 ["--affinity-slack", ALWAYS_AFFINE], args),
        "no affinity (least loaded)": run(args.model, "none",
                                          ["--affinity-slack", NO_AFFINITY], args)}
    print("\n| routing | requests | prefill tokens computed | prefill hit rate | decode hit rate "
          "| KV blocks transferred | TTFT p50 ms | TTFT p99 ms | wall s |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for name, r in results.items():
        print(f"| {name} | {r['requests']} | {r['prefill_computed']:.0f} | {r['prefill_hit']:.1%} "
              f"| {r['decode_hit']:.1%} | {r['kv_blocks']} | {r['ttft_p50_ms']:.1f} "
              f"| {r['ttft_p99_ms']:.1f} | {r['wall_s']:.1f} |")
    b = results["no affinity (least loaded)"]
    print()
    for name in ("prefix affinity", "prefix affinity, no load override"):
        a = results[name]
        print(f"no affinity / {name}: prefill tokens computed "
              f"{b['prefill_computed'] / max(1, a['prefill_computed']):.2f}x, KV blocks "
              f"{b['kv_blocks'] / max(1, a['kv_blocks']):.2f}x, TTFT p50 "
              f"{b['ttft_p50_ms'] / a['ttft_p50_ms']:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
