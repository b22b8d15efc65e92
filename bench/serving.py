"""Serving benchmark: pdserve (1 prefill + 1 decode + gateway, OpenAI REST) vs
`transformers serve --continuous-batching` on the same model directory, same client.

    python bench/serving.py [--model DIR] [--requests 200] [--concurrency 1,8,32]
                            [--prompt-tokens 128] [--output-tokens 64]

Workload: streaming /v1/chat/completions, greedy, max_tokens = --output-tokens, prompts of
about --prompt-tokens tokens (distinct, so prefix caches do not help), at each concurrency
(a closed loop of that many clients). Per request: TTFT (first content chunk), output tokens
(the streamed text re-tokenized with the model's tokenizer: a server may send several tokens
in one chunk when its client falls behind), ITL = time per output token after the first,
(last chunk - first chunk) / (tokens - 1). Prints one markdown table with both servers side
by side and the ratios
(pdserve / transformers: < 1 is better for latencies, > 1 for throughput).

The peer ignores `ignore_eos` (it rejects it), so both run without it; the tiny model
rarely emits EOS, and output tok/s counts the tokens actually streamed.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pdserve.launcher import Launcher, free_port  # noqa: E402

TOKENIZER = None   # the model's (engine.tokenizer.Tokenizer), set in main()


def prompts(model_dir: str, n: int, tokens: int) -> list[str]:
    from engine.tiny_model import CORPUS
    from engine.tokenizer import Tokenizer

    tok = Tokenizer.from_dir(model_dir)
    words = CORPUS.split()
    out = []
    for i in range(n):
        rot = words[(i * 7) % len(words):] + words[:(i * 7) % len(words)]
        text = f"Request {i}: " + " ".join(rot)
        ids = tok.encode(text, add_special_tokens=False)
        while len(ids) < tokens:
            text += " " + " ".join(rot)
            ids = tok.encode(text, add_special_tokens=False)
        out.append(tok.decode(ids[:tokens]))
    return out


async def one(client: httpx.AsyncClient, url: str, model: str, prompt: str, max_tokens: int) -> dict:
    body = {"model": model, "messages": [{"role": "user", "content": prompt}],
            "max_tokens": max_tokens, "temperature": 0, "stream": True}
    t0 = time.perf_counter()
    stamps, text = [], []
    async with client.stream("POST", url, json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"{r.status_code}: {(await r.aread())[:300]!r}")
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            for c in chunk.get("choices") or []:
                content = (c.get("delta") or {}).get("content")
                if content:
                    stamps.append(time.perf_counter())
                    text.append(content)
    n = len(TOKENIZER.encode("".join(text), add_special_tokens=False)) if text else 0
    return {"ttft": stamps[0] - t0 if stamps else float("nan"),
            "itl": [(stamps[-1] - stamps[0]) / (n - 1)] if n > 1 else [], "tokens": n,
            "e2e": time.perf_counter() - t0}


async def run_level(base: str, model: str, ps: list[str], concurrency: int, max_tokens: int) -> dict:
    url = base + "/v1/chat/completions"
    queue = list(ps)
    results = []
    limits = httpx.Limits(max_connections=concurrency + 4)
    async with httpx.AsyncClient(timeout=300, limits=limits) as client:
        await one(client, url, model, ps[0], 4)                     # warm-up
        t0 = time.perf_counter()

        async def worker():
            while queue:
                results.append(await one(client, url, model, queue.pop(), max_tokens))
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        wall = time.perf_counter() - t0
    ttft = sorted(r["ttft"] for r in results)
    itl = sorted(x for r in results for x in r["itl"])
    return {"ttft_p50": pct(ttft, 50), "ttft_p99": pct(ttft, 99), "itl_p50": pct(itl, 50),
            "itl_p99": pct(itl, 99), "tok_s": sum(r["tokens"] for r in results) / wall,
            "requests": len(results), "tokens": sum(r["tokens"] for r in results)}


def pct(xs: list[float], p: float) -> float:
    if not xs:
        return float("nan")
    k = min(len(xs) - 1, max(0, round(p / 100 * (len(xs) - 1))))
    return xs[k]


def wait_http(url: str, proc: subprocess.Popen | None, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}")
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.25)          # bounded by the deadline above
    raise RuntimeError(f"{url} not ready in {timeout}s")


def bench_pdserve(model_dir: str, ps, levels, max_tokens, log_dir) -> dict:
    port = free_port()
    launcher = Launcher(model_dir, 1, 1, http_port=port, log_dir=log_dir)
    launcher.start(300)
    try:
        base = f"http://127.0.0.1:{port}"
        wait_http(base + "/health", None, 60)
        model = httpx.get(base + "/v1/models").json()["data"][0]["id"]
        return {c: asyncio.run(run_level(base, model, ps, c, max_tokens)) for c in levels}
    finally:
        launcher.stop()


def bench_transformers(model_dir: str, ps, levels, max_tokens, log_dir) -> dict:
    exe = shutil.which("transformers")
    if exe is None:
        raise RuntimeError("the `transformers` command is not installed")
    port = free_port()
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1")
    log = open(Path(log_dir) / "transformers-serve.log", "wb")
    proc = subprocess.Popen([exe, "serve", "--continuous-batching", "--cb-num-blocks", "256",
                             "--cb-block-size", "32", "--host", "127.0.0.1", "--port", str(port),
                             model_dir], env=env, stdout=log, stderr=subprocess.STDOUT,
                            stdin=subprocess.DEVNULL)
    try:
        base = f"http://127.0.0.1:{port}"
        wait_http(base + "/v1/models", proc, 180)
        return {c: asyncio.run(run_level(base, model_dir, ps, c, max_tokens)) for c in levels}
    finally:
        proc.terminate()
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)
        log.close()


def table(pd: dict, hf: dict | None) -> str:
    rows = ["| conc | metric | pdserve | transformers serve | ratio |", "| --- | --- | --- | --- | --- |"]
    for c, r in pd.items():
        for key, name, scale, unit in (("ttft_p50", "TTFT p50", 1e3, "ms"), ("ttft_p99", "TTFT p99", 1e3, "ms"),
                                       ("itl_p50", "ITL p50", 1e3, "ms"), ("itl_p99", "ITL p99", 1e3, "ms"),
                                       ("tok_s", "output tok/s", 1, "")):
            a = r[key] * scale
            b = hf[c][key] * scale if hf else float("nan")
            ratio = a / b if hf and b else float("nan")
            rows.append(f"| {c} | {name} | {a:.1f}{unit} | {b:.1f}{unit} | {ratio:.2f} |")
    return "\n".join(rows)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="")
    ap.add_argument("--requests", type=int, default=200)
    ap.add_argument("--concurrency", default="1,8,32")
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--output-tokens", type=int, default=64)
    ap.add_argument("--skip-peer", action="store_true")
    args = ap.parse_args()
    if args.model:
        model_dir = args.model
    else:
        from engine.tiny_model import ensure_default_model
        model_dir = str(ensure_default_model())
    levels = [int(x) for x in args.concurrency.split(",")]
    global TOKENIZER
    from engine.tokenizer import Tokenizer
    TOKENIZER = Tokenizer.from_dir(model_dir)
    ps = prompts(model_dir, args.requests, args.prompt_tokens)
    log_dir = tempfile.mkdtemp(prefix="bench-serving-")
    t0 = time.time()
    pd = bench_pdserve(model_dir, ps, levels, args.output_tokens, log_dir)
    print(f"pdserve done in {time.time() - t0:.0f}s", file=sys.stderr, flush=True)
    hf = None
    if not args.skip_peer:
        try:
            hf = bench_transformers(model_dir, ps, levels, args.output_tokens, log_dir)
        except RuntimeError as e:
            print(f"transformers serve: {e} (logs in {log_dir})", file=sys.stderr)
    print(f"\n{args.requests} requests per level, ~{args.prompt_tokens}-token prompts, "
          f"max {args.output_tokens} output tokens, streaming chat, greedy\n")
    print(table(pd, hf))
    for name, res in (("pdserve", pd), ("transformers", hf)):
        if res:
            print(f"{name}: " + ", ".join(f"c={c}: {r['requests']} req, {r['tokens']} tok"
                                          for c, r in res.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
