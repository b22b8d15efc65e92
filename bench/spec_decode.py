"""Speculative decoding: tokens/s per request with and without it, same engine, same process.

Two workloads of chat prompts: one whose answer repeats its prompt (rewrite / extract / quote a
given text: n-gram lookup finds the continuation in the prompt) and one whose answer does not
(free writing). For each batch width, the batch's requests are added together and stepped to
the end, first with speculation off, then on; greedy, so the outputs must be identical (checked).

    python bench/spec_decode.py --model DIR [--spec ngram:n=3,k=4] [--threads 2]

Per-request tok/s: each request's output tokens over the time from the batch's start to its
own last token, averaged over the batch. Acceptance: accepted / proposed tokens; mean accepted
length: accepted tokens per verified proposal. Output tokens come from the engine's outputs.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

PASSAGE = ("The committee met on Tuesday to review the budget for the new library. After a long "
           "discussion, members agreed to move the reading room to the second floor, to extend "
           "opening hours on weekends, and to buy two hundred new books for the children's section. "
           "The chair thanked the volunteers who had organised the book fair in the spring.")

REPEATING = [
    f"Repeat the following text exactly, word for word:\n\n{PASSAGE}",
    f"Copy this paragraph, but write every sentence on its own line:\n\n{PASSAGE}",
    f"Here is a text:\n\n{PASSAGE}\n\nQuote the sentence about the reading room, then the sentence about the volunteers.",
    f"Fix the capitalisation of this text and return it in full:\n\n{PASSAGE.lower()}",
]
FREE = [
    "Write a short story about a lighthouse keeper who finds a strange bottle.",
    "Explain why the sky is blue to a ten year old.",
    "Give me five ideas for a rainy weekend with friends.",
    "Describe the taste of a lemon to someone who has never had one.",
]


def run_batch(engine, prompts, max_tokens):
    from engine import SamplingParams
    params = SamplingParams(temperature=0, max_tokens=max_tokens)
    t0 = time.perf_counter()
    for i, p in enumerate(prompts):
        engine.add_request(f"b{i}", p, params)
    done, ends = {}, {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.finished:
                done[o.request_id] = list(o.token_ids)
                ends[o.request_id] = time.perf_counter() - t0
    per_req = [len(done[r]) / ends[r] for r in done]
    return done, sum(per_req) / len(per_req), sum(len(v) for v in done.values()) / max(ends.values())


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True, help="model directory (HF format)")
    ap.add_argument("--spec", default="ngram:n=3,k=4")
    ap.add_argument("--batches", default="1,4,16")
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--threads", type=int, default=int(os.environ.get("OMP_NUM_THREADS", "2")))
    a = ap.parse_args()
    import torch
    torch.set_num_threads(a.threads)
    from engine import LLMEngine

    base = LLMEngine.from_model_dir(a.model, num_blocks=2048)
    spec = LLMEngine.from_model_dir(a.model, num_blocks=2048, speculative=a.spec)
    tok = base.tokenizer
    workloads = {name: [tok.encode(tok.apply_chat_template([{"role": "user", "content": t}]),
                                   add_special_tokens=False) for t in texts]
                 for name, texts in (("repeating", REPEATING), ("free", FREE))}
    run_batch(base, workloads["free"][:1], 8)            # warm up both
    run_batch(spec, workloads["free"][:1], 8)
    print(f"model {a.model}, {a.threads} threads, greedy, max_tokens {a.max_tokens}, spec {a.spec}")
    print(f"{'workload':<10} {'batch':>5} | {'tok/s/req off':>13} {'on':>8} {'ratio':>6} | "
          f"{'agg tok/s off':>13} {'on':>8} | {'accept':>6} {'acc len':>7} | same")
    for name, prompts in workloads.items():
        for b in map(int, a.batches.split(",")):
            batch = [prompts[i % len(prompts)] for i in range(b)]
            out0, per0, agg0 = run_batch(base, batch, a.max_tokens)
            s0 = spec.stats()
            out1, per1, agg1 = run_batch(spec, batch, a.max_tokens)
            s1 = spec.stats()
            proposed = s1.spec_num_draft_tokens - s0.spec_num_draft_tokens
            accepted = s1.spec_num_accepted_tokens - s0.spec_num_accepted_tokens
            drafts = s1.spec_num_drafts - s0.spec_num_drafts
            print(f"{name:<10} {b:>5} | {per0:>13.1f} {per1:>8.1f} {per1 / per0:>5.2f}x | "
                  f"{agg0:>13.1f} {agg1:>8.1f} | {accepted / max(proposed, 1):>6.2f} "
                  f"{accepted / max(drafts, 1):>7.2f} | {out0 == out1}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
