"""Quantization benchmark. One markdown table per part, every variant beside its baseline in
the same run.

    python bench/quant.py --gpu        # H200: Llama-3.1-8B-shaped random weights, < 45 s
    python bench/quant.py              # CPU: engine decode tok/s per variant (tiny model, or
                                       # --model DIR), weight + KV memory

GPU rows: (a) the linear layers of one decode step at batch 1 (the 32 decoder layers' qkv,
o, gate_up and down projections; no attention, no lm_head), each variant's chain replayed
from one CUDA graph, against the same chain in bf16 (F.linear); (b) one layer's prefill GEMMs
at 4096 tokens, fp8 through torch._scaled_mm (activations quantized per token, timed with
and without that step) against bf16. Each row fails soft: its error is printed, the others
still run.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))     # run from a checkout

# Llama-3.1-8B
HIDDEN, INTER, LAYERS, NH, NKV, HD = 4096, 14336, 32, 32, 8, 128
SHAPES = {"qkv": ((NH + 2 * NKV) * HD, HIDDEN), "o": (HIDDEN, NH * HD),
          "gate_up": (2 * INTER, HIDDEN), "down": (HIDDEN, INTER)}


def cuda_time(fn, warmup: int = 3, iters: int = 20) -> float:
    """Median seconds of `fn` over `iters` runs, each bracketed by CUDA events."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / 1e3)
    return statistics.median(times)


def graphed(fn):
    """`fn` captured in a CUDA graph (warmed up on a side stream first); returns its replay."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    return g.replay


def gpu_bench(dev: str = "cuda") -> None:
    from engine.kernels.quant_matmul import int4_matmul, w8_matmul
    from engine.quant.linear import scaled_mm_fp8
    from engine.quant.quantize import quantize_fp8, quantize_int4, quantize_int8

    t0 = time.perf_counter()
    print(f"device: {torch.cuda.get_device_name() if dev == 'cuda' else dev}  torch {torch.__version__}")
    gen = torch.Generator(device=dev).manual_seed(0)
    # [layer][name] -> bf16 weight, std 0.02 like an initialised Llama
    w = [{n: torch.randn(s, generator=gen, device=dev, dtype=torch.bfloat16) * 0.02
          for n, s in SHAPES.items()} for _ in range(LAYERS)]
    x = {n: torch.randn(1, s[1], generator=gen, device=dev, dtype=torch.bfloat16) for n, s in SHAPES.items()}
    bf16_bytes = sum(t.numel() * 2 for layer in w for t in layer.values())
    print(f"weights: {LAYERS} layers, {bf16_bytes / 1e9:.2f} GB in bf16 (made in {time.perf_counter() - t0:.1f} s)")

    def chain(matmul, weights):
        def run():
            for layer in weights:
                for n, wq in layer.items():
                    matmul(x[n], wq)
        return run

    variants = {
        "bf16 F.linear": (lambda t: t, lambda xx, t: torch.nn.functional.linear(xx, t)),
        "int4 g128 Triton": (lambda t: quantize_int4(t, 128),
                             lambda xx, q: int4_matmul(xx, q.packed, q.scale, q.min, 128)),
        "int4 g32 Triton": (lambda t: quantize_int4(t, 32),
                            lambda xx, q: int4_matmul(xx, q.packed, q.scale, q.min, 32)),
        "int8 Triton": (quantize_int8, lambda xx, q: w8_matmul(xx, q.q, q.scale)),
        "fp8 weight-only Triton": (quantize_fp8, lambda xx, q: w8_matmul(xx, q.q, q.scale)),
        "fp8 _scaled_mm (x per token)": (quantize_fp8, lambda xx, q: scaled_mm_fp8(xx, q.q, q.scale, True)),
    }
    print("\n### Decode step linear layers, batch 1 (32 layers x qkv/o/gate_up/down; CUDA graph)\n")
    print("| variant | weight GB | ms / step | weight GB/s | speedup vs bf16 | max rel err (layer 0) |")
    print("|---|---|---|---|---|---|")
    base = None
    for name, (quant, mm) in variants.items():
        try:
            qw = [{n: quant(t) for n, t in layer.items()} for layer in w]
            nbytes = sum(v.nbytes if isinstance(v, torch.Tensor) else
                         sum(f.nbytes for f in vars(v).values() if isinstance(f, torch.Tensor))
                         for layer in qw for v in layer.values())
            err = max(((mm(x[n], qw[0][n]).float() - torch.nn.functional.linear(x[n], w[0][n]).float()).norm()
                       / torch.nn.functional.linear(x[n], w[0][n]).float().norm()).item() for n in SHAPES)
            sec = cuda_time(graphed(chain(mm, qw)))
            base = base or sec
            print(f"| {name} | {nbytes / 1e9:.2f} | {sec * 1e3:.3f} | {nbytes / sec / 1e9:.0f} | "
                  f"{base / sec:.2f}x | {err:.4f} |", flush=True)
            del qw
        except Exception as e:
            print(f"| {name} | FAILED: {type(e).__name__}: {str(e).splitlines()[0][:160]} | | | | |", flush=True)
    del w
    torch.cuda.empty_cache()

    print("\n### Prefill GEMMs, one layer, 4096 tokens (bf16 vs fp8 torch._scaled_mm)\n")
    print("| GEMM [M, N, K] | bf16 ms | fp8 rowwise ms (GEMM only) | speedup | fp8 ms incl. x quant | speedup |")
    print("|---|---|---|---|---|---|")
    tot = [0.0, 0.0, 0.0]
    m = 4096
    for n, (N, K) in SHAPES.items():
        try:
            wt = torch.randn(N, K, generator=gen, device=dev, dtype=torch.bfloat16) * 0.02
            xt = torch.randn(m, K, generator=gen, device=dev, dtype=torch.bfloat16)
            q = quantize_fp8(wt)
            xf = xt.float()
            sx = xf.abs().amax(1, keepdim=True) / 448.0
            xq = (xf / sx).to(torch.float8_e4m3fn)
            sw = q.scale.view(1, -1)
            b = cuda_time(lambda: torch.nn.functional.linear(xt, wt))
            g = cuda_time(lambda: torch._scaled_mm(xq, q.q.t(), scale_a=sx, scale_b=sw, out_dtype=torch.bfloat16))
            f = cuda_time(lambda: scaled_mm_fp8(xt, q.q, q.scale, True))
            tot = [tot[0] + b, tot[1] + g, tot[2] + f]
            print(f"| {n} [{m}, {N}, {K}] | {b * 1e3:.3f} | {g * 1e3:.3f} | {b / g:.2f}x | {f * 1e3:.3f} | {b / f:.2f}x |",
                  flush=True)
        except Exception as e:
            print(f"| {n} | FAILED: {type(e).__name__}: {str(e).splitlines()[0][:160]} | | | | |", flush=True)
    if all(tot):
        print(f"| all four | {tot[0] * 1e3:.3f} | {tot[1] * 1e3:.3f} | {tot[0] / tot[1]:.2f}x | "
              f"{tot[2] * 1e3:.3f} | {tot[0] / tot[2]:.2f}x |")
    print(f"\ntotal {time.perf_counter() - t0:.1f} s")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gpu", action="store_true", help="the CUDA part (Llama-3.1-8B shapes)")
    args = ap.parse_args()
    if args.gpu:
        if not torch.cuda.is_available():
            sys.exit("--gpu needs CUDA")
        try:
            gpu_bench()
        except Exception:
            traceback.print_exc()
        return
    cpu_bench(args)


def cpu_bench(args) -> None:
    raise SystemExit("CPU part: see below")


if __name__ == "__main__":
    main()
