"""Kernel benchmark (CUDA only): accuracy of every Triton kernel against its torch reference,
paged decode attention bandwidth against a device-to-device copy, and prefill attention
throughput against a bf16 matmul, the baselines measured in the same run. One markdown table.

    python bench/kernels.py            # about a minute on an H200
"""
from __future__ import annotations

import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))     # run from a checkout


def timed(fn, warmup: int = 3, iters: int = 10) -> float:
    """Median seconds of `fn` over `iters` runs, each bracketed by CUDA events."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


def capture(fn) -> torch.cuda.CUDAGraph:
    """Warm `fn` up on a side stream (compiles the kernels), then capture it in a graph."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph


def paged_inputs(batch, ctx, hq, hkv, d, block_size, dtype, gen, dev="cuda"):
    """Caches holding exactly the batch's blocks, handed out in shuffled order."""
    per_seq = (ctx + block_size - 1) // block_size
    nb = batch * per_seq
    table = torch.randperm(nb, generator=gen).view(batch, per_seq).to(torch.int32)
    # random data drawn on the device itself: GBs of host randn would dominate the run
    k_cache = torch.randn(nb, block_size, hkv, d, device=dev, dtype=dtype)
    v_cache = torch.randn(nb, block_size, hkv, d, device=dev, dtype=dtype)
    return k_cache, v_cache, table.to(dev)


def accuracy_rows(K, ref, gen) -> list[tuple[str, str, str, str]]:
    """Max abs error vs the reference (the reference runs on CPU copies of the inputs)."""
    rows = []
    for dtype in (torch.float32, torch.bfloat16):
        name = "fp32" if dtype == torch.float32 else "bf16"
        errs = {}

        def err(a, b):
            return (a.float().cpu() - b.float()).abs().max().item()

        x = torch.randn(64, 4096, generator=gen).to(dtype)
        w = torch.randn(4096, generator=gen).to(dtype)
        r = torch.randn(64, 4096, generator=gen).to(dtype)
        o, nr = K.rms_norm(x.cuda(), w.cuda(), 1e-5, r.cuda())
        ro, rnr = ref.rms_norm(x, w, 1e-5, r)
        errs["rms_norm (+residual)"] = max(err(o, ro), err(nr, rnr))

        x = torch.randn(64, 2 * 1408, generator=gen).to(dtype)
        errs["silu_and_mul"] = err(K.silu_and_mul(x.cuda()), ref.silu_and_mul(x))

        q = torch.randn(64, 32, 128, generator=gen).to(dtype)
        k = torch.randn(64, 8, 128, generator=gen).to(dtype)
        cache = K.build_cos_sin_cache(128, 8192, 500000.0)
        pos = torch.randint(0, 8192, (64,), generator=gen)
        gq, gk = K.rotary_embedding(pos.cuda(), q.cuda(), k.cuda(), cache.cuda())
        rq, rk = ref.rotary_embedding(pos, q, k, cache)
        errs["rotary_embedding"] = max(err(gq, rq), err(gk, rk))

        kc, vc, _ = paged_inputs(4, 64, 32, 8, 128, 16, dtype, gen, dev="cpu")
        slots = torch.randperm(kc.shape[0] * 16, generator=gen)[:48]
        kn = torch.randn(48, 8, 128, generator=gen).to(dtype)
        vn = torch.randn(48, 8, 128, generator=gen).to(dtype)
        kcg, vcg = kc.cuda(), vc.cuda()
        K.write_kv_cache(kn.cuda(), vn.cuda(), kcg, vcg, slots.cuda())
        ref.write_kv_cache(kn, vn, kc, vc, slots)
        errs["write_kv_cache"] = max(err(kcg, kc), err(vcg, vc))

        lens = [1000, 77, 513, 2048]
        kc, vc, table = paged_inputs(4, 2048, 32, 8, 128, 16, dtype, gen, dev="cpu")
        ctx = torch.tensor(lens, dtype=torch.int32)
        q = torch.randn(4, 32, 128, generator=gen).to(dtype)
        got = K.paged_decode_attention(q.cuda(), kc.cuda(), vc.cuda(), table.cuda(), ctx.cuda(), 128 ** -0.5,
                                       max_context_len=2048)
        errs["paged_decode_attention"] = err(got, ref.paged_decode_attention(q, kc, vc, table, ctx, 128 ** -0.5))

        q_lens = [300, 1, 129, 64]
        cu = torch.tensor([0] + q_lens).cumsum(0).to(torch.int32)
        q = torch.randn(int(cu[-1]), 32, 128, generator=gen).to(dtype)
        got = K.paged_prefill_attention(q.cuda(), kc.cuda(), vc.cuda(), table.cuda(), cu.cuda(), ctx.cuda(),
                                        128 ** -0.5)
        errs["paged_prefill_attention"] = err(
            got, ref.paged_prefill_attention(q, kc, vc, table, cu, ctx, 128 ** -0.5))
        for kname, e in errs.items():
            rows.append((f"{kname} max abs err, {name}", f"{e:.2e}", "torch reference", "-"))
    return rows


def decode_rows(K, gen, copy_bw) -> list[tuple[str, str, str, str]]:
    hq, hkv, d, bs = 32, 8, 128, 16
    rows = []
    for batch, ctx_len in ((1, 8192), (16, 1024), (16, 8192), (16, 32768), (64, 8192)):
        kc, vc, table = paged_inputs(batch, ctx_len, hq, hkv, d, bs, torch.bfloat16, gen)
        q = torch.randn(batch, hq, d, device="cuda", dtype=torch.bfloat16)
        ctx = torch.full((batch,), ctx_len, dtype=torch.int32, device="cuda")
        out = torch.empty_like(q)
        # the engine replays decode from a CUDA graph: time the replay, not the host launch
        graph = capture(lambda: K.paged_decode_attention(q, kc, vc, table, ctx, d ** -0.5,
                                                         max_context_len=ctx_len, out=out))
        sec = timed(graph.replay)
        moved = 2 * kc.numel() * kc.element_size() + 2 * q.numel() * q.element_size() + table.numel() * 4
        bw = moved / sec / 1e9
        rows.append((f"decode attention (CUDA graph), batch {batch}, ctx {ctx_len // 1024}k, GB/s", f"{bw:,.0f}",
                     f"copy {copy_bw:,.0f}", f"{bw / copy_bw:.0%}"))
        del kc, vc
    return rows


def prefill_rows(K, gen, mm_tflops) -> list[tuple[str, str, str, str]]:
    nseq, seq, hq, hkv, d, bs = 4, 4096, 32, 8, 128, 16
    kc, vc, table = paged_inputs(nseq, seq, hq, hkv, d, bs, torch.bfloat16, gen)
    q = torch.randn(nseq * seq, hq, d, device="cuda", dtype=torch.bfloat16)
    cu = torch.arange(0, nseq + 1, dtype=torch.int32, device="cuda") * seq
    ctx = torch.full((nseq,), seq, dtype=torch.int32, device="cuda")
    out = torch.empty_like(q)
    sec = timed(lambda: K.paged_prefill_attention(q, kc, vc, table, cu, ctx, d ** -0.5,
                                                  max_q_len=seq, out=out), iters=5)
    flops = nseq * 2 * seq * seq * hq * d          # causal: half of 4 * L^2 * H * D
    tf = flops / sec / 1e12
    return [(f"prefill attention, {nseq} x {seq} tokens, TFLOP/s", f"{tf:,.0f}",
             f"matmul {mm_tflops:,.0f}", f"{tf / mm_tflops:.0%}")]


def main() -> int:
    if not torch.cuda.is_available():
        print("bench/kernels.py needs a CUDA GPU; none found, nothing measured.")
        return 0
    import engine.kernels as K
    from engine.kernels import reference as ref

    gen = torch.Generator().manual_seed(0)
    torch.manual_seed(0)
    src = torch.empty(2 ** 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    copy_bw = 2 * src.numel() / timed(lambda: dst.copy_(src)) / 1e9          # read + write
    del src, dst
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    mm_tflops = 2 * 8192 ** 3 / timed(lambda: a @ b) / 1e12
    del a, b

    rows = [("device-to-device copy (read + write), GB/s", f"{copy_bw:,.0f}", "-", "-"),
            ("bf16 matmul 8192^3, TFLOP/s", f"{mm_tflops:,.0f}", "-", "-")]
    rows += decode_rows(K, gen, copy_bw)
    rows += prefill_rows(K, gen, mm_tflops)
    rows += accuracy_rows(K, ref, gen)
    print(f"\n{torch.cuda.get_device_name()}\n")
    print("| measurement | value | baseline (same run) | ratio |")
    print("| --- | ---: | --- | ---: |")
    for r in rows:
        print("| " + " | ".join(r) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
