"""Engine step time by shape, as Prometheus counters: what `pdserve profile --from-url` fits
the prefill and decode costs to from a running system.

A `StepMetrics` is an engine step observer (engine/step_observer.py) of every worker. Each
step is one of two kinds and falls in one power-of-two bucket:

    decode    every request of the step computed one token;  bucket: the batch (requests)
    prefill   any request computed more (a mixed step too);   bucket: the step's tokens

and adds to five counters labelled {role, kind, bucket}:

    pdserve:engine_steps_total                   steps
    pdserve:engine_step_seconds_total            their wall time (the observer's duration)
    pdserve:engine_step_tokens_total             tokens computed
    pdserve:engine_step_requests_total           requests in them
    pdserve:engine_step_context_tokens_total     tokens already in the cache before the step:
                                                 decode: summed over the batch; prefill: of
                                                 the requests computing more than one token

so a bucket's means (sum / steps) are one point of the cost models of sim/profile.py. Buckets
are powers of two (at most ~17 per kind): the label set stays bounded. The context of a
request comes from the engine it is bound to (`bind(engine)`: its requests' computed tokens
after the step, less this step's), or for a request that left the engine in this step from
what the previous step saw of it.

One more counter, labelled {role}, read from the bound engine after each step:

    pdserve:prompt_tokens_computed_total         prompt tokens the engine really ran through
                                                 the model (LLMEngine.prompt_tokens_computed:
                                                 not prefix-cache hits, not KV received from
                                                 a prefill worker, a tier or a peer)

what bench/prefix_tiers.py sums over the workers to compare prefix reuse across systems.
"""
from __future__ import annotations

from typing import Any, Mapping

from prometheus_client import CollectorRegistry, Counter

PREFIX = "pdserve:"
NAMES = ("engine_steps", "engine_step_seconds", "engine_step_tokens", "engine_step_requests",
         "engine_step_context_tokens")
DOCS = ("Engine steps, by kind (prefill|decode) and power-of-two bucket (decode: batch; "
        "prefill: tokens)", "Wall time of those steps", "Tokens those steps computed",
        "Requests in those steps", "Tokens already in the KV cache before those steps "
        "(decode: the batch's; prefill: the prompts')")


def bucket(n: int) -> int:
    """The smallest power of two >= n (n >= 1)."""
    return 1 << max(0, int(n) - 1).bit_length()


class StepMetrics:
    """Step observer -> the five counters, in `registry` (the process's Metrics registry)."""

    def __init__(self, role: str, registry: CollectorRegistry):
        self.role = role
        self._counters = [Counter(PREFIX + n, d, ("role", "kind", "bucket"), registry=registry)
                          for n, d in zip(NAMES, DOCS)]
        self._prompt = Counter(PREFIX + "prompt_tokens_computed", "Prompt tokens the engine "
                               "ran through the model (not prefix hits, not KV received, revived "
                               "or fetched)", ("role",), registry=registry).labels(role)
        self._requests: Mapping[str, Any] = {}
        self._ctx: dict[str, int] = {}       # request -> context after the last step it was in
        self._engine, self._prompt_seen = None, 0

    def bind(self, engine) -> None:
        """Read the requests' computed tokens (and the engine's prompt tokens) from `engine`
        (an LLMEngine)."""
        self._requests = engine.requests
        self._engine, self._prompt_seen = engine, engine.prompt_tokens_computed

    def _context(self, rid: str, n: int) -> int:
        req = self._requests.get(rid)
        if req is not None:
            return max(0, req.num_computed_tokens - n)
        return self._ctx.get(rid, 0)

    def on_step(self, duration_s: float, tokens: Mapping[str, int]) -> None:
        if not tokens:
            return
        if self._engine is not None:
            done = self._engine.prompt_tokens_computed
            self._prompt.inc(done - self._prompt_seen)
            self._prompt_seen = done
        ctx = {rid: self._context(rid, n) for rid, n in tokens.items()}
        self._ctx = {rid: ctx[rid] + n for rid, n in tokens.items()}   # bounded: this step's
        total = sum(tokens.values())
        if all(n == 1 for n in tokens.values()):
            kind, b, context = "decode", bucket(len(tokens)), sum(ctx.values())
        else:
            kind, b = "prefill", bucket(total)
            context = sum(ctx[rid] for rid, n in tokens.items() if n > 1)
        values = (1, duration_s, total, len(tokens), context)
        for counter, v in zip(self._counters, values):
            counter.labels(self.role, kind, str(b)).inc(v)
