"""The CPU decode step in one C call (engine/models/decode_plan.py) beside the layer-by-layer
step it replaces, and its kernels beside torch's, on the default model, in one process,
rounds alternating (issue 34, items 3-4).

    python bench/cpu_step.py [--rounds 5] [--batches 1,4,16,64] [--context 200] [--log FILE]

(1) kernels, every decoder linear of the model once (its real weights), per row count M:
    cpu_int4.c's float32 int4 matmul (Int4Cpu) against torch's int4 kernel
    (_weight_int4pack_mm_for_cpu, bfloat16), and cpu_bf16.c's matmul (on the AMX tiles from
    pd_bf16_tile_rows rows where the CPU has them, else avx512_bf16 dot products) against
    oneDNN's (F.linear in bfloat16) on the bfloat16 copies; GFLOP/s, and each one's largest error
    against the float64 product of the same weights (relative to the output's largest value)
(2) the forward pass of a decode batch of B rows at context --context (no sampling): the
    layer-by-layer path (torch and cpu.c calls from Python), the plan on one thread, and the
    plan with --step-threads helpers; and the head (compute_logits) alone

Each figure is the median over rounds; within a round every variant runs once, in turn.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine import LLM  # noqa: E402
from engine.kernels import cpu  # noqa: E402
from engine.kernels import packing as P  # noqa: E402
from engine.models.decode_plan import DecodePlan  # noqa: E402
from engine.models.layers import AttentionMetadata  # noqa: E402


def timed(fn, reps: int) -> float:
    fn()
    t = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - t) / reps


def kernels(model, rows: list[int], rounds: int) -> list[str]:
    linears = [m for layer in model.layers for m in (layer.self_attn.qkv_proj, layer.self_attn.o_proj,
                                                     layer.mlp.gate_up_proj, layer.mlp.down_proj)]
    packs = []
    for lin in linears:
        qw = lin.quantized()
        n, k = qw.shape
        codes = P.unpack_int4(qw.packed)
        pk, sz = P.to_int4pack(codes, qw.scale.float(), qw.min.float() + 8 * qw.scale.float())
        packs.append((lin, pk, sz, qw.dequantize(), lin.dense if lin.dense is not None
                      else qw.dequantize().bfloat16()))
    out = ["| M | int4 C GFLOP/s | torch int4 GFLOP/s | C / torch | bf16 C GFLOP/s | oneDNN bf16 GFLOP/s "
           "| C / oneDNN | int4 C err | torch int4 err | bf16 C err |", "|" + " --- |" * 10]
    for m in rows:
        xs = {k: torch.randn(m, k) for k in {lin.in_features for lin, *_ in packs}}
        fl = sum(2 * m * lin.out_features * lin.in_features for lin, *_ in packs)
        runs = {"c4": [], "t4": [], "cb": [], "ob": []}
        fns = {
            "c4": lambda: [lin.packed.forward(xs[lin.in_features]) for lin, *_ in packs],
            "t4": lambda: [torch._weight_int4pack_mm_for_cpu(xs[lin.in_features].bfloat16(), pk, 32, sz)
                           for lin, pk, sz, _, _ in packs],
            "cb": lambda: [cpu.bf16_matmul(xs[lin.in_features], d) for lin, _, _, _, d in packs],
            "ob": lambda: [torch.nn.functional.linear(xs[lin.in_features].bfloat16(), d) for lin, _, _, _, d in packs],
        }
        for _ in range(rounds):
            for name, fn in fns.items():
                runs[name].append(fl / timed(fn, 2) / 1e9)
        lin, pk, sz, w, d = packs[2]                  # layer 0's gate_up: the errors
        x = xs[lin.in_features]
        ref = x.double() @ w.double().T
        err = lambda y: ((y.double() - ref).abs().max() / ref.abs().max()).item()  # noqa: E731
        e = [err(lin.packed.forward(x)), err(torch._weight_int4pack_mm_for_cpu(x.bfloat16(), pk, 32, sz)),
             err(cpu.bf16_matmul(x, d))]
        g = {k: statistics.median(v) for k, v in runs.items()}
        out.append(f"| {m} | {g['c4']:.1f} | {g['t4']:.1f} | {g['c4'] / g['t4']:.2f} | {g['cb']:.1f} | "
                   f"{g['ob']:.1f} | {g['cb'] / g['ob']:.2f} | {e[0]:.1e} | {e[1]:.1e} | {e[2]:.1e} |")
    return out


def steps(llm, batches: list[int], context: int, threads: int, rounds: int) -> list[str]:
    m = llm.engine.model
    bs = llm.engine.config.cache.block_size
    plans = {}
    for t in (1, threads):
        m.step_threads = t
        plans[t] = DecodePlan(m)
    out = [f"| B | layer by layer ms | plan, 1 thread ms | plan, {threads} threads ms | layers / plan "
           f"({threads}) | head ms (plan, {threads}) | tok/s of a step + head ({threads}) |",
           "|" + " --- |" * 7]
    for B in batches:
        nb = -(-context // bs)
        tables = torch.arange(B * nb, dtype=torch.int32).view(B, nb)
        meta = AttentionMetadata(slot_mapping=tables[:, -1].long() * bs + (context - 1) % bs,
                                 block_tables=tables, context_lens=torch.full((B,), context, dtype=torch.int32),
                                 cu_seqlens_q=torch.arange(B + 1, dtype=torch.int32), max_q_len=1,
                                 max_context_len=context)
        ids, pos = torch.arange(7, 7 + B), torch.full((B,), context - 1, dtype=torch.int64)
        reps = max(2, 40 // B)
        runs = {"layers": [], 1: [], threads: [], "head": []}
        with torch.inference_mode():
            for _ in range(rounds):
                m.decode_plan = None
                runs["layers"].append(timed(lambda: m(ids, pos, meta), reps))
                for t in (1, threads):
                    m.decode_plan = plans[t]
                    runs[t].append(timed(lambda: m(ids, pos, meta), reps))
                h = m(ids, pos, meta)
                runs["head"].append(timed(lambda: m.compute_logits(h), reps))
        g = {k: statistics.median(v) * 1e3 for k, v in runs.items()}
        out.append(f"| {B} | {g['layers']:.2f} | {g[1]:.2f} | {g[threads]:.2f} | {g['layers'] / g[threads]:.2f} | "
                   f"{g['head']:.2f} | {B / (g[threads] + g['head']) * 1e3:.0f} |")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--batches", default="1,4,16,64")
    ap.add_argument("--rows", default="1,4,16,64,256", help="kernel row counts")
    ap.add_argument("--context", type=int, default=200)
    ap.add_argument("--threads", type=int, default=2, help="the plan's threads beside one")
    ap.add_argument("--model", default="")
    ap.add_argument("--log", default="")
    a = ap.parse_args()
    torch.set_num_threads(1)
    if not a.model:
        from pdserve.default_model import resolve_default_model
        a.model = str(resolve_default_model())
    llm = LLM(a.model, num_blocks=2048)
    lines = [f"# bench/cpu_step.py {time.strftime('%Y-%m-%d %H:%M:%S UTC', time.gmtime())}; model {a.model}; "
             f"torch threads 1; {a.rounds} rounds alternating; bf16 C on the AMX tiles: "
             f"{f'from {cpu.bf16_tile_rows()} rows' if cpu.has_bf16_tiles() else 'no'}",
             "", "(1) kernels: every decoder linear once, its real weights", "",
             *kernels(llm.engine.model, [int(x) for x in a.rows.split(",")], a.rounds),
             "", f"(2) a decode batch's forward pass at context {a.context}, and the head", "",
             *steps(llm, [int(x) for x in a.batches.split(",")], a.context, a.threads, a.rounds)]
    text = "\n".join(lines)
    print(text)
    if a.log:
        with open(a.log, "a") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
