"""What the KV layout costs a P/D handover, and how fast the new architectures decode.

    python bench/kv_layouts.py [--rounds 3] [--tokens 2048] [--decode-tokens 64] [--skip-decode]

1. Handover, two processes over UCX (kvtransfer's KVSender -> KVReceiver, pushed layer by layer
   from a non-asyncio thread as the engine's per-layer hook does), one --tokens prompt, bf16,
   block 16, DeepSeek-V3's shape (61 layers, hidden 7168):
     mla   its latent cache: kv_lora_rank 512 + rope 64 = 576 values per token and layer
     gqa   a grouped-query cache of the same model size: 8 KV heads x 128, K and V = 2,048
   The two alternate round by round. Bytes are the sender's own payload counter (block ids
   and headers excluded), against what the layout predicts: layers x values x 2 bytes.
2. Decode tok/s at one stream on tiny random models of each new architecture (tests'
   builders), pdserve's engine (kernels auto: the C kernels on CPU) against transformers'
   generate() in the same run, rounds alternating: the time of --decode-tokens new tokens
   minus that of one (the prefill), so both count decode steps only.
"""
from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
os.environ.setdefault("OMP_NUM_THREADS", "1")

LAYERS, BS = 61, 16
LAYOUTS = {   # name -> (parts, heads, dim): ModelConfig.kv_block_shape of each
    "mla": (1, 1, 512 + 64),
    "gqa": (2, 8, 128),
}


def _shape(layout: str, tokens: int):
    parts, heads, dim = LAYOUTS[layout]
    n = tokens // BS
    return (LAYERS, parts, n + 8, BS, heads, dim), n


def _sink(layout: str, tokens: int, pipe) -> None:
    import torch
    from kvtransfer import CompatKey, KVReceiver
    from kvtransfer.ucx import UcxTransport
    shape, n = _shape(layout, tokens)

    async def main():
        cache = torch.zeros(shape, dtype=torch.bfloat16)
        rx = KVReceiver(cache, CompatKey.from_cache(cache, "bench", layout=layout), UcxTransport(),
                        expiry_s=60)
        pipe.send(await rx.start())
        loop = asyncio.get_running_loop()
        while (tid := await loop.run_in_executor(None, pipe.recv)) is not None:
            rx.reserve(tid, list(range(n - 1, -1, -1)))
            pipe.send("reserved")
            res = await rx.wait(tid, 60)
            pipe.send((res.state.value, time.time()))
        await rx.close()
    asyncio.run(main())


async def _source(addr: str, pipe, layout: str, tokens: int, tid: str) -> tuple[float, int]:
    """One handover: (seconds from the first push to the receiver's DONE, payload bytes)."""
    import torch
    from kvtransfer import CompatKey, KVSender
    from kvtransfer.ucx import UcxTransport
    shape, n = _shape(layout, tokens)
    src = torch.randn(shape).to(torch.bfloat16)
    tx = KVSender(src, CompatKey.from_cache(src, "bench", layout=layout), UcxTransport())
    loop = asyncio.get_running_loop()
    pipe.send(tid)
    assert await loop.run_in_executor(None, pipe.recv) == "reserved"
    h = await tx.open(tid, addr, list(range(8, 8 + n)), list(range(n - 1, -1, -1)))

    def engine_thread():
        for layer in range(LAYERS):
            tx.push_layer_threadsafe(h, layer)
    t0 = time.time()
    th = threading.Thread(target=engine_thread)
    th.start()
    await loop.run_in_executor(None, th.join, 60)
    stats = await tx.finish(h, 60)
    state, t_done = await loop.run_in_executor(None, pipe.recv)
    assert state == "done", state
    await tx.close()
    return t_done - t0, stats.bytes_sent


def handover(rounds: int, tokens: int) -> dict[str, list[tuple[float, int]]]:
    ctx = mp.get_context("spawn")
    sinks = {}
    for layout in LAYOUTS:
        a, b = ctx.Pipe()
        p = ctx.Process(target=_sink, args=(layout, tokens, b), daemon=True)
        p.start()
        if not a.poll(60):
            raise TimeoutError(f"{layout} receiver did not start")
        sinks[layout] = (p, a, a.recv())
    out = {k: [] for k in LAYOUTS}
    try:
        for r in range(rounds + 1):                       # round 0: warm-up
            for layout, (_, pipe, addr) in sinks.items():   # alternating, round by round
                res = asyncio.run(asyncio.wait_for(_source(addr, pipe, layout, tokens, f"{layout}-{r}"), 120))
                print(f"[handover] round {r}/{rounds} {layout}: {res[0] * 1e3:.1f} ms", file=sys.stderr, flush=True)
                if r:
                    out[layout].append(res)
    finally:
        for p, pipe, _ in sinks.values():
            pipe.send(None)
            p.join(10)
            if p.is_alive():
                p.kill()
    return out


def handover_table(res: dict, tokens: int) -> None:
    print(f"\n### Handover of one {tokens}-token prompt, DeepSeek-V3 shape ({LAYERS} layers, bf16, "
          f"block {BS}), UCX between two processes, median of {len(res['mla'])} rounds\n")
    print("| layout | values per token and layer | bytes per prompt token (measured) | predicted | "
          "measured / predicted | handover ms | vs gqa |")
    print("|---|---|---|---|---|---|---|")
    base = statistics.median(s for s, _ in res["gqa"])
    for layout, runs in res.items():
        parts, heads, dim = LAYOUTS[layout]
        values = parts * heads * dim
        predicted = LAYERS * values * 2
        measured = statistics.median(b for _, b in runs) / tokens
        ms = statistics.median(s for s, _ in runs)
        print(f"| {layout} | {values} | {measured:,.0f} | {predicted:,} | {measured / predicted:.3f} | "
              f"{ms * 1e3:.1f} | {ms / base:.2f}x |")


# ----------------------------------------------------------------------------- decode
def _builders():
    """Tiny random models of each new architecture: (name, builder(out) -> dir), the tests'
    builders (tests/golden.py's BUILDERS names them)."""
    import importlib

    from tests.golden import BUILDERS
    from tests.hf_models_mla import make_deepseek
    found = [("DeepSeek-V3 (MLA, MoE)", make_deepseek)]
    for kind in ("glm4_moe", "minimax_m2", "gpt_oss", "gemma3_text"):
        module, _, name = BUILDERS[kind].partition(":")
        make = getattr(importlib.import_module(module), name)
        found.append((kind, lambda out, make=make, kind=kind: make(kind, out)))
    return found


def _hf_decode_s(model, prompt, n: int) -> float:
    import torch
    ids = torch.tensor([prompt])

    def run(k):
        t0 = time.perf_counter()
        model.generate(ids, max_new_tokens=k, min_new_tokens=k, do_sample=False, pad_token_id=0)
        return time.perf_counter() - t0
    return run(n + 1) - run(1)


def _pdserve_decode_s(llm, prompt, n: int) -> float:
    from engine.sampling_params import SamplingParams

    def run(k):
        t0 = time.perf_counter()
        llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=k, ignore_eos=True))
        return time.perf_counter() - t0
    return run(n + 1) - run(1)


def decode(rounds: int, n: int) -> list[tuple[str, float, float]]:
    import torch
    import transformers as T
    from engine.offline import LLM
    torch.set_num_threads(1)
    rows = []
    prompt = [(i * 37) % 500 + 3 for i in range(32)]
    with tempfile.TemporaryDirectory() as tmp:
        for name, build in _builders():
            d = build(Path(tmp) / name.split()[0])
            hf = T.AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
            hf.generation_config.eos_token_id = None
            llm = LLM(str(d), num_blocks=64, block_size=16)
            hf_t, pd_t = [], []
            for r in range(rounds + 1):
                h, p = _hf_decode_s(hf, prompt, n), _pdserve_decode_s(llm, prompt, n)
                print(f"[decode] {name} round {r}/{rounds}: transformers {n / h:.0f} tok/s, "
                      f"pdserve {n / p:.0f} tok/s", file=sys.stderr, flush=True)
                if r:
                    hf_t.append(n / h)
                    pd_t.append(n / p)
            rows.append((name, statistics.median(pd_t), statistics.median(hf_t)))
    return rows


def decode_table(rows, n: int, rounds: int) -> None:
    print(f"\n### Decode at one stream, tiny random models, one thread, {n} tokens, median of "
          f"{rounds} alternating rounds\n")
    print("| architecture | pdserve tok/s | transformers tok/s | pdserve / transformers |")
    print("|---|---|---|---|")
    for name, pd, hf in rows:
        print(f"| {name} | {pd:.0f} | {hf:.0f} | {pd / hf:.2f}x |")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=2048, help="prompt tokens handed over (a multiple of 16)")
    ap.add_argument("--decode-tokens", type=int, default=64)
    ap.add_argument("--skip-decode", action="store_true")
    ap.add_argument("--skip-handover", action="store_true")
    a = ap.parse_args(argv)
    if not a.skip_handover:
        handover_table(handover(a.rounds, a.tokens), a.tokens)
    if not a.skip_decode:
        decode_table(decode(a.rounds, a.decode_tokens), a.decode_tokens, a.rounds)
    return 0


if __name__ == "__main__":
    sys.exit(main())
