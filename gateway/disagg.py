"""Conditional disaggregation: per request, does a prefill worker compute the prompt and hand
its KV over (disaggregated), or does the chosen decode worker compute it itself (local)?
Pure: no gRPC, no clock; the gateway (gateway/segment.py) and the simulator run the same rule.

    mode never:   local, always
    mode always:  disaggregated, always (no healthy prefill worker: the gateway's 503, as before)
    mode auto, in this order (the first that applies decides; its reason is recorded):
      1. no healthy prefill worker                        -> local  (never a 503 for that)
      2. the decode worker is too loaded to compute a prompt:
           free KV below min_free_kv (a fraction), or prompts already queued in its engine
           (waiting, not counting reservations waiting for KV), or it has streams running
           and the local prefill would stall them longer than max_stall_s (0: no bound)
                                                          -> disaggregated
      3. the uncached part is short: uncached <= max_local_tokens
                                                          -> local
      4. local_s <= remote_s: the handover does not pay   -> local
      5. otherwise                                        -> disaggregated

    uncached  = prompt tokens - what the chosen decode worker holds of it (its leading
                blocks in any tier, from its KV events: gateway/routing.py Router.cached_on)
    local_s   = local.cost(uncached)          the decode worker computing the uncached part
    remote_s  = remote.cost(prompt + queued)  a prefill worker's queue (tokens queued per
                healthy worker: Stats' queued_prefill_tokens, or the gateway's own count of
                tokens it has in Prefill calls, whichever is larger), its compute and the
                handover (reservation, KV transfer, first token to the decode worker)

Costs are lines (seconds = a + b * tokens), learnt online from the gateway's own
observations (`observe_local`: Decode(local_prefill) open -> first token, against the
uncached tokens; `observe_remote`: Decode open -> the prefill worker's first token, against
prompt + queued tokens), each a least-squares fit with exponential forgetting (`OnlineLine`),
seeded by `prior_weight` pseudo-observations of, first that applies:
  - a profile from `pdserve profile` (sim/profile.py's schema, read here as JSON:
    `fits.prefill` [a, b, c] and `fits.handover` [a, b])
  - the workers' own measures (`seed_measured`, from their Stats' prefill_cost: a decode
    worker's local prefill, a prefill worker's compute, plus the handover's default), for a
    line not observed yet; while only one side has been observed, the other's seed is
    scaled by the observed side's cost over its own seed (`_costs`: a warm-up times compute
    alone, an observation all that a served request adds)
  - the defaults below (a GPU's guess: on a CPU, where a decode worker's local prefill and a
    prefill worker's differ by their threads, lone long prompts went to whichever side had
    been observed less, alternating, until a few of each were seen)
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

MODES = ("always", "never", "auto")
LOCAL, DISAGGREGATED = "local", "disaggregated"
KINDS = (DISAGGREGATED, LOCAL)

# Seeds without a profile (seconds, seconds per token): a modest GPU's prefill; the learnt
# fits replace them after a few requests of each kind.
DEFAULT_PREFILL = (0.005, 0.0002)
DEFAULT_HANDOVER = (0.02, 0.00002)


class OnlineLine:
    """seconds ~ a + b * tokens, least squares over the observations, each weighed down by
    `decay` per later observation (a recent window of about 1 / (1 - decay)); a and b are
    kept >= 0 (a cost never falls with more work)."""

    def __init__(self, a: float, b: float, prior_weight: float = 4.0, decay: float = 0.95,
                 spread: float = 512.0):
        self.decay = decay
        self.n = 0                          # real observations
        self._s = [0.0] * 5                 # sums of w, w x, w x x, w y, w x y
        for x in (0.0, spread):             # the prior: points on the seed line
            self._add(x, a + b * x, prior_weight / 2)

    def _add(self, x: float, y: float, w: float) -> None:
        for i, v in enumerate((w, w * x, w * x * x, w * y, w * x * y)):
            self._s[i] += v

    def observe(self, tokens: float, seconds: float) -> None:
        self._s = [v * self.decay for v in self._s]
        self._add(float(tokens), float(seconds), 1.0)
        self.n += 1

    def coef(self) -> tuple[float, float]:
        w, sx, sxx, sy, sxy = self._s
        det = w * sxx - sx * sx
        b = (w * sxy - sx * sy) / det if det > 1e-12 else 0.0
        b = max(b, 0.0)
        return max((sy - b * sx) / w, 0.0), b

    def cost(self, tokens: float) -> float:
        a, b = self.coef()
        return a + b * max(tokens, 0.0)


@dataclass(frozen=True)
class PrefillView:
    """The prefill pool as the gateway sees it now."""
    healthy: int
    queued_tokens: int = 0            # prompt tokens queued on the healthy workers, summed


@dataclass(frozen=True)
class DecodeView:
    """The chosen decode worker as the gateway sees it now."""
    running: int = 0                  # streams (the gateway's in-flight count, or Stats')
    waiting: int = 0                  # prompts queued in its engine (not reservations)
    free_kv_blocks: int = 0
    total_kv_blocks: int = 0          # 0: unknown (no Stats yet): no KV rule


@dataclass
class Choice:
    kind: str                         # LOCAL | DISAGGREGATED
    reasons: list[str]
    uncached: int = 0
    local_s: float = 0.0
    remote_s: float = 0.0


@dataclass
class DisaggPolicy:
    mode: str = "auto"
    max_local_tokens: int = 64
    max_stall_s: float = 0.0
    min_free_kv: float = 0.1
    local: OnlineLine = field(default_factory=lambda: OnlineLine(*DEFAULT_PREFILL))
    remote: OnlineLine = field(default_factory=lambda: OnlineLine(
        DEFAULT_PREFILL[0] + DEFAULT_HANDOVER[0], DEFAULT_PREFILL[1] + DEFAULT_HANDOVER[1]))
    handover: tuple[float, float] = DEFAULT_HANDOVER
    profiled: bool = False            # seeded by --profile: the workers' measures do not reseed
    seeds: dict = field(default_factory=dict)     # line -> the measured seed it has now

    def __post_init__(self):
        if self.mode not in MODES:
            raise ValueError(f"--disaggregation must be one of {', '.join(MODES)}, got {self.mode!r}")
        if self.max_local_tokens < 0 or self.max_stall_s < 0 or not 0 <= self.min_free_kv < 1:
            raise ValueError("max_local_tokens and max_stall_s must be >= 0, min_free_kv in [0, 1)")

    @classmethod
    def with_profile(cls, path: str = "", **kw) -> "DisaggPolicy":
        """A policy whose cost seeds come from a `pdserve profile` JSON file ("": defaults)."""
        if not path:
            return cls(**kw)
        return cls.from_costs(read_profile_costs(path), **kw)

    @classmethod
    def from_costs(cls, costs, **kw) -> "DisaggPolicy":
        """Seeded by ((prefill a, b), (handover a, b)): local = prefill, remote = both."""
        (pa, pb), (ha, hb) = costs
        return cls(local=OnlineLine(pa, pb), remote=OnlineLine(pa + ha, pb + hb),
                   handover=(ha, hb), profiled=True, **kw)

    def seed_measured(self, local: tuple[float, float] | None,
                      remote: tuple[float, float] | None) -> None:
        """The workers' own prompt costs, (fixed s, s per token) or None (unknown): `local`
        a decode worker's, `remote` a prefill worker's compute (the handover's seed added),
        as the seeds of a line with no observation of its own yet (after one, the line
        learns from the gateway's observations, as before). A --profile's seeds stay."""
        if self.profiled:
            return
        for name, cost, extra in (("local", local, (0.0, 0.0)), ("remote", remote, self.handover)):
            if cost is None or getattr(self, name).n:
                continue
            seed = (cost[0] + extra[0], cost[1] + extra[1])
            if self.seeds.get(name) != seed:
                self.seeds[name] = seed
                setattr(self, name, OnlineLine(*seed))

    def decide(self, prompt_tokens: int, cached_tokens: int, prefill: PrefillView,
               decode: DecodeView) -> Choice:
        uncached = max(prompt_tokens - cached_tokens, 0)
        if self.mode == "never":
            return Choice(LOCAL, ["--disaggregation never"], uncached)
        if self.mode == "always":
            return Choice(DISAGGREGATED, ["--disaggregation always"], uncached)
        queued = prefill.queued_tokens / max(prefill.healthy, 1)
        local_s, remote_s = self._costs(uncached, prompt_tokens + queued)
        c = Choice(LOCAL, [], uncached, local_s, remote_s)
        if prefill.healthy == 0:
            c.reasons.append("no healthy prefill worker")
            return c
        busy = self._too_loaded(decode, local_s)
        if busy:
            c.kind, c.reasons = DISAGGREGATED, [f"decode worker too loaded: {busy}"]
        elif uncached <= self.max_local_tokens:
            c.reasons.append(f"uncached {uncached} tokens <= {self.max_local_tokens} "
                             "(--disagg-max-local-tokens)")
        elif local_s <= remote_s:
            c.reasons.append(f"local prefill {local_s * 1e3:.1f} ms <= queue + prefill + "
                             f"handover {remote_s * 1e3:.1f} ms ({queued:.0f} tokens queued "
                             "per prefill worker)")
        else:
            c.kind = DISAGGREGATED
            c.reasons.append(f"local prefill {local_s * 1e3:.1f} ms > queue + prefill + "
                             f"handover {remote_s * 1e3:.1f} ms")
        return c

    def _costs(self, local_tokens: float, remote_tokens: float) -> tuple[float, float]:
        """Both lines' costs. With both seeded by the workers' measures and only one side
        observed so far, the other is scaled by the observed side's cost over its seed: a
        warm-up times compute alone, an observation all a served request adds (the gateway,
        the handover, attention over a longer prompt), and a seed left as timed would win
        the next comparison however slow it really is."""
        local_s, remote_s = self.local.cost(local_tokens), self.remote.cost(remote_tokens)
        if len(self.seeds) < 2 or bool(self.local.n) == bool(self.remote.n):
            return local_s, remote_s
        seen, x, unseen = (("local", local_tokens, "remote") if self.local.n
                           else ("remote", remote_tokens, "local"))
        a, b = self.seeds[seen]
        scale = getattr(self, seen).cost(x) / max(a + b * x, 1e-9)
        if unseen == "local":
            return local_s * scale, remote_s
        return local_s, remote_s * scale

    def _too_loaded(self, d: DecodeView, local_s: float) -> str:
        """Why the decode worker should not compute a prompt now ("" when it may)."""
        if d.total_kv_blocks and d.free_kv_blocks < self.min_free_kv * d.total_kv_blocks:
            return f"{d.free_kv_blocks} of {d.total_kv_blocks} KV blocks free"
        if d.waiting > 0:
            return f"{d.waiting} prompt(s) already queued in its engine"
        if self.max_stall_s and d.running and local_s > self.max_stall_s:
            return (f"a {local_s * 1e3:.1f} ms prefill would stall its {d.running} stream(s) "
                    f"past {self.max_stall_s * 1e3:.0f} ms (--disagg-max-stall-ms)")
        return ""

    def observe_local(self, uncached: int, seconds: float) -> None:
        self.local.observe(uncached, seconds)

    def observe_remote(self, tokens: float, seconds: float) -> None:
        """`tokens`: the prompt plus the tokens queued per prefill worker at the decision."""
        self.remote.observe(tokens, seconds)


def read_profile_costs(path: str) -> tuple[tuple[float, float], tuple[float, float]]:
    """((prefill a, b), (handover a, b)) from a profile file (`pdserve.profile/1`)."""
    try:
        d = json.loads(Path(path).read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"--profile {path}: cannot read it: {e}") from None
    schema = d.get("schema") if isinstance(d, dict) else None
    if not isinstance(schema, str) or not schema.startswith("pdserve.profile/1"):
        raise ValueError(f"--profile {path}: not a pdserve.profile/1 file (schema {schema!r})")
    try:
        return costs_from_fits(d["fits"])
    except (KeyError, TypeError, ValueError) as e:
        raise ValueError(f"--profile {path}: no fits.prefill / fits.handover ({e})") from None


def costs_from_fits(fits: dict) -> tuple[tuple[float, float], tuple[float, float]]:
    """A profile's `fits` ({"prefill": [a, b, c], "handover": [a, b], ...}) as the lines
    seeded here: the prefill fit's quadratic term folded into b at 512 tokens."""
    a, b, c = (float(x) for x in (list(fits["prefill"]) + [0.0, 0.0])[:3])
    ha, hb = (float(x) for x in (list(fits["handover"]) + [0.0])[:2])
    return (max(a, 0.0), max(b + c * 256.0, 0.0)), (max(ha, 0.0), max(hb, 0.0))
