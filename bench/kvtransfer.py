"""KV transfer throughput between two processes on this machine, beside its ceilings.

    python bench/kvtransfer.py [--runs 5] [--sizes 64K,1M,16M,256M] [--skip-perftest]

Rows (GB/s, median of --runs, same run, same machine):
  ucx_perftest tag_bw (C)    the ceiling on the same UCX transport (tcp; and sm if it runs),
                             median of --perftest-runs (3) process pairs
  pdserve UcxTransport       kvtransfer.ucx Connection.send/recv, what KVSender/KVReceiver use
  shared memory, 2 copies    writer -> multiprocessing.shared_memory -> reader
  asyncio TCP socket         loop.sock_sendall / sock_recv_into on 127.0.0.1
then the time to ship one request's KV through KVSender -> KVReceiver: 2k tokens of a
Llama-3.1-8B-shaped cache (32 layers, 8 kv heads, head_dim 128, bf16, block 16 = 256 MiB),
pushed layer by layer from a non-asyncio thread as the engine's per-layer hook does.
"""
from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import os
import re
import socket
import statistics
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
os.environ.setdefault("OMP_NUM_THREADS", "1")

import numpy as np  # noqa: E402

SIZES = {"64K": 64 << 10, "1M": 1 << 20, "16M": 16 << 20, "256M": 256 << 20}
CTRL = struct.Struct("<QQ")  # (message size, messages) ; size 0 = stop


def iters_for(size: int) -> int:
    """Messages per timed run: about 32 MiB, at least 2."""
    return max(2, min(256, (32 << 20) // size))


def gbps(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e9


# ----------------------------------------------------------------------------- ucx_perftest
def perftest(tls: str, size: int, runs: int, timeout: float = 30) -> float | None:
    """Median GB/s of `ucx_perftest -t tag_bw` (a server and a client process)."""
    import libucx
    d = Path(libucx.__file__).parent
    exe = d / "bin" / "ucx_perftest"
    env = dict(os.environ, LD_LIBRARY_PATH=f"{d / 'lib'}:{os.environ.get('LD_LIBRARY_PATH', '')}",
               UCX_TLS=f"{tls},self")
    n = str(iters_for(size))
    results = []
    for _ in range(runs):
        port = free_port()
        server = subprocess.Popen([str(exe), "-p", str(port)], env=env,
                                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            deadline = time.monotonic() + timeout
            while time.monotonic() < deadline:   # the client fails fast until the server listens
                out = subprocess.run([str(exe), "127.0.0.1", "-p", str(port), "-t", "tag_bw",
                                      "-s", str(size), "-n", n, "-w", "2"], env=env,
                                     capture_output=True, text=True, timeout=timeout)
                m = re.search(r"^Final:\s+\d+\s+\S+\s+\S+\s+\S+\s+(\S+)", out.stdout, re.M)
                if m:
                    results.append(float(m.group(1)) * (1 << 20) / 1e9)  # MB/s is MiB/s
                    break
                if server.poll() is not None:
                    return None
                time.sleep(0.05)
        finally:
            server.kill()
            server.wait(5)
    return statistics.median(results) if results else None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ----------------------------------------------------------------------------- pdserve UCX
def _ucx_sink(pipe) -> None:
    from kvtransfer.ucx import UcxTransport

    async def main():
        t, done = UcxTransport(), asyncio.Event()

        async def handler(c):
            while True:
                size, n = CTRL.unpack(await c.recv(CTRL.size))
                if size == 0:
                    break
                buf = np.empty(size, dtype=np.uint8)
                for _ in range(n):
                    await c.recv(into=buf)
                await c.send(b"ack")
            done.set()
        pipe.send(await t.listen(handler))
        await asyncio.wait_for(done.wait(), 170)
        await t.close()
    asyncio.run(main())


async def _ucx_source(addr: str, sizes: list[int], runs: int) -> dict[int, float]:
    from kvtransfer.ucx import UcxTransport
    t = UcxTransport()
    c = await t.connect(addr)
    out = {}
    for size in sizes:
        buf, n, times = np.random.randint(0, 255, size, dtype=np.uint8), iters_for(size), []
        for r in range(runs + 1):                # +1: warm-up
            await c.send(CTRL.pack(size, n))
            t0 = time.perf_counter()
            for _ in range(n):
                await c.send(buf)
            await c.recv(3)
            if r:
                times.append(time.perf_counter() - t0)
        out[size] = gbps(size * n, statistics.median(times))
    await c.send(CTRL.pack(0, 0))
    await t.close()
    return out


# ----------------------------------------------------------------------------- asyncio TCP
def _tcp_sink(pipe) -> None:
    async def main():
        loop = asyncio.get_running_loop()
        srv = socket.socket()
        srv.bind(("127.0.0.1", 0))
        srv.listen(1)
        srv.setblocking(False)
        pipe.send(srv.getsockname()[1])
        c, _ = await asyncio.wait_for(loop.sock_accept(srv), 60)
        while True:
            ctrl = bytearray(CTRL.size)
            await _recv_exact(loop, c, memoryview(ctrl))
            size, n = CTRL.unpack(ctrl)
            if size == 0:
                break
            buf = memoryview(bytearray(size))
            for _ in range(n):
                await _recv_exact(loop, c, buf)
            await loop.sock_sendall(c, b"ack")
        c.close()
        srv.close()
    asyncio.run(main())


async def _recv_exact(loop, sock, view: memoryview) -> None:
    got = 0
    while got < len(view):
        k = await loop.sock_recv_into(sock, view[got:])
        if k == 0:
            raise ConnectionError("peer closed")
        got += k


async def _tcp_source(port: int, sizes: list[int], runs: int) -> dict[int, float]:
    loop = asyncio.get_running_loop()
    s = socket.socket()
    s.setblocking(False)
    await asyncio.wait_for(loop.sock_connect(s, ("127.0.0.1", port)), 10)
    out = {}
    for size in sizes:
        buf, n, times = np.random.randint(0, 255, size, dtype=np.uint8).data, iters_for(size), []
        for r in range(runs + 1):
            await loop.sock_sendall(s, CTRL.pack(size, n))
            t0 = time.perf_counter()
            for _ in range(n):
                await loop.sock_sendall(s, buf)
            await _recv_exact(loop, s, memoryview(bytearray(3)))
            if r:
                times.append(time.perf_counter() - t0)
        out[size] = gbps(size * n, statistics.median(times))
    await loop.sock_sendall(s, CTRL.pack(0, 0))
    s.close()
    return out


# ----------------------------------------------------------------------------- shared memory
def _shm_sink(name: str, pipe) -> None:
    from multiprocessing import shared_memory
    shm = shared_memory.SharedMemory(name=name)
    try:
        while True:
            size = pipe.recv()
            if size == 0:
                break
            src = np.ndarray((size,), np.uint8, shm.buf)
            dst = np.empty(size, np.uint8)
            while pipe.recv():                   # one message: copy it out, then ack
                np.copyto(dst, src)
                pipe.send(1)
            del src
    finally:
        shm.close()


def shm_bench(ctx, sizes: list[int], runs: int) -> dict[int, float]:
    from multiprocessing import shared_memory
    shm = shared_memory.SharedMemory(create=True, size=max(sizes))
    a, b = ctx.Pipe()
    p = ctx.Process(target=_shm_sink, args=(shm.name, b), daemon=True)
    p.start()
    out = {}
    try:
        for size in sizes:
            a.send(size)
            src, dst, n, times = np.random.randint(0, 255, size, dtype=np.uint8), \
                np.ndarray((size,), np.uint8, shm.buf), iters_for(size), []
            for r in range(runs + 1):
                t0 = time.perf_counter()
                for _ in range(n):
                    np.copyto(dst, src)          # copy 1: into shared memory
                    a.send(1)                    # copy 2 happens in the reader
                    if not a.poll(30):
                        raise TimeoutError("shared-memory reader stopped answering")
                    a.recv()
                if r:
                    times.append(time.perf_counter() - t0)
            a.send(0)
            del dst
            out[size] = gbps(size * n, statistics.median(times))
        a.send(0)
    finally:
        p.join(10)
        if p.is_alive():
            p.kill()
        shm.close()
        shm.unlink()
    return out


# ----------------------------------------------------------------------------- KV handover
LLAMA8B = dict(layers=32, kv_heads=8, head_dim=128, block_size=16, tokens=2048)


def _handover_shape(extra_blocks=8):
    n = LLAMA8B["tokens"] // LLAMA8B["block_size"]
    return (LLAMA8B["layers"], 2, n + extra_blocks, LLAMA8B["block_size"], LLAMA8B["kv_heads"],
            LLAMA8B["head_dim"]), n


def _handover_sink(pipe) -> None:
    import torch
    from kvtransfer import CompatKey, KVReceiver
    from kvtransfer.ucx import UcxTransport
    shape, n = _handover_shape()

    async def main():
        cache = torch.zeros(shape, dtype=torch.bfloat16)
        rx = KVReceiver(cache, CompatKey.from_cache(cache, "llama-3.1-8b"), UcxTransport(), expiry_s=60)
        pipe.send(await rx.start())
        loop = asyncio.get_running_loop()
        while True:
            tid = await loop.run_in_executor(None, pipe.recv)
            if tid is None:
                break
            rx.reserve(tid, list(range(n - 1, -1, -1)))   # any block order works
            pipe.send("reserved")
            res = await rx.wait(tid, 60)
            pipe.send((res.state.value, time.time()))
        await rx.close()
    asyncio.run(main())


async def _handover_source(addr: str, pipe, runs: int) -> list[tuple[float, float]]:
    import torch
    from kvtransfer import CompatKey, KVSender
    from kvtransfer.ucx import UcxTransport
    shape, n = _handover_shape()
    src = torch.randn(shape, dtype=torch.float32).to(torch.bfloat16)
    tx = KVSender(src, CompatKey.from_cache(src, "llama-3.1-8b"), UcxTransport())
    loop = asyncio.get_running_loop()
    results = []
    for r in range(runs + 1):
        tid = f"bench-{r}"
        pipe.send(tid)
        assert await loop.run_in_executor(None, pipe.recv) == "reserved"
        h = await tx.open(tid, addr, list(range(8, 8 + n)), list(range(n - 1, -1, -1)))
        gather = [0.0]

        def engine_thread():                     # the per-layer hook after each layer's KV
            for layer in range(shape[0]):
                g0 = time.perf_counter()
                tx.push_layer_threadsafe(h, layer)
                gather[0] += time.perf_counter() - g0
        t0 = time.time()
        th = threading.Thread(target=engine_thread)
        th.start()
        await loop.run_in_executor(None, th.join, 60)
        await tx.finish(h, 60)
        state, t_done = await loop.run_in_executor(None, pipe.recv)
        assert state == "done", state
        if r:
            results.append((t_done - t0, gather[0]))
    pipe.send(None)
    await tx.close()
    return results


# ----------------------------------------------------------------------------- main
def with_child(ctx, target, fn, *args):
    a, b = ctx.Pipe()
    p = ctx.Process(target=target, args=(b,), daemon=True)
    p.start()
    try:
        if not a.poll(60):
            raise TimeoutError(f"{target.__name__} did not start")
        return asyncio.run(asyncio.wait_for(fn(a.recv(), *args), 170))
    finally:
        p.join(10)
        if p.is_alive():
            p.kill()
            p.join(5)


def progress(t_start: float, what: str, vals: dict) -> None:
    print(f"[{time.perf_counter() - t_start:5.1f}s] {what}: "
          + ", ".join("n/a" if v is None else f"{v:.2f}" for v in vals.values()), file=sys.stderr, flush=True)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--sizes", default="64K,1M,16M,256M")
    ap.add_argument("--perftest-runs", type=int, default=3, help="runs per ceiling point (median)")
    ap.add_argument("--skip-perftest", action="store_true")
    args = ap.parse_args(argv)
    names = args.sizes.split(",")
    sizes = [SIZES[s] for s in names]
    import kvtransfer.ucx  # noqa: F401  (applies the UCX_* defaults to os.environ)
    ctx = mp.get_context("spawn")
    t_start = time.perf_counter()
    rows: dict[str, dict[int, float | None]] = {}
    if not args.skip_perftest:
        for tls, label in (("tcp", "ucx_perftest tag_bw, tcp (ceiling)"), ("sm", "ucx_perftest tag_bw, sm")):
            rows[label] = {s: perftest(tls, s, args.perftest_runs) for s in sizes}
            progress(t_start, label, rows[label])
    rows["pdserve UcxTransport (tcp)"] = with_child(ctx, _ucx_sink, _ucx_source, sizes, args.runs)
    progress(t_start, "pdserve UcxTransport", rows["pdserve UcxTransport (tcp)"])
    rows["shared memory, 2 copies"] = shm_bench(ctx, sizes, args.runs)
    progress(t_start, "shared memory", rows["shared memory, 2 copies"])
    rows["asyncio TCP socket"] = with_child(ctx, _tcp_sink, _tcp_source, sizes, args.runs)
    progress(t_start, "asyncio TCP", rows["asyncio TCP socket"])

    a, b = ctx.Pipe()
    p = ctx.Process(target=_handover_sink, args=(b,), daemon=True)
    p.start()
    try:
        if not a.poll(60):
            raise TimeoutError("handover receiver did not start")
        addr = a.recv()
        handover = asyncio.run(asyncio.wait_for(_handover_source(addr, a, args.runs), 170))
    finally:
        p.join(10)
        if p.is_alive():
            p.kill()

    fmt = lambda v: "n/a" if v is None else f"{v:.2f}"  # noqa: E731
    print(f"\nKV transfer between two processes on 127.0.0.1, GB/s, median of {args.runs} "
          f"(perftest: {args.perftest_runs}) "
          f"(UCX_TLS={os.environ.get('UCX_TLS', 'tcp')}, UCX_RNDV_SCHEME={os.environ['UCX_RNDV_SCHEME']}, "
          f"UCXPY_PROGRESS_MODE={os.environ['UCXPY_PROGRESS_MODE']})\n")
    print("| path | " + " | ".join(names) + " |")
    print("| --- |" + " --- |" * len(names))
    for label, vals in rows.items():
        print(f"| {label} | " + " | ".join(fmt(vals.get(s)) for s in sizes) + " |")
    ceiling = rows.get("ucx_perftest tag_bw, tcp (ceiling)")
    if ceiling:
        ours = rows["pdserve UcxTransport (tcp)"]
        print("| pdserve / perftest tcp | " + " | ".join(
            "n/a" if not ceiling.get(s) else f"{ours[s] / ceiling[s]:.0%}" for s in sizes) + " |")

    shape, n = _handover_shape()
    total = shape[0] * 2 * n * shape[3] * shape[4] * shape[5] * 2
    secs = statistics.median(t for t, _ in handover)
    gather = statistics.median(g for _, g in handover)
    print(f"\nKV handover, {LLAMA8B['tokens']} tokens, Llama-3.1-8B shape ({shape[0]} layers x "
          f"{n} blocks, {total / 2**20:.0f} MiB bf16, one {total / shape[0] / 2**20:.0f} MiB message per "
          f"layer), median of {args.runs}\n")
    print("| what | value |")
    print("| --- | --- |")
    print(f"| first push -> receiver DONE | {secs * 1e3:.1f} ms ({gbps(total, secs):.2f} GB/s) |")
    print(f"| gather copies in the engine thread (32 layers) | {gather * 1e3:.1f} ms |")
    big = ceiling.get(SIZES["16M"]) if ceiling else None
    if big:
        print(f"| share of perftest tcp at 16 MiB | {gbps(total, secs) / big:.0%} |")
    print(f"\nbench wall time {time.perf_counter() - t_start:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
