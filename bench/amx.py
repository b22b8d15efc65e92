"""The bfloat16 path of the quantized linears (engine/quant/amx.py) beside the int4 kernel,
in one run, rounds alternating (the machine is shared: medians of the rounds).

    python bench/amx.py [--model GGUF_DIR] [--rounds 3] [--threads 1,2]

Table 1: GFLOP/s per kernel at M = 1, 4, 16, 64, 256, 1024 rows, one decoder layer of
SmolLM2-135M (qkv 960x576, o 576x576, gate_up 3072x576, down 576x1536, int4_g32 on torch's
CPU int4 layout) against the same layer's bfloat16 copy (F.linear, oneDNN), and the fp32
reference for scale. Table 2: the offline engine on the model (default: the cached
SmolLM2-135M GGUF): prefill tok/s of a 1024-token prompt and decode tok/s at batch 16 and
32 (32 new tokens each), --amx-weights off against on, one engine whose copies are dropped
and re-attached between rounds.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))     # run from a checkout

from engine.quant import amx                      # noqa: E402
from engine.quant.linear import QuantLinear       # noqa: E402

LAYER = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536)}
ROWS = (1, 4, 16, 64, 256, 1024)


def timed(fn, min_s: float = 0.08) -> float:
    fn()
    n, t0 = 0, time.perf_counter()
    while (el := time.perf_counter() - t0) < min_s or n < 2:
        fn()
        n += 1
    return el / n


def kernel_table(rounds: int, threads: int) -> list[str]:
    torch.set_num_threads(threads)
    gen = torch.Generator().manual_seed(0)
    layers = {k: QuantLinear.quantize("int4_g32", torch.randn(n, kk, generator=gen) * 0.05)
              for k, (n, kk) in LAYER.items()}
    dense = {k: m.dequantize().bfloat16() for k, m in layers.items()}
    f32 = {k: m.dequantize() for k, m in layers.items()}
    flops_row = sum(2 * n * k for n, k in LAYER.values())
    out = [f"kernels, one SmolLM2-135M layer (4 linears), {threads} thread(s), median of {rounds} "
           "alternating rounds", "", "| M | int4 GFLOP/s | bf16 GFLOP/s | fp32 GFLOP/s | bf16 / int4 |",
           "| --- | --- | --- | --- | --- |"]
    for m in ROWS:
        x = torch.randn(m, 1536, generator=gen)
        xs = {k: x[:, :kk].contiguous().bfloat16() for k, (_, kk) in LAYER.items()}
        xf = {k: x[:, :kk].contiguous() for k, (_, kk) in LAYER.items()}
        res = {"int4": [], "bf16": [], "fp32": []}
        for _ in range(rounds):
            res["int4"].append(timed(lambda: [layers[k].packed.forward(xs[k]) for k in LAYER]))
            res["bf16"].append(timed(lambda: [torch.nn.functional.linear(xs[k], dense[k]) for k in LAYER]))
            res["fp32"].append(timed(lambda: [torch.nn.functional.linear(xf[k], f32[k]) for k in LAYER]))
        g = {k: m * flops_row / statistics.median(v) / 1e9 for k, v in res.items()}
        out.append(f"| {m} | {g['int4']:.1f} | {g['bf16']:.1f} | {g['fp32']:.1f} | {g['bf16'] / g['int4']:.2f} |")
    return out


def _engine_runs(llm, sp_cls, batch_prompts, long_prompt):
    """(prefill tok/s, {batch: decode tok/s}) of one configuration."""
    t0 = time.perf_counter()
    llm.generate([long_prompt], sp_cls(max_tokens=1, temperature=0.0))
    prefill = len(long_prompt) / (time.perf_counter() - t0)
    decode = {}
    for b, ps in batch_prompts.items():
        t0 = time.perf_counter()
        llm.generate(ps, sp_cls(max_tokens=1, temperature=0.0))
        t1 = time.perf_counter() - t0
        t0 = time.perf_counter()
        llm.generate(ps, sp_cls(max_tokens=33, temperature=0.0, ignore_eos=True))
        tn = time.perf_counter() - t0
        decode[b] = b * 32 / max(tn - t1, 1e-9)
    return prefill, decode


def engine_table(model: str, rounds: int, threads_list) -> list[str]:
    from engine.offline import LLM
    from engine.sampling_params import SamplingParams
    llm = LLM(model, num_blocks=1024, block_size=16, max_num_seqs=64, amx_weights="off",
              enable_prefix_caching=False)
    vocab = llm.engine.config.model.vocab_size
    gen = torch.Generator().manual_seed(1)
    long_prompt = torch.randint(100, vocab, (1024,), generator=gen).tolist()
    batch = {b: [torch.randint(100, vocab, (32,), generator=gen).tolist() for _ in range(b)]
             for b in (16, 32)}
    out = [f"engine ({Path(model).name}, offline LLM), median of {rounds} alternating rounds", "",
           "| threads | amx weights | prefill tok/s (1024-token prompt) | decode tok/s batch 16 | "
           "decode tok/s batch 32 |", "| --- | --- | --- | --- | --- |"]
    for th in threads_list:
        torch.set_num_threads(th)
        res = {"off": [], "bf16": []}
        for _ in range(rounds):
            for mode in ("off", "bf16"):
                amx.detach(llm.engine.model)
                if mode == "bf16":
                    amx.attach(llm.engine.model, "bf16", 1.0, llm.engine.config.amx_min_rows)
                res[mode].append(_engine_runs(llm, SamplingParams, batch, long_prompt))
                print(f"  threads {th} {mode}: prefill {res[mode][-1][0]:.0f} tok/s, decode "
                      f"{ {b: round(v) for b, v in res[mode][-1][1].items()} }", flush=True)
        for mode, runs in res.items():
            p = statistics.median(r[0] for r in runs)
            d = {b: statistics.median(r[1][b] for r in runs) for b in (16, 32)}
            out.append(f"| {th} | {mode} | {p:.0f} | {d[16]:.0f} | {d[32]:.0f} |")
        # the ratio within each round (the two runs back to back), then the median
        on, off = res["bf16"], res["off"]
        rp = statistics.median(a[0] / b[0] for a, b in zip(on, off))
        rd = {k: statistics.median(a[1][k] / b[1][k] for a, b in zip(on, off)) for k in (16, 32)}
        out.append(f"| {th} | bf16 / off, median of per-round ratios | {rp:.2f}x | {rd[16]:.2f}x | "
                   f"{rd[32]:.2f}x |")
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=str(Path.home() / ".cache/pdserve/smollm2-135m-instruct"))
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--skip-engine", action="store_true")
    a = ap.parse_args()
    threads = [int(t) for t in a.threads.split(",")]
    flags = amx.cpu_flags()
    print(f"torch {torch.__version__}, CPU bf16 flags: "
          f"{sorted(f for f in flags if 'bf16' in f or f.startswith('amx'))}, "
          f"amx_weights auto -> {amx.choose('auto', flags, 0, 1)[1]}")
    for th in threads:
        print("\n".join(kernel_table(a.rounds, th)), "\n", flush=True)
    if not a.skip_engine:
        print("\n".join(engine_table(a.model, a.rounds, threads)), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
