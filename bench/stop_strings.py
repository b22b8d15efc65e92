"""Stop-string matching cost per generated token: the matcher before issue 12 (each stop
string searched at each token: str.find over the new region, then str.endswith for every
prefix length to find the held-back tail) beside engine.tokenizer.StopStrings (Aho-Corasick,
one automaton walk per character), on the same deltas.

    python bench/stop_strings.py [--tokens 2000] [--log FILE]

The deltas are the tiny model's tokenizer's detokenized pieces of a fixed text (no stop
string ever matches: the whole stream is paid for). Stop lists: one short string; 16 random
strings of 1 kB (the most a request may give); 16 strings of 1 kB that the text almost
matches everywhere (`aaa...ab`-style, against a text of `a` runs: every position is a long
partial match). Single process, one thread; time per token is the median of 5 runs; the
automaton's build time (once per distinct stop list) is shown apart.
"""
from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from engine.tiny_model import ensure_default_model  # noqa: E402
from engine.tokenizer import IncrementalDetokenizer, StopStrings, Tokenizer, _automaton  # noqa: E402


def before(deltas: list[str], stops: list[str]) -> None:
    """The matcher before: per stop string per token (engine/tokenizer.py at 6614cdf)."""
    text = ""
    for delta in deltas:
        text += delta
        for stop in stops:                                   # find_stop
            text.find(stop, max(0, len(text) - len(delta) - len(stop) + 1))
        best = 0                                             # partial_stop_len
        for stop in stops:
            for n in range(min(len(text), len(stop) - 1), best, -1):
                if text.endswith(stop[:n]):
                    best = n
                    break


def after(deltas: list[str], stops: list[str]) -> int:
    m = StopStrings(stops)
    for delta in deltas:
        m.feed(delta)
        m.held()
    return m.steps


def per_token_us(fn, deltas, stops) -> float:
    times = []
    for _ in range(5):
        t0 = time.perf_counter()
        fn(deltas, stops)
        times.append(time.perf_counter() - t0)
    return statistics.median(times) / len(deltas) * 1e6


def deltas_of(tok: Tokenizer, text: str, n: int) -> list[str]:
    detok = IncrementalDetokenizer(tok, [])
    out = [detok.add(t) for t in tok.encode(text, add_special_tokens=False)[:n]]
    return [d for d in out if d]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=2000)
    ap.add_argument("--log")
    args = ap.parse_args()
    tok = Tokenizer.from_dir(ensure_default_model())
    rng = random.Random(0)
    words = "the quick brown fox jumps over the lazy dog while the farmer watches".split()
    prose = " ".join(rng.choice(words) for _ in range(args.tokens))
    runs = ("a" * 300 + " ") * (args.tokens // 50 + 1)
    cases = [
        ("1 x 5 B", prose, ["User:"]),
        ("16 x 1 kB random", prose,
         ["".join(rng.choice("abcdefghij ") for _ in range(1024)) for _ in range(16)]),
        ("16 x 1 kB near-matching", runs, ["a" * (1023 - k) + "b" + "a" * k for k in range(16)]),
    ]
    lines = [f"tokens per run: up to {args.tokens}; us per token, median of 5 runs; build: the "
             "automaton, once per distinct stop list (cached)",
             "| stop strings | before (per string) | after (Aho-Corasick) | after steps/char | build ms |",
             "| --- | --- | --- | --- | --- |"]
    for name, text, stops in cases:
        deltas = deltas_of(tok, text, args.tokens)
        b, a = per_token_us(before, deltas, stops), per_token_us(after, deltas, stops)
        steps = after(deltas, stops) / sum(len(d) for d in deltas)
        _automaton.cache_clear()
        t0 = time.perf_counter()
        _automaton(tuple(stops))
        build = (time.perf_counter() - t0) * 1e3
        lines.append(f"| {name} | {b:.1f} | {a:.1f} | {steps:.2f} | {build:.1f} |")
    print("\n".join(lines))
    if args.log:
        Path(args.log).write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
