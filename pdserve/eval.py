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
    `local-completions` model makes for loglikelihoods. The server tokenizes the text too
    (POST /tokenize, vLLM's), and the model id is the first of its /v1/models unless
    `--served-model-name` says; no `--model` is needed (given, its tokenizer is used;
    torch is not imported either way).
"""
from __future__ import annotations

import json
import math
import time
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
    from engine import LLM
    return llm_logprobs(LLM(model, **engine_kw))


def llm_logprobs(llm):
    """A logprobs_of for windows scored by the offline engine `llm`."""
    from engine import SamplingParams
    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0)

    def logprobs_of(prompts):
        limit = llm.engine.config.model.max_model_len
        if max(len(p) for p in prompts) >= limit:
            raise ValueError(f"--context must be below the model's context length {limit}")
        return [[lp for lp, _ in o.prompt_logprobs] for o in llm.generate(prompts, params)]
    return logprobs_of


def served_model_id(url: str, served_model: str = "") -> str:
    """`served_model`, else the first model of the server's /v1/models."""
    return served_model or _get(f"{_base(url)}/v1/models")["data"][0]["id"]


def url_text_ids(url: str, model: str, data: str | Path, limit: int | None = None) -> list[int]:
    """The text's token ids by the server's own tokenizer (POST /tokenize)."""
    text = Path(data).read_text(encoding="utf-8")
    ids = _post(f"{_base(url)}/tokenize", {"model": model, "prompt": text})["tokens"]
    return ids[:limit] if limit else ids


def _base(url: str) -> str:
    return url.rstrip("/").removesuffix("/v1")


def url_logprobs(url: str, served_model: str = ""):
    """A logprobs_of for windows scored by a server's /v1/completions (echo + logprobs)."""
    base = _base(url)
    model = served_model_id(url, served_model)

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


@dataclass
class Variant:
    quantization: str
    kv_cache_dtype: str
    ppl: Perplexity
    identical: int         # prompts whose greedy tokens all equal the baseline's
    prefix_agree: float    # share of greedy tokens before the first difference from the baseline
    weight_mb: float
    bf16_mb: float         # the same parameters in bfloat16
    kv_bytes_per_token: float
    decode_tok_s: float


AGREE_PROMPTS, AGREE_PROMPT_TOKENS, AGREE_TOKENS, SPEED_TOKENS = 16, 32, 32, 64


def _decode_tok_s(llm, prompt: list[int], n: int) -> float:
    """One stream: tokens/s from the first generated token to the n-th."""
    from engine import SamplingParams
    eng = llm.engine
    eng.add_request(f"speed-{time.monotonic_ns()}", prompt,
                    SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True))
    t_first = None
    while eng.has_unfinished_requests():
        for o in eng.step():
            if t_first is None:
                t_first = time.perf_counter()
    return (n - 1) / (time.perf_counter() - t_first)


def variants(model: str, ids: list[int], context: int, stride: int, quantizations: list[str],
             kv_dtypes: list[str], **engine_kw) -> list[Variant]:
    """Every (quantization, KV dtype) pair, the unquantized model first: perplexity, greedy
    agreement with the unquantized model on prompts cut from the same text, weight and KV
    memory, single-stream decode speed."""
    from engine import LLM, SamplingParams
    from engine.quant.quantize import weight_bytes
    pairs = [("none", "auto")] + [(q, kv) for q in quantizations for kv in kv_dtypes
                                  if (q, kv) != ("none", "auto")]
    step = max(1, (len(ids) - AGREE_PROMPT_TOKENS) // AGREE_PROMPTS)
    prompts = [ids[i:i + AGREE_PROMPT_TOKENS] for i in range(0, step * AGREE_PROMPTS, step)]
    greedy = SamplingParams(temperature=0.0, max_tokens=AGREE_TOKENS, ignore_eos=True)
    out, base = [], None
    for q, kv in pairs:
        llm = LLM(model, quantization=q, kv_cache_dtype=kv, **engine_kw)
        ppl = perplexity(ids, context, stride, llm_logprobs(llm), f"{q} / kv {kv}")
        toks = [list(o.token_ids) for o in llm.generate(prompts, greedy)]
        base = base or toks
        same = [next((i for i, (a, b) in enumerate(zip(t, r)) if a != b), len(r)) for t, r in zip(toks, base)]
        mc, cc = llm.engine.config.model, llm.engine.config.cache
        kv_elt = llm.engine.kv_cache.element_size()
        kv_tok = mc.num_layers * 2 * mc.num_kv_heads * (mc.head_dim * kv_elt
                                                        + (4 / cc.block_size if kv_elt == 1 else 0))
        out.append(Variant(q, kv, ppl, sum(n == len(r) for n, r in zip(same, base)),
                           sum(same) / sum(map(len, base)), weight_bytes(llm.engine.model) / 1e6,
                           out[0].bf16_mb if out else 2 * _params(llm.engine.model) / 1e6, kv_tok,
                           _decode_tok_s(llm, prompts[0], SPEED_TOKENS)))
        del llm
    return out


def _params(model) -> int:
    return sum(t.numel() for t in model.state_dict().values())


def variant_table(rows: list[Variant], data: str) -> str:
    base = rows[0]
    head = ("| quantization | KV cache | perplexity | vs none | identical greedy | agreeing tokens "
            "| weights MB | vs bf16 | KV bytes/token | decode tok/s | vs none |")
    lines = [f"perplexity of {data} ({base.ppl.tokens} tokens, context {base.ppl.context}, stride "
             f"{base.ppl.stride}); greedy: {AGREE_PROMPTS} prompts of {AGREE_PROMPT_TOKENS} tokens from "
             f"the same text, {AGREE_TOKENS} tokens each; decode: one stream, {SPEED_TOKENS} tokens",
             "", head, "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r.quantization} | {r.kv_cache_dtype} | {r.ppl.value:.4f} | "
                     f"{100 * (r.ppl.value / base.ppl.value - 1):+.2f}% | {r.identical}/{AGREE_PROMPTS} | "
                     f"{100 * r.prefix_agree:.1f}% | {r.weight_mb:.1f} | {r.weight_mb / r.bf16_mb:.2f}x | "
                     f"{r.kv_bytes_per_token:.0f} | {r.decode_tok_s:.1f} | "
                     f"{r.decode_tok_s / base.decode_tok_s:.2f}x |")
    return "\n".join(lines)


def main(args) -> int:
    """`pdserve eval perplexity` (args from pdserve.cli)."""
    stride = args.stride or max(1, args.context // 2)
    quants, kvs = getattr(args, "quantization", None), getattr(args, "kv_cache_dtype", None)
    if not args.model and not args.url:
        raise SystemExit("pdserve eval perplexity: give --model (a local engine) or --url "
                         "(a running server)")
    if (quants or kvs) and not args.url:
        try:
            rows = variants(args.model, text_ids(args.model, args.data, args.limit), args.context,
                            stride, quants or ["none"], kvs or ["auto"], device=args.device,
                            dtype=args.dtype)
        except (ValueError, OSError, RuntimeError) as e:
            raise SystemExit(f"pdserve eval perplexity: {e}")
        print(variant_table(rows, args.data), flush=True)
        return 0
    try:
        if args.url:
            model = served_model_id(args.url, args.served_model_name)
            ids = (text_ids(args.model, args.data, args.limit) if args.model else
                   url_text_ids(args.url, model, args.data, args.limit))
            source, fn = f"url {args.url}", url_logprobs(args.url, model)
        else:
            ids = text_ids(args.model, args.data, args.limit)
            source, fn = f"engine {Path(args.model).name}", engine_logprobs(
                args.model, device=args.device, dtype=args.dtype)
        result = perplexity(ids, args.context, stride, fn, source)
    except (ValueError, OSError, RuntimeError) as e:
        raise SystemExit(f"pdserve eval perplexity: {e}")
    print(table([result], args.data), flush=True)
    return 0
