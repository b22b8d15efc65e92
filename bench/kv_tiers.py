"""A prompt evicted from the device pool, served again: recomputed (no tiers, today's engine)
beside revived from the host tier and from the disk tier (engine/kv_offload.py), rounds
alternating, one engine per way, the same model.

    python bench/kv_tiers.py [--model PATH] [--prompt-tokens 256] [--rounds 3] [--threads 1]

Each round and way: a fresh prompt P (its own token ids), served once; two other prompts of
the same length evict it from a device pool of prompt blocks + 8; P served again, timed from
add_request to its first token (max_tokens 1): the TTFT of a returning prompt. The table: the
median TTFT per way, the prompt tokens the engine computed for the second P (a step
observer's count), the blocks revived, their mean load time (the tier's seconds "in" per
block revived), and the median of the per-round ratios to recompute.
The disk tier's files are written before the timed run (its queue flushed), so the timed
load reads them from the page cache, as a recently written tier would be read.
No timing here is asserted anywhere: this is a measurement, not a test.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from engine.llm_engine import LLMEngine  # noqa: E402
from engine.sampling_params import SamplingParams  # noqa: E402

ONE = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)


class Computed:
    def __init__(self):
        self.tokens = {}

    def on_step(self, duration_s, tokens):
        for rid, n in tokens.items():
            self.tokens[rid] = self.tokens.get(rid, 0) + n


def serve(e, rid, prompt) -> float:
    t0 = time.perf_counter()
    e.add_request(rid, prompt, ONE)
    while e.has_unfinished_requests():
        e.step()
    return time.perf_counter() - t0


def prompt_of(seed: int, n: int, vocab: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(100, vocab - 100, (n,), generator=g).tolist()


def one(e, seen, r: int, way: str, n: int) -> tuple[float, int, int]:
    vocab = e.config.model.vocab_size
    p = prompt_of(1000 * r + 1, n, vocab)
    serve(e, f"{way}-{r}-first", p)
    for k in range(2):
        serve(e, f"{way}-{r}-other{k}", prompt_of(1000 * r + 10 + k, n, vocab))
    if e.offload is not None:
        e.offload.flush(60)
    hits = sum(e.offload.stats().hits.values()) if e.offload is not None else 0
    rid = f"{way}-{r}-again"
    s = serve(e, rid, p)
    revived = (sum(e.offload.stats().hits.values()) if e.offload is not None else 0) - hits
    return s, seen.tokens[rid], revived


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="")
    ap.add_argument("--prompt-tokens", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    if not a.model:
        from pdserve.default_model import resolve_default_model
        a.model = str(resolve_default_model())
    blocks = a.prompt_tokens // 16 + 8
    disk = tempfile.mkdtemp(prefix="kv-tiers-bench-")
    ways = {"recompute (no tiers)": {}, "host tier": {"kv_offload_host_gb": 0.5},
            "disk tier": {"kv_offload_disk": disk}}
    engines = {}
    for way, opts in ways.items():
        seen = Computed()
        engines[way] = (LLMEngine.from_model_dir(a.model, num_blocks=blocks, block_size=16,
                                                 step_observers=[seen], **opts), seen)
    res = {w: [] for w in ways}
    for r in range(a.rounds):
        for way, (e, seen) in engines.items():
            res[way].append(one(e, seen, r, way, a.prompt_tokens))
            print(f"round {r} {way}: {res[way][-1][0] * 1e3:.1f} ms, computed {res[way][-1][1]}, "
                  f"revived {res[way][-1][2]}", flush=True)
    base = [x[0] for x in res["recompute (no tiers)"]]
    print(f"\nreturning prompt (model {Path(a.model).name}, {a.prompt_tokens} tokens, pool "
          f"{blocks} blocks of 16, {a.threads} thread(s)), median of {a.rounds} alternating rounds\n")
    print("| way | TTFT ms | prompt tokens computed | blocks revived | load ms per block "
          "(mean) | recompute / way (median ratio) |")
    print("| --- | --- | --- | --- | --- | --- |")
    for way, xs in res.items():
        ratio = statistics.median(b / x[0] for b, x in zip(base, xs))
        e = engines[way][0]
        load = "-"
        if e.offload is not None:
            st = e.offload.stats()
            n = sum(st.hits.values())
            load = f"{sum(v for (t, d), v in st.seconds.items() if d == 'in') / n * 1e3:.2f}" if n else "-"
        print(f"| {way} | {statistics.median(x[0] for x in xs) * 1e3:.1f} | "
              f"{statistics.median(x[1] for x in xs):.0f} | {statistics.median(x[2] for x in xs):.0f} | "
              f"{load} | {ratio:.2f}x |")
    for e, _ in engines.values():
        e.close()


if __name__ == "__main__":
    main()
