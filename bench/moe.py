"""MoE layer benchmark: pdserve's fused MoE (engine.kernels.fused_moe) against the per-expert
loop (engine.kernels.reference.fused_moe, what transformers' eager experts do) and against
transformers' own MixtralSparseMoeBlock holding the same weight tensors, in one run.

    python3 bench/moe.py          # CPU, a tiny layer: the torch path the engine takes on CPU
    python3 bench/moe.py --gpu    # CUDA, a Mixtral-8x7B-shaped layer in bf16 (under 40 s)

--gpu: hidden 4096, intermediate 14336, 8 experts, top-2, random weights drawn on the device,
batch 1, 16, 64, 256. Fused times are CUDA-graph replays of routing + experts (how decode
steps run; capturing also proves the routing graph-safe) and eager calls; the loop and
transformers run eagerly (the loop syncs on the host per expert, so it cannot be captured).
Floors, measured in the same run: bytes of the experts the batch touches at the
device-to-device copy bandwidth, and the layer's FLOPs at a large bf16 matmul's rate.
Every row is fail-soft: an error prints in its row and the run goes on.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))     # run from a checkout

from engine.kernels import fused_moe, reference  # noqa: E402  (after the path insert)
from engine.models.moe import select_experts  # noqa: E402


def hf_block(wg, w13, w2, top_k, impl):
    """transformers' MixtralSparseMoeBlock whose parameters ARE these tensors (no copy), its
    experts run by `impl` (eager: a loop over the experts hit; grouped_mm: torch's grouped GEMM)."""
    import transformers as T
    e, i2, h = w13.shape
    cfg = T.MixtralConfig(hidden_size=h, intermediate_size=i2 // 2, num_local_experts=e,
                          num_experts_per_tok=top_k, experts_implementation=impl)
    with torch.device("meta"):
        blk = T.models.mixtral.modeling_mixtral.MixtralSparseMoeBlock(cfg)
    blk.gate.weight = torch.nn.Parameter(wg, requires_grad=False)
    blk.experts.gate_up_proj = torch.nn.Parameter(w13, requires_grad=False)
    blk.experts.down_proj = torch.nn.Parameter(w2, requires_grad=False)
    if getattr(blk.experts.config, "_experts_implementation", None) != impl:
        raise RuntimeError(f"this transformers does not take experts_implementation={impl!r}")
    return blk.eval()


def layer(backend):
    """The engine's MoE block as a function of the weights: route, then the experts."""
    def run(x, wg, w13, w2, top_k):
        w, ids = select_experts(x @ wg.T, top_k, renormalize=True)
        return fused_moe(x, w13, w2, w, ids, backend=backend)
    return run


def loop(x, wg, w13, w2, top_k):
    w, ids = select_experts(x @ wg.T, top_k, renormalize=True)
    return reference.fused_moe(x, w13, w2, w, ids)


def cpu_timed(fn, iters):
    fn()
    ts = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def dense(x, wg, w13, w2, top_k):
    """A vectorised torch candidate for the CPU path: every expert on every token (E/k times
    the FLOPs), unchosen experts weighted 0; no per-expert indexing."""
    w, ids = select_experts(x @ wg.T, top_k, renormalize=True)
    gates = torch.zeros(x.shape[0], w13.shape[0]).scatter_(1, ids, w)            # [T, E]
    hid = reference.silu_and_mul(torch.einsum("th,eih->eti", x, w13))             # [E, T, I]
    return torch.einsum("eti,ehi,te->th", hid, w2, gates)


def run_cpu():
    torch.set_num_threads(1)
    h, inter, e, k = 256, 512, 8, 2
    gen = torch.Generator().manual_seed(0)
    wg = torch.randn(e, h, generator=gen) * 0.1
    w13 = torch.randn(e, 2 * inter, h, generator=gen) * h ** -0.5
    w2 = torch.randn(e, h, inter, generator=gen) * inter ** -0.5
    import transformers
    blk = hf_block(wg, w13, w2, k, "eager")
    print(f"CPU, 1 thread, fp32; layer hidden {h}, intermediate {inter}, {e} experts, top-{k}")
    print(f"baseline: transformers {transformers.__version__} MixtralSparseMoeBlock, eager experts")
    print("pdserve's CPU path is the per-expert loop (engine.kernels.reference.fused_moe); "
          "'all experts' is the vectorised candidate\n")
    print("| batch | pdserve CPU path (ms) | all experts, vectorised (ms) | transformers (ms) | "
          "pdserve vs transformers | max abs diff vs transformers |")
    print("|---:|---:|---:|---:|---:|---:|")
    with torch.inference_mode():
        for t in (1, 16, 64, 256):
            try:
                x = torch.randn(t, h, generator=gen)
                iters = 100 if t <= 16 else 30
                a = cpu_timed(lambda: loop(x, wg, w13, w2, k), iters)
                b = cpu_timed(lambda: dense(x, wg, w13, w2, k), iters)
                c = cpu_timed(lambda: blk(x[None]), iters)
                ref = blk(x[None])[0]
                diff = max((loop(x, wg, w13, w2, k) - ref).abs().max().item(),
                           (dense(x, wg, w13, w2, k) - ref).abs().max().item())
                print(f"| {t} | {a * 1e3:.3f} | {b * 1e3:.3f} | {c * 1e3:.3f} | {c / a:.2f}x | {diff:.1e} |")
            except Exception as exc:            # noqa: BLE001 (fail-soft row)
                print(f"| {t} | error: {type(exc).__name__}: {exc} | | | | |")


def gpu_timed(fn, iters=20):
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(iters):
        s, t = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        fn()
        t.record()
        t.synchronize()
        ts.append(s.elapsed_time(t) / 1e3)
    return statistics.median(ts)


def graphed(fn):
    """fn captured in a CUDA graph (warmed on a side stream first); returns the replay."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    return g.replay


def measured_floors(dev, dt) -> tuple[float, float]:
    """Bytes/s of a device-to-device copy (read + write) and FLOP/s of a large bf16 matmul."""
    src = torch.empty(2 * 1024 ** 3, dtype=torch.uint8, device=dev)
    dst = torch.empty_like(src)
    bw = 2 * src.numel() / gpu_timed(lambda: dst.copy_(src), 10)
    a = torch.randn(8192, 8192, device=dev, dtype=dt)
    return bw, 2 * 8192 ** 3 / gpu_timed(lambda: a @ a, 10)


def run_gpu(h=4096, inter=14336, e=8, k=2, dev="cuda"):
    t_start = time.perf_counter()
    dt = torch.bfloat16
    print(torch.cuda.get_device_name(), "torch", torch.__version__, end=" ")
    import triton
    print("triton", triton.__version__)
    torch.manual_seed(0)
    wg = torch.randn(e, h, device=dev, dtype=dt) * 0.02
    w13 = torch.randn(e, 2 * inter, h, device=dev, dtype=dt) * h ** -0.5
    w2 = torch.randn(e, h, inter, device=dev, dtype=dt) * inter ** -0.5
    expert_bytes = 3 * h * inter * 2
    bw, flops_rate = measured_floors(dev, dt)
    print(f"Mixtral-8x7B MoE layer: hidden {h}, intermediate {inter}, {e} experts, top-{k}, bf16")
    print(f"measured: copy bandwidth {bw / 1e12:.2f} TB/s, bf16 matmul {flops_rate / 1e12:.0f} TFLOP/s")
    blocks = {}
    for impl in ("eager", "grouped_mm"):
        try:
            blocks[impl] = hf_block(wg, w13, w2, k, impl)
        except Exception as exc:                # noqa: BLE001
            print(f"transformers {impl} block unavailable: {type(exc).__name__}: {exc}")
    import transformers
    print(f"baselines: transformers {transformers.__version__} MixtralSparseMoeBlock with eager / "
          f"grouped_mm experts, eager calls\n")
    print("| batch | experts hit | fused, graph (us) | fused, eager (us) | per-expert loop (us) | "
          "HF eager (us) | HF grouped_mm (us) | vs loop | vs HF grouped_mm | share of BW floor | "
          "share of matmul ceiling | max abs err vs loop |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")

    def hf_time(impl, x):
        if impl not in blocks:
            return float("nan")
        try:
            return gpu_timed(lambda: blocks[impl](x[None]), 10)
        except Exception as exc:                # noqa: BLE001
            print(f"  (HF {impl} failed: {type(exc).__name__}: {str(exc)[:150]})")
            return float("nan")
    ours = layer("triton")
    speedups, shares = {}, {}
    for t in (1, 16, 64, 256):
        try:
            x = torch.randn(t, h, device=dev, dtype=dt)
            with torch.inference_mode():
                _, ids = select_experts(x @ wg.T, k, renormalize=True)
                hit = int(torch.unique(ids).numel())
                out = torch.empty(t, h, device=dev, dtype=dt)
                g = graphed(lambda: out.copy_(ours(x, wg, w13, w2, k)))
                fg = gpu_timed(g)
                fe = gpu_timed(lambda: ours(x, wg, w13, w2, k))
                lp = gpu_timed(lambda: loop(x, wg, w13, w2, k), 10)
                err = (ours(x, wg, w13, w2, k).float() - loop(x, wg, w13, w2, k).float()).abs().max().item()
                hfe, hfg = hf_time("eager", x), hf_time("grouped_mm", x)
            floor = hit * expert_bytes / bw
            ceil = 2 * t * k * expert_bytes / 2 / flops_rate     # 2 FLOPs per weight per routed row
            speedups[t], shares[t] = lp / fg, floor / fg
            print(f"| {t} | {hit} | {fg * 1e6:.0f} | {fe * 1e6:.0f} | {lp * 1e6:.0f} | {hfe * 1e6:.0f} | "
                  f"{hfg * 1e6:.0f} | {lp / fg:.2f}x | {hfg / fg:.2f}x | {floor / fg:.0%} | "
                  f"{ceil / fg:.0%} | {err:.1e} |")
        except Exception as exc:                # noqa: BLE001 (fail-soft row)
            print(f"| {t} | error: {type(exc).__name__}: {str(exc)[:200]} |" + " |" * 10)
        torch.cuda.empty_cache()
    print("\ntile variants (fused, graph replay, us; BLOCK_M/N/K, warps, stages):")
    variants = [dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=128, num_warps=4, num_stages=4),
                dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=256, num_warps=4, num_stages=3),
                dict(BLOCK_M=32, BLOCK_N=128, BLOCK_K=64, num_warps=4, num_stages=4)]
    for t, v in [(t, v) for t in (1, 64) for v in variants]:
        if time.perf_counter() - t_start > 28:
            print("  (time budget reached: remaining variants skipped)")
            break
        x = torch.randn(t, h, device=dev, dtype=dt)
        try:
            with torch.inference_mode():
                w, ids = select_experts(x @ wg.T, k, renormalize=True)
                us = gpu_timed(graphed(lambda: fused_moe(x, w13, w2, w, ids, backend="triton",
                                                         tiles=v))) * 1e6
            print(f"  batch {t}: {tuple(v.values())}: {us:.0f}")
        except Exception as exc:            # noqa: BLE001
            print(f"  batch {t}: {tuple(v.values())}: error {type(exc).__name__}: {str(exc)[:150]}")
    if 64 in speedups:
        print(f"\ntarget batch 64 >= 3x the per-expert loop: {speedups[64]:.2f}x")
    if 1 in shares:
        print(f"target batch 1 >= 70% of the bandwidth floor: {shares[1]:.0%}")
    print(f"total {time.perf_counter() - t_start:.1f} s")


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--gpu", action="store_true", help="CUDA, Mixtral-8x7B-shaped layer")
    if ap.parse_args().gpu:
        run_gpu()
    else:
        run_cpu()
