"""The two traces shipped in bench/traces/ (Mooncake JSONL, sim/trace.py), made here, seeded:

    python bench/make_traces.py [--out-dir bench/traces] [--seed 29]

chat.jsonl     multi-turn chat: 22 conversations starting at Poisson times over the first
               150 s, 2-5 turns each, a user think time (exponential, mean 15 s) between a
               reply and the next turn. Every prompt starts with the same 512-token system
               prompt (block id 0); turn k's prompt is the system prompt, turns < k (user
               message + the reply: its output_length) and the new user message (30-200
               tokens), so its hash_ids repeat turn k-1's and add the conversation's next
               blocks. Replies 16-128 tokens. 80 requests over 220 s (0.36 req/s), prompts
               543-1,481 tokens (median 869).
longdoc.jsonl  long documents: 6 documents of 3-6 whole blocks (1,536-3,072 tokens), asked
               34 short questions (20-80 tokens) at Poisson arrivals of 0.18 req/s; the
               document a question is about is drawn with weights 1/rank (a few are popular),
               so their blocks are shared; the question's block is the request's own id.
               Answers 32-192 tokens. 34 requests over 215 s, prompts 1,556-2,634 tokens.

Two more, small, for bench/prefix_tiers.py (issue 31: prefix reuse beyond one worker's KV
pool), greedy with short fixed outputs (16-32 tokens) so the runs are about prefill:

prefix_chat.jsonl     multi-turn chat: 24 sessions starting at Poisson times (2 a second),
                      3 turns each, the next turn 5-8 s after the last one arrived; each
                      prompt is the shared 512-token system prompt (block id 0), the whole
                      history (earlier user messages and replies) and a new user message of
                      40-80 tokens. 72 requests over 29 s, prompts 553-781 tokens.
prefix_longdoc.jsonl  long documents: 8 documents of 1,024 tokens (2 blocks), asked 30
                      questions (30-60 tokens, the request's own block) at Poisson arrivals of
                      1.2 a second, the document drawn with weights 1/rank. ~25 s.

Sized for the 2-core machine and the default model (prefill ~100-200 tok/s per core, decode
~100 tok/s aggregate). At scale 1, with prefix caching, each asks about 65-85 newly computed
prompt tokens/s (chat: 70k prompt tokens in all, 18.5k not in an earlier prompt's 512-token
blocks; longdoc: 65k, 14k) and 16-25 output tokens/s: a moderate load on a quiet machine
(with other jobs on the cores it is not: the first 60 s of chat.jsonl at load average 14
gave TTFT p50 25 s); `--rate-scale` 2-4 on `pdserve bench`/`pdserve plan` takes it to a
quiet machine's capacity and past it, below 1 under it. Without prefix caching the prompt
work is 4-5x as large.
"""
from __future__ import annotations

import argparse
import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from sim.trace import BLOCK_TOKENS, TraceRecord, write_trace  # noqa: E402

SYSTEM_ID = 0
MAX_PROMPT = 3000


def _ids(prefix: list[int], base: int, tokens: int) -> tuple[int, ...]:
    """`prefix` then ids base, base+1, ... until one id per block of `tokens`."""
    n = -(-tokens // BLOCK_TOKENS)
    return tuple(prefix + [base + i for i in range(n - len(prefix))])


def conversation(rng: random.Random, start_s: float, conv: int) -> list[TraceRecord]:
    out, t, context = [], start_s, BLOCK_TOKENS          # the system prompt, one whole block
    for _ in range(rng.randint(2, 5)):
        prompt = context + rng.randint(30, 200)
        if prompt > MAX_PROMPT:
            break
        reply = rng.randint(16, 128)
        out.append(TraceRecord(round(t * 1000.0), prompt, reply,
                               _ids([SYSTEM_ID], 1000 * (conv + 1), prompt)))
        context = prompt + reply
        t += rng.expovariate(1 / 15.0) + reply * 0.02     # the reply streams, then the user thinks
    return out


def chat(rng: random.Random) -> list[TraceRecord]:
    recs, t = [], 0.0
    for c in range(22):
        recs += conversation(rng, t, c)
        t += rng.expovariate(22 / 150.0)
    return sorted(recs, key=lambda r: r.timestamp_ms)


def longdoc(rng: random.Random) -> list[TraceRecord]:
    docs = [rng.randint(3, 6) for _ in range(6)]           # blocks per document
    weights = [1.0 / (i + 1) for i in range(len(docs))]
    recs, t = [], 0.0
    for q in range(34):
        d = rng.choices(range(len(docs)), weights)[0]
        doc_ids = [100_000 * (d + 1) + b for b in range(docs[d])]
        prompt = docs[d] * BLOCK_TOKENS + rng.randint(20, 80)
        recs.append(TraceRecord(round(t * 1000.0), prompt, rng.randint(32, 192),
                                tuple(doc_ids) + (10_000_000 + q,)))
        t += rng.expovariate(0.18)
    return recs


def prefix_chat(rng: random.Random, sessions: int = 24, turns: int = 3) -> list[TraceRecord]:
    """bench/prefix_tiers.py's chat trace (module docstring)."""
    recs, start = [], 0.0
    for s in range(sessions):
        t, context = start, BLOCK_TOKENS                 # the system prompt, one whole block
        for _ in range(turns):
            prompt, reply = context + rng.randint(40, 80), rng.randint(16, 32)
            recs.append(TraceRecord(round(t * 1000.0), prompt, reply,
                                    _ids([SYSTEM_ID], 1000 * (s + 1), prompt)))
            context = prompt + reply
            t += rng.uniform(5.0, 8.0)
        start += rng.expovariate(2.0)
    return sorted(recs, key=lambda r: r.timestamp_ms)


def prefix_longdoc(rng: random.Random, docs: int = 8, questions: int = 30) -> list[TraceRecord]:
    """bench/prefix_tiers.py's long-document trace (module docstring)."""
    weights = [1.0 / (i + 1) for i in range(docs)]
    recs, t = [], 0.0
    for q in range(questions):
        d = rng.choices(range(docs), weights)[0]
        doc_ids = (100_000 * (d + 1), 100_000 * (d + 1) + 1)       # 2 whole blocks
        recs.append(TraceRecord(round(t * 1000.0), 2 * BLOCK_TOKENS + rng.randint(30, 60),
                                rng.randint(16, 32), doc_ids + (10_000_000 + q,)))
        t += rng.expovariate(1.2)
    return recs


TRACES = (("chat", chat), ("longdoc", longdoc), ("prefix_chat", prefix_chat),
          ("prefix_longdoc", prefix_longdoc))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out-dir", default=str(Path(__file__).resolve().parent / "traces"))
    ap.add_argument("--seed", type=int, default=29)
    args = ap.parse_args()
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    for name, make in TRACES:
        recs = make(random.Random(f"{args.seed}:{name}"))
        write_trace(out / f"{name}.jsonl", recs)
        span = recs[-1].timestamp_ms / 1000.0
        ins = sorted(r.input_length for r in recs)
        print(f"{name}: {len(recs)} requests over {span:.0f} s ({len(recs) / span:.2f} req/s), "
              f"prompts {ins[0]}-{ins[-1]} tokens (median {ins[len(ins) // 2]}), outputs "
              f"{min(r.output_length for r in recs)}-{max(r.output_length for r in recs)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
