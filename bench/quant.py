"""Quantization benchmark. One markdown table per part, every variant beside its baseline in
the same run.

    python bench/quant.py --gpu        # H200: Llama-3.1-8B-shaped random weights, < 45 s
    python bench/quant.py [--model M]  # CPU: each CPU linear path; engine decode tok/s and
                                       # weight memory per variant (tiny model, and M); llama.cpp
                                       # on M when M is a .gguf and llama-cpp-python is installed

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
    from engine.kernels import scaled_mm_fp8
    from engine.quant.fp8 import quantize_fp8
    from engine.quant.int4 import quantize_int4
    from engine.quant.int8 import quantize_int8

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
    ap.add_argument("--model", default="", help="CPU: a model directory or .gguf besides the tiny model")
    ap.add_argument("--quantization", nargs="+", default=["none", "int8", "int4_g32", "int4_g128", "fp8"])
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--kernel-backend", nargs="+", default=["torch", "auto"],
                    help="CPU: each quantization with each (auto: the C kernels where they build)")
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


def _cpu_time(fn, iters: int) -> float:
    fn()
    t = time.perf_counter()
    for _ in range(iters):
        fn()
    return (time.perf_counter() - t) / iters


def cpu_linear_paths(n: int, k: int, rows: int) -> None:
    """Each CPU path of one [n, k] linear layer at `rows` tokens, against float32 F.linear."""
    from engine.kernels.packing import unpack_int4
    from engine.quant.int4 import quantize_int4
    from engine.quant.int8 import quantize_int8
    w, x = torch.randn(n, k), torch.randn(rows, k)
    q8, q4 = quantize_int8(w), quantize_int4(w, 32)
    pack4 = torch.ops.aten._convert_weight_to_int4pack_for_cpu(unpack_int4(q4.packed), 1)
    sz = torch.stack((q4.scale.float().T, (q4.min.float() + 8 * q4.scale.float()).T), -1).contiguous()
    iters = max(3, int(2e8 // (n * k * rows)))          # ~0.2 G multiply-adds of each path
    paths = {
        "float32 F.linear": lambda: torch.nn.functional.linear(x, w),
        "bfloat16 F.linear": lambda: torch.nn.functional.linear(x.bfloat16(), w.bfloat16()),
        "int8 _weight_int8pack_mm, bf16 x": lambda: torch.ops.aten._weight_int8pack_mm(
            x.bfloat16(), q8.q, q8.scale.bfloat16()),
        "int8 _weight_int8pack_mm, fp32 x": lambda: torch.ops.aten._weight_int8pack_mm(x, q8.q, q8.scale),
        "int8 dequantize + F.linear": lambda: torch.nn.functional.linear(x, q8.dequantize()),
        "int4 g32 _weight_int4pack_mm_for_cpu, bf16 x": lambda: torch.ops.aten._weight_int4pack_mm_for_cpu(
            x.bfloat16(), pack4, 32, sz.bfloat16()),
    }
    print(f"\n### One linear layer [{n} x {k}], {rows} token(s), {torch.get_num_threads()} thread(s)\n")
    print("| path | us | vs float32 |")
    print("|---|---|---|")
    base = None
    for name, fn in paths.items():
        try:
            sec = _cpu_time(fn, iters)
            base = base or sec
            print(f"| {name} | {sec * 1e6:.0f} | {base / sec:.2f}x |", flush=True)
        except Exception as e:
            print(f"| {name} | FAILED: {type(e).__name__}: {str(e).splitlines()[0][:120]} | |", flush=True)


def engine_decode(model: str, variants: list[str], tokens: int, backends: list[str],
                  threads: int, rounds: int = 5) -> None:
    """The offline engine, one stream: decode tok/s and weight memory per --quantization and
    kernel backend (torch: the eager references; auto: on CPU the C kernels of
    engine/kernels/cpu.c); on a .gguf, llama.cpp (llama-cpp-python) on the same file and
    threads, measured the same way (first to last generated token). Everything takes turns,
    `rounds` times (the median is reported), so a change in the machine's load hits all alike."""
    from engine import LLM, SamplingParams
    from engine.quant.quantize import weight_bytes
    from pdserve.eval import _decode_tok_s
    print(f"\n### Decode, one stream, {tokens} tokens, {threads} thread(s), median of {rounds} "
          f"alternating rounds: {model}\n")
    runs, mbytes = {}, {}
    for q in variants:
        for b in backends:
            try:
                llm = LLM(model, quantization=q, kernel_backend=b, num_blocks=64)
                llm.generate([[1, 2, 3, 4]], SamplingParams(temperature=0.0, max_tokens=4))     # warm-up
            except Exception as e:
                print(f"{q} / {b}: FAILED: {type(e).__name__}: {str(e).splitlines()[0][:120]}", flush=True)
                continue
            key = (f"pdserve {q}", llm.engine.model.backend)
            runs[key] = lambda llm=llm: _decode_tok_s(llm, list(range(5, 37)), tokens)
            mbytes[key] = f"{weight_bytes(llm.engine.model) / 1e6:.1f}"
    if model.endswith(".gguf"):
        try:
            runs["llama.cpp", "llama.cpp"] = llama_cpp_decode(model, tokens, threads)
            mbytes["llama.cpp", "llama.cpp"] = f"{Path(model).stat().st_size / 1e6:.1f} (file)"
        except ImportError:
            print("llama.cpp: llama_cpp (llama-cpp-python) is not installed here; no llama.cpp row")
    speeds = {}
    for _ in range(rounds):
        for key, run in runs.items():
            speeds.setdefault(key, []).append(run())
    print("| engine | kernels | weights MB | decode tok/s | vs first row | rounds |")
    print("|---|---|---|---|---|---|")
    base = None
    for key in runs:
        tok_s = statistics.median(speeds[key])
        base = base or tok_s
        print(f"| {key[0]} | {key[1]} | {mbytes[key]} | {tok_s:.1f} | {tok_s / base:.2f}x | "
              f"{' '.join(f'{v:.1f}' for v in speeds[key])} |", flush=True)


def llama_cpp_decode(gguf: str, tokens: int, threads: int):
    """A callable: llama.cpp's decode tok/s on one stream, from its first streamed token to
    its last (each chunk is one token)."""
    from llama_cpp import Llama
    llm = Llama(model_path=gguf, n_threads=threads, n_threads_batch=threads, n_ctx=512, verbose=False)
    llm("Hello", max_tokens=4)

    def run() -> float:
        t_first, n = None, 0
        for _chunk in llm("The capital of France is", max_tokens=tokens, temperature=0.0, stream=True):
            n += 1
            if t_first is None:
                t_first = time.perf_counter()
        return (n - 1) / (time.perf_counter() - t_first)
    return run


def cpu_bench(args) -> None:
    import os
    torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {args.threads} thread(s), load average at start "
          f"{os.getloadavg()[0]:.1f} on {os.cpu_count()} cores")
    cpu_linear_paths(1536, 576, 1)                 # SmolLM2's up/gate projection half
    cpu_linear_paths(49152, 576, 1)                # SmolLM2's output head
    cpu_linear_paths(1536, 576, 64)
    from engine.tiny_model import ensure_default_model
    models = [str(ensure_default_model())] + ([args.model] if args.model else [])
    for m in models:
        engine_decode(m, args.quantization, args.tokens, args.kernel_backend, args.threads)
    print(f"\nload average at end {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
