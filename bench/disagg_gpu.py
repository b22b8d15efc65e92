"""GPU prefill and the KV handover on one GPU (written for an H200), bounded in time.

    python bench/disagg_gpu.py [--layers 32] [--prompts 2048,8192] [--runs 3] [--budget-s 65]

Sections, each in the same run so every figure has its baseline beside it; a section that
fails prints its error and the script goes on; a section is skipped once the budget is spent:

  1. ceiling    bf16 matmul 8192^3 (torch)
  2. attention  pdserve's paged prefill attention (Triton, autotuned) vs torch SDPA's flash
                backend on the same K/V (contiguous), 4 x 4096 and 1 x 16384 tokens, causal,
                GQA 32/8, head dim 128; causal FLOPs = 2 matmuls x 2 x S^2/2 x heads x dim
  3. prefill    the whole prefill step of a Llama-3.1-8B-shaped model (random bf16 weights
                made on the device, --layers of its 32), one prompt per step, TFLOP/s
                (linear layers + causal attention) vs the ceiling
  4. TTFT       the same engine doing the prefill itself (colocated, no KV connector) vs
                pushing each layer, as it is written, to a KVReceiver in a second process
                (disaggregated), with staging "host" (pinned host buffers, UCX tcp) and
                "device" (GPU buffers, UCX cuda_ipc). TTFT(P) = prompt in -> every layer sent
                (when the prefill worker returns the first token); ready(D) = prompt in ->
                the receiver's transfer DONE (the decode worker may admit the request);
                exposed handover = prefill end -> ready(D), negative when the last layer
                arrived before the step finished (final norm, logits, sampling).
                CLOCK_MONOTONIC is one clock for both processes.
  5. bandwidth  one prompt's KV (every layer, one message per layer) pushed on its own, vs
                `ucx_perftest -t tag_bw` (the libucx wheel's) at the same message size with
                the same transports and memory type

The receiver process holds only a KV cache (no model): the exposed handover is measured to
the point where the decode worker could run its first step, not through that step.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

# both processes: GPU buffers over cuda_ipc within the node, tcp for the handshake and for
# host staging (set before any UCX context exists; an operator's UCX_TLS wins)
os.environ.setdefault("UCX_TLS", "tcp,cuda_copy,cuda_ipc")

LLAMA_8B = dict(architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=4096,
                intermediate_size=14336, num_attention_heads=32, num_key_value_heads=8,
                head_dim=128, vocab_size=128256, rms_norm_eps=1e-5, rope_theta=500000.0,
                max_position_embeddings=16384, tie_word_embeddings=False, torch_dtype="bfloat16")
BS = 16
T_START = time.monotonic()


def left(budget_s: float) -> float:
    return budget_s - (time.monotonic() - T_START)


def section(name: str, budget_s: float, need_s: float, fn, *args):
    """Run one section; never raises. -> fn's result or None."""
    if left(budget_s) < need_s:
        print(f"\n[{name}] skipped: {left(budget_s):.0f} s of the budget left, needs ~{need_s:.0f} s",
              flush=True)
        return None
    t = time.monotonic()
    try:
        out = fn(*args)
        print(f"[{name}] took {time.monotonic() - t:.1f} s", flush=True)
        return out
    except Exception as e:  # a benchmark section fails soft: report it and go on
        print(f"\n[{name}] FAILED after {time.monotonic() - t:.1f} s: {type(e).__name__}: {e}", flush=True)
        traceback.print_exc(limit=4)
        return None


def cuda_time(fn, iters: int = 5, warmup: int = 1) -> float:
    """Median seconds of fn() by CUDA events."""
    import torch
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        fn()
        e.record()
        e.synchronize()
        times.append(s.elapsed_time(e) / 1e3)
    return statistics.median(times)


# ----------------------------------------------------------------------------- 1, 2
def matmul_ceiling() -> float:
    import torch
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    t = cuda_time(lambda: a @ b, iters=10, warmup=3)
    tf = 2 * 8192 ** 3 / t / 1e12
    print(f"\nbf16 matmul 8192^3: {t * 1e3:.2f} ms, {tf:.0f} TFLOP/s (the ceiling below)", flush=True)
    return tf


def attention(ceiling: float | None) -> None:
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from engine.kernels.prefill_attention import paged_prefill_attention
    hq, hkv, d = 32, 8, 128
    rows = []
    for B, S in ((4, 4096), (1, 16384)):
        g = torch.Generator(device="cuda").manual_seed(0)
        q = torch.randn(B * S, hq, d, device="cuda", dtype=torch.bfloat16, generator=g)
        nblk = S // BS
        kc = torch.randn(B * nblk, BS, hkv, d, device="cuda", dtype=torch.bfloat16, generator=g)
        vc = torch.randn_like(kc)
        table = torch.randperm(B * nblk, device="cuda", generator=g).view(B, nblk).int()
        cu = (torch.arange(B + 1, device="cuda") * S).int()
        ctx = torch.full((B,), S, device="cuda", dtype=torch.int32)
        out = torch.empty_like(q)
        ours = lambda: paged_prefill_attention(q, kc, vc, table, cu, ctx, d ** -0.5,  # noqa: E731
                                                max_q_len=S, out=out)
        t_tune = time.monotonic()
        ours()                                   # autotunes on the first long chunk
        torch.cuda.synchronize()
        t_tune = time.monotonic() - t_tune
        t_ours = cuda_time(ours)
        qd = q.view(B, S, hq, d).transpose(1, 2)
        kd = kc[table.long()].flatten(1, 2).transpose(1, 2)      # [B, hkv, S, d]
        vd = vc[table.long()].flatten(1, 2).transpose(1, 2)
        note = "enable_gqa"
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            try:
                ref = F.scaled_dot_product_attention(qd, kd, vd, is_causal=True, enable_gqa=True)
            except RuntimeError:
                kd, vd = kd.repeat_interleave(hq // hkv, 1), vd.repeat_interleave(hq // hkv, 1)
                note = "K/V expanded to 32 heads"
                ref = F.scaled_dot_product_attention(qd, kd, vd, is_causal=True)
            t_sdpa = cuda_time(lambda: F.scaled_dot_product_attention(
                qd, kd, vd, is_causal=True, **({"enable_gqa": True} if note == "enable_gqa" else {})))
        err = (out.view(B, S, hq, d).transpose(1, 2).float() - ref.float()).abs().max().item()
        flops = 4 * B * S * S / 2 * hq * d
        rows.append((f"{B} x {S}", t_ours, t_sdpa, flops, err, t_tune, note))
        del q, kc, vc, kd, vd, qd, out, ref
    print("\nPrefill attention, causal, GQA 32/8, head dim 128, bf16, block size 16 "
          "(pdserve reads K/V through a shuffled block table; SDPA flash reads them contiguous)\n")
    print("| tokens | pdserve ms | pdserve TFLOP/s | SDPA flash ms | SDPA TFLOP/s | pdserve / SDPA "
          "| pdserve / matmul ceiling | max abs err vs SDPA | first call (autotune) s |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for name, to, ts, fl, err, tt, note in rows:
        share = f"{fl / to / 1e12 / ceiling:.0%}" if ceiling else "n/a"
        print(f"| {name} | {to * 1e3:.2f} | {fl / to / 1e12:.0f} | {ts * 1e3:.2f} | {fl / ts / 1e12:.0f} "
              f"| {ts / to:.2f}x | {share} | {err:.3f} | {tt:.1f} |")
    print(f"(SDPA GQA: {rows[0][6]})", flush=True)


# ----------------------------------------------------------------------------- engine
def build_engine(layers: int, max_tokens: int, kv_connector, device: str = "cuda"):
    """An LLMEngine over a Llama-3.1-8B-shaped model with random bf16 weights made on the
    GPU (no checkpoint: the loader is replaced for this process)."""
    import torch
    import engine.llm_engine as le
    from engine.config import EngineConfig, EngineOptions
    from engine.kernels.rope import build_cos_sin_cache
    from engine.models import build

    def random_model(config, dtype, device, backend):
        torch.manual_seed(0)
        prev = torch.get_default_dtype()
        torch.set_default_dtype(dtype)
        try:
            with torch.device(device):
                model = build(config, backend)
        finally:
            torch.set_default_dtype(prev)
        model.cos_sin = build_cos_sin_cache(config.head_dim, config.max_model_len + 1,
                                            config.rope_theta, config.rope_scaling, device)
        return model.eval().requires_grad_(False)

    d = Path(tempfile.mkdtemp(prefix="llama8b-shape-"))
    (d / "config.json").write_text(json.dumps(dict(LLAMA_8B, num_hidden_layers=layers)))
    le.load_model = random_model
    nblocks = 2 * (max_tokens // BS + 1)
    opts = EngineOptions.of(device=device, dtype="bfloat16", block_size=BS, num_blocks=nblocks,
                            enable_prefix_caching=False, max_num_batched_tokens=max_tokens,
                            max_num_seqs=4)
    return le.LLMEngine(EngineConfig.build(d, opts), kv_connector)


def step_flops(layers: int, S: int) -> float:
    c = LLAMA_8B
    h, inter, hd = c["hidden_size"], c["intermediate_size"], c["head_dim"]
    qkv = h * (c["num_attention_heads"] + 2 * c["num_key_value_heads"]) * hd
    linear = qkv + c["num_attention_heads"] * hd * h + 3 * h * inter
    attn = 4 * S * S / 2 * c["num_attention_heads"] * hd
    return layers * (2 * S * linear + attn) + 2 * h * c["vocab_size"]   # + the sampled row's logits


def prompt(S: int, seed: int) -> list[int]:
    import random
    r = random.Random(seed)
    return [r.randrange(3, LLAMA_8B["vocab_size"]) for _ in range(S)]


def colocated(engine, S: int, runs: int, seed: int) -> list[float]:
    """Seconds from add_request to the first token, the engine stepping in this thread."""
    from engine.sampling_params import SamplingParams
    out = []
    for i in range(runs + 1):                         # the first run warms up (JIT, autotune)
        rid = f"co-{S}-{i}"
        t0 = time.monotonic()
        engine.add_request(rid, prompt(S, seed + i), SamplingParams(temperature=0.0, max_tokens=1),
                           prefill_only=True)
        while engine.has_unfinished_requests():
            engine.step()
        if i:
            out.append(time.monotonic() - t0)
        engine.release(rid)
    return out


# ----------------------------------------------------------------------------- receiver process
def _receiver_main(pipe, shape, model_name, modes, device) -> None:
    """The decode side: a KV cache (no model) and one KVReceiver per staging mode."""
    import torch
    from kvtransfer import CompatKey, KVReceiver
    from kvtransfer.ucx import UcxTransport

    async def main():
        if device == "cuda":
            torch.cuda.set_device(0)      # UCX's CUDA transports use this thread's context
        cache = torch.zeros(shape, dtype=torch.bfloat16, device=device)
        rxs = {m: KVReceiver(cache, CompatKey.from_cache(cache, model_name),
                             UcxTransport(device_memory=True), expiry_s=60, staging=m) for m in modes}
        pipe.send({m: await rx.start() for m, rx in rxs.items()})
        stamps: dict[str, asyncio.Task] = {}

        async def stamp(rx, tid):
            res = await rx.wait(tid, 60)
            return res.state.value, time.monotonic(), res.reason

        while True:
            cmd = await asyncio.to_thread(pipe.recv)
            if cmd[0] == "stop":
                break
            if cmd[0] == "reserve":
                _, mode, tid, blocks = cmd
                rxs[mode].reserve(tid, blocks, 60)
                stamps[tid] = asyncio.get_running_loop().create_task(stamp(rxs[mode], tid))
                pipe.send("ok")
            elif cmd[0] == "wait":
                _, tid, blocks = cmd
                state, t_done, reason = await asyncio.wait_for(stamps.pop(tid), 70)
                pipe.send((state, t_done, reason, layer_sums(cache, blocks)))
        for rx in rxs.values():
            await rx.close()

    asyncio.run(main())


def layer_sums(cache, blocks) -> list[float]:
    """An exact checksum per layer of the given blocks (bf16 bits summed in float64)."""
    import torch
    idx = torch.tensor(blocks, dtype=torch.long, device=cache.device)
    return [cache[layer][:, idx].view(torch.int16).double().sum().item() for layer in range(cache.shape[0])]


class Decoder:
    """The parent's end of the receiver process."""

    def __init__(self, shape, model_name, modes, device):
        ctx = mp.get_context("spawn")
        self.pipe, child = ctx.Pipe()
        self.proc = ctx.Process(target=_receiver_main, args=(child, shape, model_name, modes, device),
                                daemon=True)
        self.proc.start()
        self.addrs = None

    async def call(self, msg, timeout: float = 15):
        self.pipe.send(msg)
        if not await asyncio.to_thread(self.pipe.poll, timeout):
            raise TimeoutError(f"receiver process did not answer {msg[0]!r} within {timeout} s")
        return self.pipe.recv()

    async def start(self, timeout: float = 60):
        if not await asyncio.to_thread(self.pipe.poll, timeout):
            raise TimeoutError("receiver process did not start")
        self.addrs = self.pipe.recv()

    def stop(self):
        try:
            self.pipe.send(("stop",))
        except OSError:
            pass
        self.proc.join(3)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(5)


async def disaggregated(engine, push, dec: Decoder, mode: str, S: int, runs: int, seed: int):
    """Per run: (ttft_p, ready_d, exposed, prefill) seconds; checks the first run's KV arrived."""
    from engine.sampling_params import SamplingParams
    nblk = -(-S // BS)
    dst = list(range(nblk))
    out = []
    for i in range(runs + 1):                         # the first run warms up and is checked
        rid = tid = f"dis-{mode}-{S}-{i}"
        assert await dec.call(("reserve", mode, tid, dst)) == "ok"
        p = await push.open(rid, tid, dec.addrs[mode], dst, 0)
        t0 = time.monotonic()
        engine.add_request(rid, prompt(S, seed + i), SamplingParams(temperature=0.0, max_tokens=1),
                           prefill_only=True)
        while engine.has_unfinished_requests():
            await asyncio.to_thread(engine.step)
        t1 = time.monotonic()
        await push.finish(p, 60)
        t2 = time.monotonic()
        state, t3, reason, sums = await dec.call(("wait", tid, dst))
        if state != "done":
            raise RuntimeError(f"transfer {tid}: {state} {reason}")
        if i == 0:
            mine = layer_sums(engine.kv_cache, engine.requests[rid].block_ids[:nblk])
            if mine != sums:
                raise RuntimeError(f"{mode} staging: the received KV differs from the prefill's")
        else:
            out.append((t2 - t0, t3 - t0, t3 - t1, t1 - t0))
        engine.release(rid)
    return out


async def handover_bandwidth(engine, push, dec: Decoder, mode: str, S: int, runs: int) -> float:
    """GB/s of one prompt's KV (all layers) pushed on its own: first push -> DONE."""
    from kvtransfer.wire import block_bytes
    tx = push.sender
    nblk = -(-S // BS)
    blocks = list(range(nblk))
    layers = engine.kv_cache.shape[0]
    rates = []
    for i in range(runs + 1):
        tid = f"bw-{mode}-{S}-{i}"
        assert await dec.call(("reserve", mode, tid, blocks)) == "ok"
        h = await tx.open(tid, dec.addrs[mode], blocks, blocks)
        t0 = time.monotonic()
        for layer in range(layers):
            tx.push_layer_threadsafe(h, layer)
        await tx.finish(h, 60)
        state, t_done, reason, _ = await dec.call(("wait", tid, []))
        if state != "done":
            raise RuntimeError(f"transfer {tid}: {state} {reason}")
        if i:
            rates.append(layers * nblk * block_bytes(engine.kv_cache) / (t_done - t0) / 1e9)
    return statistics.median(rates)


def perftest(size: int, device: bool, timeout: float = 20) -> float | None:
    """GB/s of ucx_perftest tag_bw between two processes on 127.0.0.1, host or CUDA memory."""
    import socket
    import libucx
    d = Path(libucx.__file__).parent
    exe = d / "bin" / "ucx_perftest"
    env = dict(os.environ, LD_LIBRARY_PATH=f"{d / 'lib'}:{os.environ.get('LD_LIBRARY_PATH', '')}",
               UCX_TLS=f"{os.environ['UCX_TLS']},self" if device else "tcp,self")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mem = ["-m", "cuda,cuda"] if device else []
    server = subprocess.Popen([str(exe), "-p", str(port)], env=env,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:      # the client fails fast until the server listens
            out = subprocess.run([str(exe), "127.0.0.1", "-p", str(port), "-t", "tag_bw", "-s", str(size),
                                  "-n", "20", "-w", "2", *mem], env=env, capture_output=True, text=True,
                                 timeout=max(1.0, deadline - time.monotonic()))
            m = re.search(r"^Final:\s+\d+\s+\S+\s+\S+\s+\S+\s+(\S+)", out.stdout, re.M)
            if m:
                return float(m.group(1)) * (1 << 20) / 1e9          # MB/s there is MiB/s
            if server.poll() is not None:
                print(f"ucx_perftest server exited: {out.stderr.strip()[-300:]}")
                return None
            time.sleep(0.1)
        return None
    finally:
        server.kill()
        server.wait(5)


# ----------------------------------------------------------------------------- 3, 4, 5
def engine_sections(args, ceiling: float | None) -> None:
    import torch
    from kvtransfer.wire import block_bytes
    from prefill_worker.kv_push import KVPush

    sizes = [int(s) for s in args.prompts.split(",")]
    modes = ["host", "device"] if args.device == "cuda" else ["host"]
    slow = 1 if args.device == "cuda" else 30          # deadlines for the CPU dry run
    t = time.monotonic()
    engine = build_engine(args.layers, max(sizes), None, args.device)
    print(f"\nengine: Llama-3.1-8B shape, {args.layers} of 32 layers, random bf16 made on {args.device}, "
          f"block size {BS}, one prompt per step (no chunking), built in {time.monotonic() - t:.1f} s",
          flush=True)
    shape = tuple(engine.kv_cache.shape)
    dec = Decoder(shape, engine.config.model.name, modes, args.device)   # starts while we measure
    try:
        co = {}
        for S in sizes:
            co[S] = section(f"colocated {S}", args.budget_s, 5, colocated, engine, S, args.runs, 100)
        print(f"\nPrefill step (one {args.layers}-layer step per prompt, wall time incl. scheduling "
              f"and sampling)\n")
        print("| prompt | step ms | TFLOP/s | share of matmul ceiling |")
        print("| --- | ---: | ---: | ---: |")
        for S in sizes:
            if co.get(S):
                t = statistics.median(co[S])
                tf = step_flops(args.layers, S) / t / 1e12
                share = f"{tf / ceiling:.0%}" if ceiling else "n/a"
                print(f"| {S} | {t * 1e3:.1f} | {tf:.0f} | {share} |")
        sys.stdout.flush()

        class _AnyEndpoint:      # the decode side here is a bare KVReceiver, not a decode worker
            async def allowed(self, endpoint):
                return True

            async def close(self):
                pass

        async def disagg_all():
            from kvtransfer.ucx import UcxTransport      # ucxx: the colocated tables need none
            await dec.start()
            pushes = {}
            for m in modes:
                pushes[m] = KVPush(UcxTransport(device_memory=True), _AnyEndpoint(), 10.0, m)
                pushes[m].register_kv_caches(engine.kv_cache, engine.config.model.name)
            res, bw = {}, {}
            try:
                for m in modes:                  # host first: device staging is the riskier one
                    broken = False               # a failed mode is not retried (each try can hang)
                    engine.kv_connector = pushes[m]
                    for S in sizes:
                        if left(args.budget_s) < 8 or broken:
                            print(f"[disaggregated {m} {S}] skipped: {'failed before' if broken else 'budget spent'}")
                            continue
                        try:
                            res[m, S] = await asyncio.wait_for(
                                disaggregated(engine, pushes[m], dec, m, S, args.runs, 200), 15 * slow)
                        except Exception as e:
                            broken = True
                            print(f"[disaggregated {m} {S}] FAILED: {type(e).__name__}: {e}", flush=True)
                    engine.kv_connector = None
                    if left(args.budget_s) < 6 or broken:
                        continue
                    try:
                        bw[m] = await asyncio.wait_for(handover_bandwidth(engine, pushes[m], dec, m,
                                                                          max(sizes), args.runs), 10 * slow)
                    except Exception as e:
                        print(f"[bandwidth {m}] FAILED: {type(e).__name__}: {e}", flush=True)
            finally:
                engine.kv_connector = None
                for p in pushes.values():
                    await p.close()
            return res, bw

        res, bw = asyncio.run(disagg_all())
        print(f"\nTTFT: colocated vs disaggregated (two processes, one GPU), median of {args.runs}; "
              "ratio = disaggregated / colocated\n")
        print("| prompt | staging | colocated TTFT ms | disagg TTFT(P) ms | ratio | ready(D) ms | ratio "
              "| exposed handover ms |")
        print("| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |")
        for (m, S), runs in sorted(res.items(), key=lambda kv: (kv[0][1], kv[0][0])):
            c = statistics.median(co[S]) if co.get(S) else float("nan")
            tp, rd, ex = (statistics.median(r[k] for r in runs) for k in range(3))
            print(f"| {S} | {m} | {c * 1e3:.1f} | {tp * 1e3:.1f} | {tp / c:.2f}x | {rd * 1e3:.1f} "
                  f"| {rd / c:.2f}x | {ex * 1e3:.1f} |")
        msg = -(-max(sizes) // BS) * block_bytes(engine.kv_cache)     # one layer's message
        print(f"\nHandover bandwidth: one {max(sizes)}-token prompt, {args.layers} layer messages of "
              f"{msg / 2**20:.0f} MiB, first push -> receiver DONE, median of {args.runs}; "
              f"ucx_perftest tag_bw at {msg / 2**20:.0f} MiB, UCX_TLS={os.environ['UCX_TLS']}\n")
        print("| staging | pdserve GB/s | ucx_perftest GB/s | pdserve / perftest |")
        print("| --- | ---: | ---: | ---: |")
        for m in modes:
            ceil = None
            if left(args.budget_s) > 5:
                ceil = section(f"ucx_perftest {m}", args.budget_s, 5, perftest, msg, m == "device")
            got = bw.get(m)
            ratio = f"{got / ceil:.0%}" if got and ceil else "n/a"
            print(f"| {m} ({'cuda, cuda_ipc' if m == 'device' else 'host, tcp'}) "
                  f"| {got or float('nan'):.1f} | {ceil or float('nan'):.1f} | {ratio} |", flush=True)
    finally:
        dec.stop()
        del engine
        if args.device == "cuda":
            torch.cuda.empty_cache()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=32, help="of Llama-3.1-8B's 32")
    ap.add_argument("--prompts", default="2048,8192")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--budget-s", type=float, default=65.0, help="skip what would not fit")
    ap.add_argument("--device", default="cuda", help="cpu: only a dry run of sections 3-5 "
                    "(host staging; use few layers and short prompts)")
    args = ap.parse_args()
    import torch
    if args.device == "cuda" and not torch.cuda.is_available():
        print("disagg_gpu: no CUDA device; nothing to measure")
        return 0
    name = torch.cuda.get_device_name() if args.device == "cuda" else "CPU dry run"
    print(f"# bench/disagg_gpu.py {' '.join(sys.argv[1:])}: {name}, "
          f"torch {torch.__version__}, budget {args.budget_s:.0f} s", flush=True)
    ceiling = None
    if args.device == "cuda":
        ceiling = section("ceiling", args.budget_s, 3, matmul_ceiling)
        section("attention", args.budget_s, 25, attention, ceiling)
    section("engine", args.budget_s, 20, engine_sections, args, ceiling)
    print(f"\ntotal {time.monotonic() - T_START:.1f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
