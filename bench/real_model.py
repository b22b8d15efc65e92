"""Real-model serving benchmark: SmolLM2-135M-Instruct (the default model, Q4_1 GGUF) served
by pdserve (1 prefill + 1 decode + gateway), `transformers serve --continuous-batching` and
llama.cpp's server (llama-cpp-python), in one run, with one client; plus transformers
`generate()` in this process as the single-stream reference.

    python bench/real_model.py [--model FILE.gguf] [--cpus 0,1] [--concurrency 1,8,32]
                               [--requests 4,16,32] [--prompt-tokens 64] [--output-tokens 64]

Same cores for everyone: this process pins itself to --cpus before starting any server, and
every server inherits that affinity; thread budgets: pdserve's two workers
--pdserve-threads torch threads each (default 1: the cores split between the two roles; with
len(cpus) each worker may use every core, as the others do -- at one stream the roles take
turns), transformers OMP_NUM_THREADS=len(cpus), llama.cpp --n_threads len(cpus). The GGUF file is the one input: pdserve and llama.cpp load it
directly; transformers serve gets transformers' own float32 dequantization of it saved as a
directory (hf_dir_from_gguf: it cannot serve the GGUF itself).

Workload: streaming /v1/chat/completions, greedy, max_tokens --output-tokens, distinct
prompts of --prompt-tokens tokens cut from the GPL-3 text, a closed loop of `concurrency`
clients, through pdserve.loadgen (the client of `pdserve bench`). TTFT = first content chunk;
output tokens = the final chunk's `usage`
(stream_options.include_usage) -- a server that sends none is marked "(chunks)" and its
content chunks are counted instead; ITL = (last chunk - first chunk) / (tokens - 1). A stream
that ends in an error chunk counts as an error, not as output. Percentiles: sim.stats.pct
(linear between closest ranks).
"""
from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pdserve import loadgen  # noqa: E402
from pdserve.launcher import Launcher, free_port  # noqa: E402
from sim.stats import pct  # noqa: E402,F401 -- bench/bad_day.py takes it from here

TEXT = Path("/usr/share/common-licenses/GPL-3")


def prompts(model: str, n: int, tokens: int) -> list[str]:
    from engine.tokenizer import Tokenizer
    tok = Tokenizer.from_dir(model)
    ids = tok.encode(TEXT.read_text(), add_special_tokens=False)
    step = max(1, (len(ids) - tokens) // n)
    return ["Summarize in one sentence: " + tok.decode(ids[i * step:i * step + tokens])
            for i in range(n)]


async def one(client, target, prompt, max_tokens) -> dict:
    """One streaming chat request (pdserve.loadgen's client, as `pdserve bench` sends it)."""
    r = await loadgen.send(client, target, loadgen.Job(prompt, max_tokens))
    if r["status"] != "ok":
        return {"error": r["error"]}
    return {"ttft": r["ttft_s"], "tokens": r["output_tokens"],
            "itl": [r["itl_s"]] if r["itl_s"] is not None else [],
            "usage": r["tokens_from_usage"]}


async def run_level(base, model, ps, concurrency, max_tokens) -> dict:
    target = loadgen.Target(base, model, endpoint="chat", timeout_s=600, ignore_eos=False)
    queue, results = list(ps), []
    async with loadgen.client(target, concurrency + 4) as client:
        await one(client, target, ps[0], 4)                                      # warm-up
        t0 = time.perf_counter()

        async def worker():
            while queue:      # a failed request (HTTP status, dropped stream) is an error
                results.append(await one(client, target, queue.pop(), max_tokens))
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        wall = time.perf_counter() - t0
    errors = [r["error"] for r in results if "error" in r]
    results = [r for r in results if "error" not in r]
    ttft = sorted(r["ttft"] for r in results)
    itl = sorted(x for r in results for x in r["itl"])
    return {"ttft_p50": pct(ttft, 50), "ttft_p99": pct(ttft, 99), "itl_p50": pct(itl, 50),
            "itl_p99": pct(itl, 99), "tok_s": sum(r["tokens"] for r in results) / wall,
            "requests": len(results), "tokens": sum(r["tokens"] for r in results),
            "usage": all(r["usage"] for r in results), "errors": errors}


def wait_http(url, proc, timeout):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}")
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)           # bounded by the deadline
    raise RuntimeError(f"{url} not ready in {timeout}s")


def run_levels(base, model, ps_by_level, max_tokens):
    return {c: asyncio.run(run_level(base, model, ps, c, max_tokens)) for c, ps in ps_by_level.items()}


def bench_pdserve(model, ps_by_level, max_tokens, log_dir, threads):
    port = free_port()
    t0 = time.perf_counter()
    worker = ["--num-threads", str(threads)]
    launcher = Launcher(model, 1, 1, http_port=port, log_dir=log_dir, prefill_args=worker,
                        decode_args=worker, gateway_args=["--request-timeout-s", "1800"])
    launcher.start(900)
    print(f"pdserve ready in {time.perf_counter() - t0:.0f}s", file=sys.stderr, flush=True)
    try:
        base = f"http://127.0.0.1:{port}"
        served = httpx.get(base + "/v1/models").json()["data"][0]["id"]
        return run_levels(base, served, ps_by_level, max_tokens)
    finally:
        launcher.stop()


def _serve(name, argv, env, log_dir, ready_path, model, ps_by_level, max_tokens, port):
    log = open(Path(log_dir) / f"{name}.log", "wb")
    proc = subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT,
                            stdin=subprocess.DEVNULL)
    try:
        base = f"http://127.0.0.1:{port}"
        wait_http(base + ready_path, proc, 900)
        return run_levels(base, model, ps_by_level, max_tokens)
    finally:
        proc.terminate()
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)
        log.close()


def hf_dir_from_gguf(model: str, out: Path) -> Path:
    """transformers' own GGUF loading, saved as a directory `transformers serve` accepts: it
    cannot serve `DIR:FILE.gguf` (its config from GGUF has no `architectures`) and
    `save_pretrained` refuses a GGUF-loaded model, so the state dict and config go by hand."""
    import torch
    import transformers as T
    from safetensors.torch import save_file
    p = Path(model)
    m = T.AutoModelForCausalLM.from_pretrained(p.parent, gguf_file=p.name, dtype=torch.float32)
    T.AutoTokenizer.from_pretrained(p.parent, gguf_file=p.name).save_pretrained(out)
    m.config.architectures = [type(m).__name__]
    m.config.save_pretrained(out)
    m.generation_config.save_pretrained(out)
    sd = {k: v.contiguous() for k, v in m.state_dict().items()
          if not (k == "lm_head.weight" and m.config.tie_word_embeddings)}
    save_file(sd, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


def bench_transformers(model, ps_by_level, max_tokens, log_dir, threads):
    exe = shutil.which("transformers")
    if exe is None:
        raise RuntimeError("the `transformers` command is not installed")
    port, name = free_port(), str(hf_dir_from_gguf(model, Path(log_dir) / "hf-model"))
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), HF_HUB_OFFLINE="1")
    argv = [exe, "serve", "--continuous-batching", "--cb-num-blocks", "256", "--cb-block-size",
            "32", "--host", "127.0.0.1", "--port", str(port), name]
    return _serve("transformers-serve", argv, env, log_dir, "/v1/models", name, ps_by_level,
                  max_tokens, port)


def bench_llamacpp(model, ps_by_level, max_tokens, log_dir, threads):
    port = free_port()
    argv = [sys.executable, "-m", "llama_cpp.server", "--model", model, "--n_threads",
            str(threads), "--n_threads_batch", str(threads), "--n_ctx", "4096",
            "--host", "127.0.0.1", "--port", str(port)]
    return _serve("llama-cpp", argv, dict(os.environ), log_dir, "/v1/models", model,
                  ps_by_level, max_tokens, port)


def bench_generate(model, prompt, max_tokens, threads) -> dict:
    """transformers generate(), one stream, float32 dequantized weights, in this process."""
    import torch
    import transformers as T
    torch.set_num_threads(threads)
    p = Path(model)
    tok = T.AutoTokenizer.from_pretrained(p.parent, gguf_file=p.name)
    m = T.AutoModelForCausalLM.from_pretrained(p.parent, gguf_file=p.name, dtype=torch.float32).eval()
    ids = torch.tensor([tok.apply_chat_template([{"role": "user", "content": prompt}],
                                                add_generation_prompt=True, tokenize=True,
                                                return_dict=False)])
    with torch.no_grad():
        m(ids)                                                           # warm-up
        t0 = time.perf_counter()
        m(ids)
        prefill = time.perf_counter() - t0
        t0 = time.perf_counter()
        out = m.generate(ids, max_new_tokens=max_tokens, min_new_tokens=max_tokens, do_sample=False)
        wall = time.perf_counter() - t0
    n = out.shape[1] - ids.shape[1]
    return {"prefill_s": prefill, "tok_s": n / wall, "tokens": n, "prompt_tokens": ids.shape[1]}


def perplexity_check(model: str, limit: int, context: int, stride: int) -> str:
    """Perplexity of the GPL-3 text's first `limit` tokens: pdserve's engine vs transformers'
    recipe (labels, loss) on the same tokens, windows and dequantized weights."""
    import math

    import torch
    import transformers as T

    from pdserve.eval import engine_logprobs, perplexity, table as ppl_table, text_ids
    ids = text_ids(model, TEXT, limit)
    ours = perplexity(ids, context, stride, engine_logprobs(model), "pdserve engine")
    p = Path(model)
    m = T.AutoModelForCausalLM.from_pretrained(p.parent, gguf_file=p.name, dtype=torch.float32).eval()
    nll, count, prev_end, x = 0.0, 0, 0, torch.tensor([ids])
    for begin in range(0, len(ids), stride):
        end = min(begin + context, len(ids))
        labels = x[:, begin:end].clone()
        labels[:, :-(end - prev_end)] = -100
        with torch.no_grad():
            loss = m(x[:, begin:end], labels=labels).loss.item()
        n = int((labels[:, 1:] != -100).sum())
        nll, count, prev_end = nll + loss * n, count + n, end
        if end == len(ids):
            break
    hf = math.exp(nll / count)
    return (ppl_table([ours], str(TEXT)) + f"\ntransformers (same tokens and windows): "
            f"{count} tokens, perplexity {hf:.4f}; pdserve / transformers = {ours.value / hf:.6f}")


METRICS = (("ttft_p50", "TTFT p50", 1e3, "ms"), ("ttft_p99", "TTFT p99", 1e3, "ms"),
           ("itl_p50", "ITL p50", 1e3, "ms"), ("itl_p99", "ITL p99", 1e3, "ms"),
           ("tok_s", "output tok/s", 1, ""))


def table(res: dict) -> str:
    names = list(res)
    peers = [n for n in names if n != "pdserve"]
    head = "| conc | metric | " + " | ".join(names) + " | " + \
        " | ".join(f"pdserve / {n}" for n in peers) + " |"
    rows = [head, "|" + " --- |" * (2 + len(names) + len(peers))]
    for c in res["pdserve"]:
        for key, label, scale, unit in METRICS:
            vals = {n: (res[n][c][key] * scale if res[n] and c in res[n] else float("nan"))
                    for n in names}
            cells = [f"{vals[n]:.1f}{unit}" + ("" if not res[n] or res[n][c]["usage"]
                                                or key != "tok_s" else " (chunks)") for n in names]
            ratios = [f"{vals['pdserve'] / vals[n]:.2f}" if vals[n] == vals[n] and vals[n] else "n/a"
                      for n in peers]
            rows.append(f"| {c} | {label} | " + " | ".join(cells) + " | " + " | ".join(ratios) + " |")
    return "\n".join(rows)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="", help="a GGUF file (default: pdserve's default model)")
    ap.add_argument("--cpus", default="0,1")
    ap.add_argument("--concurrency", default="1,8,32")
    ap.add_argument("--requests", default="4,16,32", help="requests per concurrency level")
    ap.add_argument("--prompt-tokens", type=int, default=64)
    ap.add_argument("--output-tokens", type=int, default=64)
    ap.add_argument("--servers", default="pdserve,transformers,llama.cpp")
    ap.add_argument("--pdserve-threads", type=int, default=1,
                    help="torch threads of each pdserve worker (1 or len(--cpus))")
    ap.add_argument("--perplexity", type=int, default=0, metavar="N", help="instead: perplexity "
                    "of the GPL-3's first N tokens, pdserve's engine vs transformers")
    args = ap.parse_args()
    cpus = [int(x) for x in args.cpus.split(",")]
    os.sched_setaffinity(0, cpus)          # every server started below inherits these cores
    if args.model:
        model = args.model
    else:
        from pdserve.default_model import resolve_default_model
        model = str(resolve_default_model())
    if args.perplexity:
        print(perplexity_check(model, args.perplexity, 512, 256))
        return 0
    levels = [int(x) for x in args.concurrency.split(",")]
    counts = [int(x) for x in args.requests.split(",")]
    ps = prompts(model, sum(counts), args.prompt_tokens)
    ps_by_level, at = {}, 0
    for c, n in zip(levels, counts):
        ps_by_level[c], at = ps[at:at + n], at + n
    log_dir = tempfile.mkdtemp(prefix="bench-real-model-")
    runners = {"pdserve": bench_pdserve, "transformers": bench_transformers,
               "llama.cpp": bench_llamacpp}
    res = {}
    for name in args.servers.split(","):
        t0 = time.time()
        try:
            threads = args.pdserve_threads if name == "pdserve" else len(cpus)
            res[name] = runners[name](model, ps_by_level, args.output_tokens, log_dir, threads)
        except (RuntimeError, OSError) as e:
            print(f"{name}: {e} (logs in {log_dir})", file=sys.stderr, flush=True)
            res[name] = None
        print(f"{name} done in {time.time() - t0:.0f}s", file=sys.stderr, flush=True)
    gen = bench_generate(model, ps[0], args.output_tokens, len(cpus))
    print(f"\nmodel {Path(model).name}; cpus {cpus} for every server (pdserve: 2 workers x "
          f"{args.pdserve_threads} torch thread(s); transformers: OMP_NUM_THREADS={len(cpus)}; llama.cpp: --n_threads "
          f"{len(cpus)}); ~{args.prompt_tokens}-token prompts, max {args.output_tokens} output "
          f"tokens, streaming chat, greedy; requests per level {dict(zip(levels, counts))}\n")
    print(table(res))
    for name, r in res.items():
        if r:
            print(f"{name}: " + ", ".join(f"c={c}: {x['requests']} req, {x['tokens']} tok, "
                                          f"usage={'yes' if x['usage'] else 'no'}, "
                                          f"{len(x['errors'])} errors {x['errors'][:1]}"
                                          for c, x in r.items()))
    print(f"\ntransformers generate() one stream ({len(cpus)} threads, float32): prefill of "
          f"{gen['prompt_tokens']} tokens {gen['prefill_s'] * 1e3:.1f} ms, decode "
          f"{gen['tok_s']:.1f} tok/s over {gen['tokens']} tokens")
    if res.get("pdserve"):
        one_ = res["pdserve"][levels[0]]
        print(f"pdserve c={levels[0]}: {one_['tok_s'] / gen['tok_s']:.2f}x generate() tok/s, "
              f"TTFT p50 {one_['ttft_p50'] * 1e3:.1f} ms vs 1.2 x prefill + 5 ms = "
              f"{(1.2 * gen['prefill_s'] + 0.005) * 1e3:.1f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
