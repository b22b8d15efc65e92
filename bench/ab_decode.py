"""One-stream decode speed of two checkouts of pdserve, side by side, in alternating rounds.

    python bench/ab_decode.py --a ../before --b . [--model M] [--variant auto:auto ...]

For a restructure that must not change speed: each checkout's engine runs in a process of its
own, started in that checkout (its own `engine` package first on the path), with the same
model and one torch thread. The processes load every variant (quantization:kernel backend),
then take turns, one measurement each per round, so a change in the machine's load (this
VM's two vCPUs are not independent) hits both alike; the table reports medians and B/A.
Decode tok/s is measured as bench/quant.py does (each checkout's pdserve.eval._decode_tok_s:
first to last generated token, greedy, `--tokens` tokens after a 32-token prompt). Without --model: the default real model
(SmolLM2-135M-Instruct Q4_1 GGUF, fetched as `pdserve up` does).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

WORKER = r'''
import json, sys
import torch
torch.set_num_threads(1)
from engine import LLM, SamplingParams
from pdserve.eval import _decode_tok_s      # each checkout's own, the measurement bench/quant.py makes
model, variants, tokens = sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3])
llms = {}
for v in variants:
    q, b = v.split(":")
    llms[v] = LLM(model, quantization=q, kernel_backend=b, num_blocks=64)
    llms[v].generate([[1, 2, 3, 4]], SamplingParams(temperature=0.0, max_tokens=4))   # warm-up
print(json.dumps({v: l.engine.model.backend for v, l in llms.items()}), flush=True)

for line in sys.stdin:
    print(json.dumps(_decode_tok_s(llms[line.strip()], list(range(5, 37)), tokens)), flush=True)
'''


def start(tree: Path, model: str, variants: list[str], tokens: int) -> tuple[subprocess.Popen, dict]:
    env = dict(os.environ, PYTHONPATH=str(tree), OMP_NUM_THREADS="1")
    p = subprocess.Popen([sys.executable, "-c", WORKER, model, json.dumps(variants), str(tokens)],
                         cwd=tree, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    line = p.stdout.readline()
    if not line:
        raise SystemExit(f"{tree}: the engine did not start (exit {p.wait()})")
    return p, json.loads(line)


def measure(p: subprocess.Popen, variant: str) -> float:
    p.stdin.write(variant + "\n")
    p.stdin.flush()
    return json.loads(p.stdout.readline())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--a", required=True, type=Path, help="checkout A (before)")
    ap.add_argument("--b", required=True, type=Path, help="checkout B (after)")
    ap.add_argument("--model", default="", help="model directory or GGUF (default: SmolLM2's GGUF)")
    ap.add_argument("--variant", nargs="+", default=["auto:auto", "auto:torch", "none:auto"],
                    help="quantization:kernel_backend pairs")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=7)
    args = ap.parse_args()
    model = args.model
    if not model:
        sys.path.insert(0, str(args.b.resolve()))
        from pdserve.default_model import resolve_default_model
        model = str(resolve_default_model())
    procs = {}
    for name, tree in (("A", args.a.resolve()), ("B", args.b.resolve())):
        procs[name] = start(tree, model, args.variant, args.tokens)
        print(f"{name}: {tree} (kernel backends settled: {procs[name][1]})", flush=True)
    speeds = {(v, n): [] for v in args.variant for n in procs}
    for r in range(args.rounds):
        for v in args.variant:
            for n in (("A", "B") if r % 2 == 0 else ("B", "A")):
                speeds[v, n].append(measure(procs[n][0], v))
        print(f"round {r + 1}/{args.rounds} done", file=sys.stderr, flush=True)
    for p, _ in procs.values():
        p.stdin.close()
        p.wait(timeout=60)
    print(f"\n### One-stream decode tok/s, {args.tokens} tokens, 1 thread, median of {args.rounds} "
          f"alternating rounds: {model}\n")
    print("| quantization:backend | A tok/s | B tok/s | B/A | A rounds | B rounds |")
    print("|---|---|---|---|---|---|")
    for v in args.variant:
        a, b = statistics.median(speeds[v, "A"]), statistics.median(speeds[v, "B"])
        print(f"| {v} | {a:.1f} | {b:.1f} | {b / a:.2f} | {' '.join(f'{x:.1f}' for x in speeds[v, 'A'])} | "
              f"{' '.join(f'{x:.1f}' for x in speeds[v, 'B'])} |", flush=True)


if __name__ == "__main__":
    main()
