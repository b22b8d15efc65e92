"""Turns one step's logits into tokens, following vLLM's order of operations.

    raw logits [B, V] ──► raw logprobs = log_softmax(raw)      (what is reported, vLLM default)
         │
         ├─ logit_bias                        per-token additive bias
         ├─ min_tokens                        EOS / stop_token_ids -> -inf until enough output
         ├─ repetition penalty                prompt + output tokens (divide > 0, multiply < 0)
         ├─ presence / frequency penalties    output tokens (OpenAI semantics)
         ├─ allowed-token mask                structured output (engine/structured.py)
         │
         ├─ greedy rows (temperature == 0):   argmax
         └─ other rows: / temperature, top-k, top-p, min-p masks, then sample

Sampling uses the exponential race (argmax of probs / Exp(1) noise), which is equivalent to
drawing from `probs`. A row with its own `generator` draws its noise on the CPU from it, so
its tokens depend on its seed only, never on its batch neighbours or on the device.

Two implementations of the same steps: `Sampler` (the CPU path and the reference) and
`DeviceSampler`, which keeps the logits where the model left them (the GPU, right after the
decode graph), builds each step's per-row parameters in a few host-to-device copies and sends
back one small tensor: the sampled ids, their raw logprobs and the requested top logprobs.
tests/kernels/test_device_sampler.py holds the two to the same tokens.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

NEG_INF = float("-inf")


@dataclass
class SamplerOutput:
    token_ids: list[int]
    logprobs: list[float]                                   # raw log-prob of each sampled token
    top_logprobs: list[list[tuple[int, float]] | None]      # k best raw (id, logprob) or None


class Sampler:
    """Samples one token per row. Rows are duck-typed requests (see `__call__`)."""

    def __init__(self, eos_token_ids: set[int]):
        self.eos_token_ids = set(eos_token_ids)

    def __call__(self, logits: torch.Tensor, rows: Sequence,
                 allowed: torch.Tensor | None = None) -> SamplerOutput:
        """logits: float [B, V]; rows[i] has sampling_params, prompt_token_ids,
        output_token_ids and generator (torch.Generator | None). allowed: bool [B, V] or None,
        tokens a grammar permits (raw logprobs are reported before it, like the others)."""
        assert logits.dim() == 2 and logits.shape[0] == len(rows), (logits.shape, len(rows))
        raw_logprobs, x = self._process(logits, rows, allowed)
        token_ids = sample(x, rows)
        return _gather_logprobs(raw_logprobs, token_ids, [r.sampling_params for r in rows])

    def verify(self, logits: torch.Tensor, row, allowed: torch.Tensor | None,
               draft: int | None) -> tuple[SamplerOutput, bool]:
        """One speculative position (engine/spec_decode.py): logits [1, V] for `row` in its
        current state; `draft` the token a point-mass proposer put there (None: the bonus
        position). Greedy rows take the argmax, which accepts the draft iff they agree. Sampled
        rows accept the draft with probability p(draft) and otherwise draw from p with the
        draft removed, so the emitted token is distributed exactly as p (p: the processed
        distribution `sample` draws from). Returns the token (with its raw logprobs) and
        whether it is the accepted draft."""
        raw_logprobs, x = self._process(logits, [row], allowed)
        p = row.sampling_params
        if p.greedy:
            token = int(x[0].argmax())
        else:
            probs = processed_probs(x, [p])[0]
            token = None
            if draft is not None:
                u = torch.rand((), generator=row.generator) if row.generator is not None else torch.rand(())
                if float(u) < float(probs[draft]):
                    token = draft
                else:
                    probs = probs.clone()
                    probs[draft] = 0.0       # the exponential race needs no renormalising
            if token is None:
                token = int((probs / _exponential_noise((1, x.shape[1]), [row])[0].to(x.device)).argmax())
        return _gather_logprobs(raw_logprobs, [token], [p]), draft is not None and token == draft

    def _process(self, logits: torch.Tensor, rows: Sequence, allowed: torch.Tensor | None):
        """(raw logprobs, processed logits): every logits processor, in vLLM's order."""
        logits = logits.float()
        raw_logprobs = torch.log_softmax(logits, dim=-1)
        x = logits.clone()
        apply_logit_bias(x, [r.sampling_params for r in rows])
        apply_min_tokens(x, rows, self.eos_token_ids)
        apply_penalties(x, rows)
        if allowed is not None:
            apply_allowed_mask(x, logits, allowed)
        return raw_logprobs, x


# ----------------------------------------------------------------------------- logits processors

def apply_logit_bias(x: torch.Tensor, params: Sequence) -> None:
    """In place: x[i, t] += params[i].logit_bias[t] (ids outside the vocab are ignored)."""
    vocab = x.shape[1]
    for i, p in enumerate(params):
        if p.logit_bias:
            ids = [t for t in p.logit_bias if 0 <= t < vocab]
            if ids:
                bias = torch.tensor([p.logit_bias[t] for t in ids], dtype=x.dtype)
                x[i, torch.tensor(ids)] += bias.to(x.device)


def apply_min_tokens(x: torch.Tensor, rows: Sequence, eos_token_ids: set[int]) -> None:
    """In place: forbid stop tokens while a row has fewer than min_tokens outputs.

    Stop tokens are stop_token_ids plus the EOS ids, except with ignore_eos: then EOS does not
    stop the request anyway, so there is nothing to forbid (vLLM does the same).
    """
    vocab = x.shape[1]
    for i, r in enumerate(rows):
        p = r.sampling_params
        if len(r.output_token_ids) >= p.min_tokens:
            continue
        stop_ids = set(p.stop_token_ids) | (set() if p.ignore_eos else eos_token_ids)
        ids = [t for t in stop_ids if 0 <= t < vocab]
        if ids:
            x[i, torch.tensor(ids, device=x.device)] = NEG_INF


def apply_penalties(x: torch.Tensor, rows: Sequence) -> None:
    """In place, vectorised over the rows that use any penalty.

    repetition (HF/vLLM): for tokens seen in prompt or output, logit / p if logit > 0 else
    logit * p. presence/frequency (OpenAI): logit -= presence * [count > 0] + frequency * count,
    count over output tokens only.
    """
    idx = [i for i, r in enumerate(rows) if _has_penalty(r.sampling_params)]
    if not idx:
        return
    sub = [rows[i] for i in idx]
    vocab, dev = x.shape[1], x.device
    out_counts = _token_counts([r.output_token_ids for r in sub], vocab, dev)
    prompt_seen = _token_counts([r.prompt_token_ids for r in sub], vocab, dev) > 0
    rep = _column([r.sampling_params.repetition_penalty for r in sub], dev)
    pres = _column([r.sampling_params.presence_penalty for r in sub], dev)
    freq = _column([r.sampling_params.frequency_penalty for r in sub], dev)
    rows_idx = torch.tensor(idx, device=dev)
    y = x[rows_idx]
    seen = prompt_seen | (out_counts > 0)
    y = torch.where(seen, torch.where(y > 0, y / rep, y * rep), y)
    y = y - freq * out_counts - pres * (out_counts > 0).float()
    x[rows_idx] = y


def apply_allowed_mask(x: torch.Tensor, raw: torch.Tensor, allowed: torch.Tensor) -> None:
    """In place: disallowed tokens -> -inf. A row the other processors had left with only
    disallowed tokens (e.g. min_tokens forbids the EOS a finished grammar needs) falls back
    to its raw logits under the mask: the grammar wins, so no row is ever all -inf."""
    allowed = allowed.to(x.device)
    x.masked_fill_(~allowed, NEG_INF)
    dead = torch.isneginf(x).all(dim=-1) & allowed.any(dim=-1)
    if bool(dead.any()):
        x[dead] = raw[dead].masked_fill(~allowed[dead], NEG_INF)


def _has_penalty(p) -> bool:
    return p.repetition_penalty != 1.0 or p.presence_penalty != 0.0 or p.frequency_penalty != 0.0


def _column(values: list[float], device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32, device=device).unsqueeze(1)


def _token_counts(token_lists: list[list[int]], vocab: int, device) -> torch.Tensor:
    """[len(token_lists), vocab] float counts, counted on `device` (only the ids travel).
    Padding goes to an extra column, then dropped."""
    width = max((len(t) for t in token_lists), default=0)
    padded = torch.full((len(token_lists), width), vocab, dtype=torch.long)
    for i, t in enumerate(token_lists):
        if t:
            padded[i, :len(t)] = torch.tensor(t, dtype=torch.long).clamp_(0, vocab)
    padded = padded.to(device)
    counts = torch.zeros(len(token_lists), vocab + 1, dtype=torch.float32, device=device)
    counts.scatter_add_(1, padded, torch.ones_like(padded, dtype=torch.float32))
    return counts[:, :vocab]


# ----------------------------------------------------------------------------- masks

def top_k_mask(x: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """Keep each row's k largest logits (ties with the k-th kept); k <= 0 keeps everything."""
    vocab = x.shape[1]
    k = torch.where(k <= 0, torch.full_like(k, vocab), k.clamp(max=vocab))
    sorted_desc = x.sort(dim=-1, descending=True).values
    kth = sorted_desc.gather(1, (k - 1).long().unsqueeze(1))  # [B, 1]
    return x.masked_fill(x < kth, NEG_INF)


def top_p_mask(x: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """Keep the smallest set of most likely tokens whose probability sums to >= p.

    A token survives if the probability of the tokens strictly more likely than it is < p, so
    the token that crosses p is kept and the top token always is. p >= 1 keeps everything.
    """
    probs, order = torch.softmax(x, dim=-1).sort(dim=-1, descending=True)
    mass_before = probs.cumsum(dim=-1) - probs
    drop_sorted = (mass_before >= p.unsqueeze(1)) & (p.unsqueeze(1) < 1.0)
    drop_sorted[:, 0] = False
    drop = torch.zeros_like(drop_sorted).scatter(1, order, drop_sorted)
    return x.masked_fill(drop, NEG_INF)


def min_p_mask(x: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Drop tokens whose probability is below min_p times the most likely token's."""
    probs = torch.softmax(x, dim=-1)
    threshold = min_p.unsqueeze(1) * probs.max(dim=-1, keepdim=True).values
    return x.masked_fill(probs < threshold, NEG_INF)


# ----------------------------------------------------------------------------- sampling

def sample(x: torch.Tensor, rows: Sequence) -> list[int]:
    """Token per row from processed logits: argmax for greedy rows, else a random draw."""
    params = [r.sampling_params for r in rows]
    dev = x.device
    tokens = x.argmax(dim=-1)
    flags = [p.temperature == 0.0 for p in params]
    if all(flags):                   # decided in Python: no tensor built for an all-greedy step
        return tokens.tolist()
    greedy = torch.tensor(flags, device=dev)
    probs = processed_probs(x, params)
    sampled = (probs / _exponential_noise(x.shape, rows).to(dev)).argmax(dim=-1)
    return torch.where(greedy, tokens, sampled).tolist()


def processed_probs(x: torch.Tensor, params: Sequence) -> torch.Tensor:
    """The distribution a non-greedy row draws from: processed logits / temperature, then the
    top-k, top-p and min-p masks, softmaxed. [B, V] float32."""
    dev = x.device
    temp = torch.tensor([p.temperature if p.temperature > 0 else 1.0 for p in params],
                        dtype=torch.float32, device=dev)
    y = x / temp.unsqueeze(1)
    if any(p.top_k > 0 for p in params):
        y = top_k_mask(y, torch.tensor([p.top_k for p in params], device=dev))
    if any(p.top_p < 1.0 for p in params):
        y = top_p_mask(y, torch.tensor([p.top_p for p in params], dtype=torch.float32, device=dev))
    if any(p.min_p > 0.0 for p in params):
        y = min_p_mask(y, torch.tensor([p.min_p for p in params], dtype=torch.float32, device=dev))
    return torch.softmax(y, dim=-1)


def skip_draws(generator: torch.Generator, vocab: int, n: int = 1) -> None:
    """Advance a seeded request's generator past `n` tokens sampled elsewhere (the decode
    worker continues a request whose first token the prefill worker drew), so the whole
    sequence equals what one engine would draw from that seed."""
    for _ in range(n):
        torch.empty(vocab, dtype=torch.float32).exponential_(generator=generator)


def _exponential_noise(shape, rows: Sequence) -> torch.Tensor:
    """Exp(1) noise [B, V] on the CPU: rows with a generator use it, the rest the global RNG."""
    noise = torch.empty(shape, dtype=torch.float32)
    unseeded = [i for i, r in enumerate(rows) if r.generator is None]
    if unseeded:
        noise[unseeded] = torch.empty(len(unseeded), shape[1]).exponential_()
    for i, r in enumerate(rows):
        if r.generator is not None:
            noise[i].exponential_(generator=r.generator)
    return noise


# ----------------------------------------------------------------------------- on the device

class DeviceSampler:
    """`Sampler`'s steps on the logits' own device, with one device-to-host copy per step.

    Greedy rows without processors (the common decode batch) cost a logsumexp, an argmax and
    a gather. Seeded rows draw their noise on the CPU from their generator (so their tokens
    equal `Sampler`'s and do not depend on the device); the others draw it on the device."""

    def __init__(self, eos_token_ids: set[int]):
        self.eos_token_ids = set(eos_token_ids)

    @torch.inference_mode()
    def __call__(self, logits: torch.Tensor, rows: Sequence,
                 allowed: torch.Tensor | None = None) -> SamplerOutput:
        assert logits.dim() == 2 and logits.shape[0] == len(rows), (logits.shape, len(rows))
        params = [r.sampling_params for r in rows]
        dev, B = logits.device, logits.shape[0]
        raw = logits.float()
        lse = torch.logsumexp(raw, dim=-1)
        x = self._process(raw, rows, params, allowed)
        greedy = [p.temperature == 0.0 for p in params]
        tokens = x.argmax(dim=-1)
        if not all(greedy):
            tokens = torch.where(torch.tensor(greedy, device=dev), tokens, self._draw(x, rows, params))
        parts = [tokens.double(), (raw.gather(1, tokens.unsqueeze(1)).squeeze(1) - lse).double()]
        max_k = max((p.logprobs or 0 for p in params), default=0)
        if max_k > 0:
            values, indices = raw.topk(max_k, dim=-1)
            parts += [(values - lse.unsqueeze(1)).double().flatten(), indices.double().flatten()]
        host = torch.cat(parts).tolist()               # the step's one device -> host copy
        ids = [int(t) for t in host[:B]]
        chosen = host[B:2 * B]
        top: list[list[tuple[int, float]] | None] = [None] * B
        if max_k > 0:
            vals, idx = host[2 * B:2 * B + B * max_k], host[2 * B + B * max_k:]
            for i, p in enumerate(params):
                if p.logprobs:
                    o = i * max_k
                    top[i] = [(int(idx[o + j]), vals[o + j]) for j in range(p.logprobs)]
        return SamplerOutput(token_ids=ids, logprobs=chosen, top_logprobs=top)

    def _process(self, raw, rows, params, allowed) -> torch.Tensor:
        """The logits processors of `Sampler`, each one batched copy of its index lists."""
        bias = [(i, t, b) for i, p in enumerate(params) for t, b in p.logit_bias.items()
                if 0 <= t < raw.shape[1]]
        banned = [(i, t) for i, r in enumerate(rows) if len(r.output_token_ids) < r.sampling_params.min_tokens
                  for t in set(r.sampling_params.stop_token_ids)
                  | (set() if r.sampling_params.ignore_eos else self.eos_token_ids)
                  if 0 <= t < raw.shape[1]]
        penalised = any(_has_penalty(p) for p in params)
        if not (bias or banned or penalised or allowed is not None):
            return raw
        x, dev = raw.clone(), raw.device
        if bias:
            r, t, b = zip(*bias)
            x.index_put_((torch.tensor(r, device=dev), torch.tensor(t, device=dev)),
                         torch.tensor(b, dtype=x.dtype, device=dev), accumulate=True)
        if banned:
            r, t = zip(*banned)
            x[torch.tensor(r, device=dev), torch.tensor(t, device=dev)] = NEG_INF
        if penalised:
            apply_penalties(x, rows)
        if allowed is not None:
            apply_allowed_mask(x, raw, allowed)
        return x

    def _draw(self, x, rows, params) -> torch.Tensor:
        """A random token per row (greedy rows' draws are discarded by the caller)."""
        dev = x.device
        probs = processed_probs(x, params)
        noise = torch.empty_like(probs)
        unseeded = [i for i, r in enumerate(rows) if r.generator is None]
        seeded = [i for i, r in enumerate(rows) if r.generator is not None]
        if unseeded:
            noise[unseeded] = torch.empty(len(unseeded), x.shape[1], device=dev).exponential_()
        if seeded:
            cpu = torch.stack([torch.empty(x.shape[1]).exponential_(generator=rows[i].generator)
                               for i in seeded])
            noise[seeded] = cpu.to(dev)
        return (probs / noise).argmax(dim=-1)


# ----------------------------------------------------------------------------- logprobs

def _gather_logprobs(raw: torch.Tensor, token_ids: list[int], params: Sequence) -> SamplerOutput:
    ids = torch.tensor(token_ids, device=raw.device).unsqueeze(1)
    chosen = raw.gather(1, ids).squeeze(1).tolist()
    max_k = max((p.logprobs or 0 for p in params), default=0)
    top: list[list[tuple[int, float]] | None] = [None] * len(params)
    if max_k > 0:
        values, indices = raw.topk(max_k, dim=-1)
        values, indices = values.tolist(), indices.tolist()
        for i, p in enumerate(params):
            if p.logprobs:
                top[i] = list(zip(indices[i][:p.logprobs], values[i][:p.logprobs]))
    return SamplerOutput(token_ids=token_ids, logprobs=chosen, top_logprobs=top)


def compute_prompt_logprobs(logits: torch.Tensor, target_ids, k: int
                            ) -> tuple[list[float], list[list[tuple[int, float]]]]:
    """Raw logprobs of each prompt position's next token, and the k best at each position.

    logits[j] predicts target_ids[j] (i.e. the caller passes logits for positions 0..P-2 and
    the prompt tokens 1..P-1).
    """
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    target = torch.as_tensor(target_ids, device=logprobs.device, dtype=torch.long).unsqueeze(1)
    chosen = logprobs.gather(1, target).squeeze(1).tolist()
    if k <= 0:
        return chosen, [[] for _ in chosen]
    values, indices = logprobs.topk(min(k, logprobs.shape[1]), dim=-1)
    tops = [list(zip(i, v)) for i, v in zip(indices.tolist(), values.tolist())]
    return chosen, tops
