"""Prefix-affinity routing vs none, on a multi-turn chat workload over 2 prefill + 2 decode.

    python bench/routing.py [--model DIR] [--conversations 16] [--turns 8] [--context 256]
                            [--shared-prefix 0] [--stagger-ms 0] [--user-len 32]
                            [--output-len 16] [--regimes pressure roomy]
                            [--working-set-ratio 1.5] [--routing none default 2 8 16 always]

Each conversation starts with its own context (random token ids, fixed seed; the first
--shared-prefix of them the same in all, a system prompt) and sends --turns requests; each
resends the whole history (context, earlier user turns and the replies it got) plus a new
user turn, greedy, --output-len tokens. Conversations run at once (or one every
--stagger-ms); turns within one run in order. For each regime and --routing spec the
workload runs against a fresh system (`pdserve` processes, one torch thread each, the same
flags but the gateway's affinity ones):

    none         --prefix-routing none: the least-loaded worker (requests in flight, then the worker's
                 queue, then most free KV blocks; fewest requests sent breaks exact ties).
                 Not a strict round robin, but as blind to the prefix cache as one.
    default      the gateway's defaults (its KV-event index scored against load,
                 gateway/affinity.py, within --affinity-slack, --affinity-slack-ratio; decode
                 workers: --decode-affinity-slack)
    SLACK[:R]    the cached prefill worker may win while it has at most SLACK more requests in
                 flight than the least-loaded one, or at most R times as many (R unset: SLACK
                 alone); decode workers: the smaller of SLACK and --decode-affinity-slack
    always       affinity that load never overrides

Regimes (the prefill workers' KV cache; decode workers keep their default size):

- roomy: the workers' default cache, which holds every conversation many times over. Blind
  routing recomputes per later turn what was added since the chosen worker last served the
  conversation (two turns' worth on average over 2 workers), perfect affinity only the last
  turn's; with the first turn computed by both, their ratio nears 2x only as turns grow
  (about 1.9x at 8 turns of the default shape).
- pressure: `--num-blocks` per prefill worker = working set / --working-set-ratio, the
  working set being every conversation's last prompt in blocks (printed in the header).
  With each conversation on one worker, each holds half the working set and it fits; blind
  routing copies every conversation onto both, the working set no longer fits one worker's
  cache, LRU evicts histories before their next turn and blind routing recomputes them:
  the ratio can pass 2x. This is the regime cache-aware routers are built for (SGLang's
  cache-aware router, vLLM production-stack's prefix-aware routing). It assumes the
  conversations are alive at once: with a large --stagger-ms few are, and the cache fits.

Measured per run, from the workers' own counters:

- prefill tokens computed: prompt tokens the prefill workers looked up minus their prefix
  cache hits (`pdserve:prefix_cache_queries_total - hits`, both prefill workers);
- prefix-cache hit rate of each pool (hits / queries), and the busier prefill worker's share
  of the prompt tokens looked up (50%: even; 100%: one worker did all);
- KV blocks transferred (DecodeStats.transfers.blocks, both decode workers);
- TTFT p50/p99 seen by the client (first streamed token).

Every process shares this machine's cores: a worker that takes all the load is not slower
for it the way a worker on its own accelerator would be, so TTFT here shows the cost of
load overriding affinity (recomputed prompts) more than its benefit (spreading load).
"""
from __future__ import annotations

import argparse
import asyncio
import math
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

def routing(spec: str) -> tuple[str, list[str]]:
    """A --routing spec (see the module docstring) -> (table label, gateway flags)."""
    from gateway.config import GatewayConfig
    if spec == "none":
        return "no affinity (least loaded)", ["--prefix-routing", "none"]
    if spec == "always":
        return "affinity, never overridden", ["--affinity-slack", "1000000",
                                              "--decode-affinity-slack", "1000000"]
    if spec == "default":
        d = GatewayConfig(model="")
        ratio = f" or {d.affinity_slack_ratio:g}x" if d.affinity_slack_ratio else ""
        return f"affinity, default (slack {d.affinity_slack}{ratio})", []
    slack, _, ratio = spec.partition(":")
    return (f"affinity, slack {int(slack)}" + (f" or {float(ratio):g}x" if ratio else ""),
            ["--affinity-slack", str(int(slack)), "--affinity-slack-ratio", ratio or "0"])


def percentile(xs, p):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, round(p / 100 * (len(xs) - 1))))]


class System:
    """2 prefill + 2 decode workers and a gateway as processes, each worker with a metrics port."""

    def __init__(self, model: str, gateway_args: list[str], worker_args: dict[str, list[str]],
                 log_dir: Path):
        self.model, self.log_dir, self.procs = model, log_dir, []
        try:
            self._start(model, gateway_args, worker_args)
        except BaseException:
            self.stop()
            raise

    def _start(self, model, gateway_args, worker_args):
        from pdserve.launcher import free_port
        self.workers = {role: [(free_port(), free_port()) for _ in range(2)]
                        for role in ("prefill", "decode")}
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
        decode = ",".join(f"127.0.0.1:{p}" for p, _ in self.workers["decode"])
        for role, ports in self.workers.items():
            for i, (port, mport) in enumerate(ports):
                # prefill workers send KV only to the decode workers they are told of
                extra = ["--decode", decode] if role == "prefill" else []
                self._spawn(f"{role}-{i}", [role, "--model", model, "--port", str(port),
                                            "--metrics-port", str(mport), *extra,
                                            *worker_args[role]], env)
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
        from protos.pdserve.v1 import common_pb2, decode_pb2_grpc, prefill_pb2_grpc
        out = {}
        for role, ports in self.workers.items():
            scrapes = [self._scrape(m) for _, m in ports]
            out[role] = {k: sum(s.get(f"pdserve:prefix_cache_{k}_total", 0) for s in scrapes)
                         for k in ("queries", "hits")}
            out[role]["each"] = [s.get("pdserve:prefix_cache_queries_total", 0) for s in scrapes]
        blocks = 0
        for port, _ in self.workers["decode"]:
            with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
                st = decode_pb2_grpc.DecodeWorkerStub(ch).Stats(common_pb2.StatsRequest(), timeout=10)
                blocks += st.transfers.blocks
        out["kv_blocks"] = blocks
        out["prefill_cache_blocks"] = []
        for port, _ in self.workers["prefill"]:
            with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
                st = prefill_pb2_grpc.PrefillWorkerStub(ch).Stats(common_pb2.StatsRequest(),
                                                                  timeout=10)
                out["prefill_cache_blocks"].append(st.total_kv_blocks)
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

        async def conversation(i, context):
            await asyncio.sleep(i * args.stagger_ms / 1e3)
            history = list(context)
            for _ in range(args.turns):
                history += [rng.randrange(3, vocab) for _ in range(args.user_len)]
                history += await turn(history)

        shared = [rng.randrange(3, vocab) for _ in range(args.shared_prefix)]
        contexts = [shared + [rng.randrange(3, vocab) for _ in range(args.context - len(shared))]
                    for _ in range(args.conversations)]
        await turn(contexts[0][:8])          # warm-up, not counted
        ttfts.clear()
        await asyncio.gather(*(conversation(i, c) for i, c in enumerate(contexts)))
    return ttfts


def run(model, gateway_args, worker_args, args) -> dict:
    log_dir = Path(tempfile.mkdtemp(prefix="routing-"))
    system = System(model, gateway_args, worker_args, log_dir)
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
    each = [a - b for a, b in zip(after["prefill"]["each"], before["prefill"]["each"])]
    return {"requests": len(ttfts), "prefill_cache_blocks": after["prefill_cache_blocks"],
            "prefill_busier": max(each) / max(1, sum(each)),
            "prefill_computed": d["prefill"]["queries"] - d["prefill"]["hits"],
            "prefill_hit": d["prefill"]["hits"] / max(1, d["prefill"]["queries"]),
            "decode_hit": d["decode"]["hits"] / max(1, d["decode"]["queries"]),
            "kv_blocks": after["kv_blocks"] - before["kv_blocks"],
            "ttft_p50_ms": 1e3 * statistics.median(ttfts),
            "ttft_p99_ms": 1e3 * percentile(ttfts, 99), "wall_s": wall}


def working_set_blocks(args) -> int:
    """KV blocks all conversations' histories take on one worker holding them all: the
    blocks of each conversation's last prompt (earlier prompts are its prefixes)."""
    last_prompt = args.context + args.turns * args.user_len + (args.turns - 1) * args.output_len
    shared = args.shared_prefix // args.block_size           # cached once, not per conversation
    return args.conversations * (-(-last_prompt // args.block_size) - shared) + shared


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="")
    p.add_argument("--conversations", type=int, default=16)
    p.add_argument("--turns", type=int, default=8)
    p.add_argument("--context", type=int, default=256)
    p.add_argument("--shared-prefix", type=int, default=0,
                   help="the first tokens of every context are the same (a system prompt)")
    p.add_argument("--stagger-ms", type=float, default=0,
                   help="conversation i starts i x this after the first (0: all at once)")
    p.add_argument("--user-len", type=int, default=32)
    p.add_argument("--output-len", type=int, default=16)
    p.add_argument("--block-size", type=int, default=16, help="every worker's --block-size")
    p.add_argument("--regimes", nargs="+", choices=("pressure", "roomy"),
                   default=["pressure", "roomy"])
    p.add_argument("--working-set-ratio", type=float, default=1.5,
                   help="pressure regime: working set / one prefill worker's KV cache")
    p.add_argument("--routing", nargs="+", default=["none", "default", "2", "8", "16", "always"],
                   help="none | default | SLACK | SLACK:RATIO | always (module docstring)")
    p.add_argument("--seed", type=int, default=1)
    args = p.parse_args()
    if "none" not in args.routing:
        p.error("--routing needs none: the baseline of the ratios")
    if not 0 <= args.shared_prefix <= args.context:
        p.error("--shared-prefix must be in 0..--context")
    if not args.model:
        from engine.tiny_model import ensure_default_model
        args.model = str(ensure_default_model())
    working_set = working_set_blocks(args)
    print(f"# bench/routing.py {' '.join(sys.argv[1:])}")
    print(f"# model {args.model}; {args.conversations} conversations x {args.turns} turns, "
          f"one started every {args.stagger_ms:g} ms; context {args.context} "
          f"({args.shared_prefix} shared by all), user turn {args.user_len}, reply "
          f"{args.output_len} tokens; 2 prefill + 2 decode workers, 1 torch thread each; "
          f"cores: {os.cpu_count()}")
    print(f"# working set: {working_set} KV blocks of {args.block_size} tokens (every "
          f"conversation's last prompt)")
    for regime in args.regimes:
        common = ["--block-size", str(args.block_size)]
        worker_args = {"prefill": list(common), "decode": list(common)}
        if regime == "pressure":
            num_blocks = math.ceil(working_set / args.working_set_ratio)
            worker_args["prefill"] += ["--num-blocks", str(num_blocks)]
        load = os.getloadavg()[0]
        results = {}
        for spec in args.routing:
            label, gateway_args = routing(spec)
            results[label] = run(args.model, gateway_args, worker_args, args)
        cache = results[routing("none")[0]]["prefill_cache_blocks"]
        sized = "--num-blocks" if regime == "pressure" else "the workers' default size"
        print(f"\n## {regime}: prefill KV cache {' + '.join(map(str, cache))} blocks ({sized}); "
              f"working set / one worker's cache = {working_set / cache[0]:.2f}x; 1-min load "
              f"average {load:.1f} before, {os.getloadavg()[0]:.1f} after")
        print("\n| routing | requests | prefill tokens computed | prefill hit rate "
              "| busier prefill worker's share | decode hit rate | KV blocks transferred "
              "| TTFT p50 ms | TTFT p99 ms | wall s |")
        print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
        for label, r in results.items():
            print(f"| {label} | {r['requests']} | {r['prefill_computed']:.0f} "
                  f"| {r['prefill_hit']:.1%} | {r['prefill_busier']:.0%} | {r['decode_hit']:.1%} "
                  f"| {r['kv_blocks']} | {r['ttft_p50_ms']:.1f} | {r['ttft_p99_ms']:.1f} "
                  f"| {r['wall_s']:.1f} |")
        b = results.pop(routing("none")[0])
        print()
        for label, a in results.items():
            print(f"no affinity / {label}: prefill tokens computed "
                  f"{b['prefill_computed'] / max(1, a['prefill_computed']):.2f}x, KV blocks "
                  f"{b['kv_blocks'] / max(1, a['kv_blocks']):.2f}x, TTFT p50 "
                  f"{b['ttft_p50_ms'] / a['ttft_p50_ms']:.2f}x, TTFT p99 "
                  f"{b['ttft_p99_ms'] / a['ttft_p99_ms']:.2f}x")
        sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
