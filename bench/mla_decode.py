"""MLA decode attention on CPU at one thread: cpu.c's kernel (cpu_mla.c) against the torch
reference (reference.py) it replaces, both measured in this run. One markdown table.

    python bench/mla_decode.py          # about 10 s

Shapes: DeepSeek-V3's row (kv_lora_rank 512 + rope 64) with 16 heads at 2k context, and a
tiny configuration's (32 + 16, 4 heads, 100 tokens) where per-call overhead dominates.
Each time is the best of 7 rounds (the median of a round's calls), so a shared machine's
noise inflates both columns alike rather than one.
"""
from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))     # run from a checkout

from engine.kernels import cpu  # noqa: E402
from engine.kernels.reference import paged_mla_decode_attention as reference  # noqa: E402

SHAPES = [  # (batch, heads, D, v_dim, context, block_size)
    (1, 16, 576, 512, 2048, 16),
    (1, 4, 48, 32, 100, 16),
]


def _inputs(b, h, d, ctx, bs):
    g = torch.Generator().manual_seed(0)
    nb = b * -(-ctx // bs)
    kv = torch.randn(nb, bs, d, generator=g)
    table = torch.randperm(nb, generator=g).to(torch.int32).view(b, -1)
    return torch.randn(b, h, d, generator=g), kv, table, torch.full((b,), ctx, dtype=torch.int32)


def _best_ms(fn, calls: int) -> float:
    fn()
    rounds = []
    for _ in range(7):
        times = []
        for _ in range(calls):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        rounds.append(statistics.median(times))
    return min(rounds) * 1e3


def main() -> None:
    torch.set_num_threads(1)
    if cpu.library() is None:
        sys.exit("the CPU kernels could not be built here (no C compiler?)")
    print("| B | H | D | v_dim | context | reference ms | C ms | speedup | max abs diff |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for b, h, d, v, ctx, bs in SHAPES:
        q, kv, table, lens = _inputs(b, h, d, ctx, bs)
        run_ref = lambda: reference(q, kv, table, lens, d ** -0.5, v)          # noqa: E731
        run_c = lambda: cpu.mla_decode_attention(q, kv, table, lens, d ** -0.5, v)  # noqa: E731
        calls = 20 if ctx > 1000 else 200
        r, c = _best_ms(run_ref, calls), _best_ms(run_c, calls)
        diff = (run_ref() - run_c()).abs().max().item()
        print(f"| {b} | {h} | {d} | {v} | {ctx} | {r:.3f} | {c:.3f} | {r / c:.1f}x | {diff:.1e} |")


if __name__ == "__main__":
    main()
