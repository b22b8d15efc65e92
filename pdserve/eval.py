"""`pdserve eval perplexity`: perplexity of a text file under a model, to check that a
variant (a precision, a quantization) keeps its accuracy on your own data.

The text is tokenized once (the model's tokenizer, BOS as the tokenizer adds it) and cut
into sliding windows (transformers' recipe for fixed-length models): each window holds at
most `context` tokens, starts `stride` tokens after the previous one, and scores only the
tokens no earlier window scored, so every token after the first is scored once, with at
least context - stride tokens of left context (fewer in the first window).

    perplexity = exp(sum of -log p(token | window before it) / tokens scored)

Two ways to get the log-probabilities, which must agree:
  * the engine in this process: prompt logprobs (SamplingParams.prompt_logprobs=0);
  * `--url`: a running server's POST /v1/completions with the window's token ids as the
    prompt, `echo` and `logprobs=0`, `max_tokens=0` -- the request lm-eval's
    `local-completions` model makes for loglikelihoods. `--model` then only gives the
    tokenizer (torch is not imported).
"""
from __future__ import annotations

import json
import math
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

HTTP_TIMEOUT_S = 600.0
HTTP_PARALLEL = 4


@dataclass
class Perplexity:
    source: str
    tokens: int          # tokens scored
    windows: int
    context: int
    stride: int
    nll: float           # sum over the scored tokens

    @property
    def value(self) -> float:
        return math.exp(self.nll / self.tokens)


def windows(n: int, context: int, stride: int) -> list[tuple[int, int, int]]:
    """(begin, end, first scored position) per window over n tokens."""
    if not 1 <= stride < context:      # a window's first token has no logprob of its own
        raise ValueError(f"need 1 <= stride < context, got stride {stride}, context {context}")
    if n < 2:
        raise ValueError("the text has fewer than 2 tokens: nothing to score")
    out, scored_to = [], 1            # position 0 has nothing before it
    for begin in range(0, n, stride):
        end = min(begin + context, n)
        out.append((begin, end, scored_to))
        scored_to = end
        if end == n:
            break
    return out


def perplexity(ids: list[int], context: int, stride: int, logprobs_of, source: str) -> Perplexity:
    """`logprobs_of(list of windows' ids)` -> per window, the log-probability of each of its
    tokens given the ones before it (the first one's is None)."""
    wins = windows(len(ids), context, stride)
    lps = logprobs_of([ids[b:e] for b, e, _ in wins])
    nll, count = 0.0, 0
    for (b, e, first), lp in zip(wins, lps):
        if len(lp) != e - b:
            raise RuntimeError(f"{source}: {len(lp)} logprobs for a window of {e - b} tokens")
        nll -= sum(lp[j - b] for j in range(first, e))
        count += e - first
    return Perplexity(source, count, len(wins), context, stride, nll)


def engine_logprobs(model: str, **engine_kw):
    """A logprobs_of for windows scored by an engine in this process."""
    from engine import LLM, SamplingParams
    llm = LLM(model, **engine_kw)
    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0)

    def logprobs_of(prompts):
        limit = llm.engine.config.model.max_model_len
        if max(len(p) for p in prompts) >= limit:
            raise ValueError(f"--context must be below the model's context length {limit}")
        return [[lp for lp, _ in o.prompt_logprobs] for o in llm.generate(prompts, params)]
    return logprobs_of


def url_logprobs(url: str, served_model: str = ""):
    """A logprobs_of for windows scored by a server's /v1/completions (echo + logprobs)."""
    base = url.rstrip("/").removesuffix("/v1")
    model = served_model or _get(f"{base}/v1/models")["data"][0]["id"]

    def one(prompt):
        body = {"model": model, "prompt": prompt, "max_tokens": 0, "echo": True,
                "logprobs": 0, "temperature": 0.0}
        return _post(f"{base}/v1/completions", body)["choices"][0]["logprobs"]["token_logprobs"]

    def logprobs_of(prompts):
        with ThreadPoolExecutor(HTTP_PARALLEL) as pool:
            return list(pool.map(one, prompts))
    return logprobs_of


def _get(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=HTTP_TIMEOUT_S) as r:
        return json.load(r)


def _post(url: str, body: dict) -> dict:
    req = urllib.request.Request(url, json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=HTTP_TIMEOUT_S) as r:
            return json.load(r)
    except urllib.error.HTTPError as e:
        raise RuntimeError(f"{url}: HTTP {e.code}: {e.read().decode(errors='replace')[:500]}") \
            from None


def text_ids(model: str, data: str | Path, limit: int | None = None) -> list[int]:
    from engine.tokenizer import Tokenizer
    ids = Tokenizer.from_dir(model).encode(Path(data).read_text(encoding="utf-8"))
    return ids[:limit] if limit else ids


def table(results: list[Perplexity], data: str) -> str:
    head = f"{'source':<40} {'tokens':>8} {'windows':>8} {'context':>8} {'stride':>7} " \
           f"{'mean NLL':>9} {'perplexity':>11}"
    rows = [f"{r.source:<40} {r.tokens:>8} {r.windows:>8} {r.context:>8} {r.stride:>7} "
            f"{r.nll / r.tokens:>9.5f} {r.value:>11.4f}" for r in results]
    return "\n".join([f"perplexity of {data}", head, *rows])


def main(args) -> int:
    """`pdserve eval perplexity` (args from pdserve.cli)."""
    stride = args.stride or max(1, args.context // 2)
    try:
        ids = text_ids(args.model, args.data, args.limit)
        if args.url:
            source, fn = f"url {args.url}", url_logprobs(args.url, args.served_model_name)
        else:
            source, fn = f"engine {Path(args.model).name}", engine_logprobs(
                args.model, device=args.device, dtype=args.dtype)
        result = perplexity(ids, args.context, stride, fn, source)
    except (ValueError, OSError, RuntimeError) as e:
        raise SystemExit(f"pdserve eval perplexity: {e}")
    print(table([result], args.data), flush=True)
    return 0
