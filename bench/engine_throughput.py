"""Offline throughput: pdserve's engine vs transformers `generate()` on the same model, same
prompts, same machine, one run. Prints a markdown table (output tokens/s and the ratio).

    python bench/engine_throughput.py [--model DIR] [--requests 64] [--input-len 128]
                                      [--output-len 64] [--hf-batch 16]
"""
from __future__ import annotations

import argparse
import os
import random
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

from engine import LLM, SamplingParams  # noqa: E402
from engine.tiny_model import ensure_default_model  # noqa: E402


def run_pdserve(model_dir, prompts, out_lens):
    llm = LLM(model_dir, max_num_batched_tokens=4096, max_num_seqs=256)
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in out_lens]
    llm.generate([prompts[0]], SamplingParams(temperature=0.0, max_tokens=2))   # warm-up
    t = time.perf_counter()
    outs = llm.generate(prompts, params)
    dt = time.perf_counter() - t
    return sum(len(o.token_ids) for o in outs), dt, [o.token_ids for o in outs]


def run_transformers(model_dir, prompts, out_lens, batch):
    """Static batches: each batch runs until its longest request is done (as `generate()`
    does); only the tokens each request asked for are counted."""
    import transformers
    transformers.logging.disable_progress_bar()
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None
    model.generate(torch.tensor([prompts[0]]), max_new_tokens=2, do_sample=False, pad_token_id=0)
    n, outs = 0, []
    t = time.perf_counter()
    for i in range(0, len(prompts), batch):
        chunk = prompts[i:i + batch]           # equal prompt lengths: no padding needed
        want = out_lens[i:i + batch]
        with torch.inference_mode():
            g = model.generate(torch.tensor(chunk), attention_mask=torch.ones(len(chunk), len(chunk[0]), dtype=torch.long),
                               max_new_tokens=max(want), min_new_tokens=max(want), do_sample=False, pad_token_id=0)
        new = [row[:k] for row, k in zip(g[:, len(chunk[0]):].tolist(), want)]
        outs += new
        n += sum(len(x) for x in new)
    return n, time.perf_counter() - t, outs


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--hf-batch", type=int, default=16)
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    model_dir = a.model or str(ensure_default_model())
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 1000) for _ in range(a.input_len)] for _ in range(a.requests)]
    print(f"\nmodel: {model_dir}; {a.requests} requests, {a.input_len} tokens in, greedy, "
          f"{a.threads} threads, torch {torch.__version__}\n")
    print("| workload | engine | output tokens | seconds | output tok/s | vs transformers | greedy identical |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    workloads = {f"{a.output_len} out each": [a.output_len] * a.requests,
                 f"{a.output_len // 4}-{a.output_len * 2} out (mixed)":
                     [rng.randint(a.output_len // 4, a.output_len * 2) for _ in range(a.requests)]}
    for name, lens in workloads.items():
        pd_n, pd_t, pd_out = run_pdserve(model_dir, prompts, lens)
        hf_n, hf_t, hf_out = run_transformers(model_dir, prompts, lens, a.hf_batch)
        same = sum(x == y for x, y in zip(pd_out, hf_out))
        print(f"| {name} | transformers generate (static batch {a.hf_batch}) | {hf_n} | {hf_t:.2f} "
              f"| {hf_n / hf_t:,.0f} | 1.00x | |")
        print(f"| {name} | pdserve engine (continuous batching) | {pd_n} | {pd_t:.2f} "
              f"| {pd_n / pd_t:,.0f} | {(pd_n / pd_t) / (hf_n / hf_t):.2f}x | {same}/{a.requests} |")


if __name__ == "__main__":
    main()
