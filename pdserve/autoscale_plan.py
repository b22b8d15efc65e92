"""The autoscaler's plan (pdserve/autoscale.py): which shape (prefill P, decode D) the load
measured over the last interval needs, predicted by the simulator on a profile whose step
costs the running workers correct.

    Signals (rate, mean prompt / output tokens)  ->  Workload: Poisson at that rate, lengths
        normal around the means (sd = mean / 2), `window_s` of simulated arrivals (longer at
        a low rate, so at least MIN_REQUESTS arrive; at most MAX_WINDOW_S)
    every shape P + D <= max_workers (P = 0, colocated, only where allowed), the engine's
        default batch settings, `seeds` seeds  ->  pdserve.plan.evaluate, pdserve.plan.rank
        (meeting the SLO attainment first, then goodput per worker, fewer workers)

This is the simulator in the loop, so it is kept small: at most a handful of shapes
(3 for --max-workers 2, 9 for 4), one default setting, a short window, one seed. Measured
here (2-core VM, SmolLM2 profile): ~0.1 s per step at 0.5-2 req/s, ~0.4 s at 6 req/s for
max_workers 2; `Recommendation.took_ms` carries each step's own time.

Measured costs (`CostCorrection`): each settled worker's step counters over the interval
(services/step_metrics.py: per kind and power-of-two bucket, steps / seconds / tokens /
requests / context) against what the profile predicts for the same steps; the ratio of
their sums per kind (prefill, decode), smoothed (EWMA) and bounded to [1/5, 5], scales the
profile's points of that kind (a refit). A worker's first `skip_intervals` intervals are
left out: its cold passes (compilation, first-touch allocation) are not its cost.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field, replace

from engine.config import SchedulerConfig
from sim.workload import LengthDist, Workload

from . import plan

MIN_REQUESTS = 24
MAX_WINDOW_S = 300.0
FACTOR_BOUNDS = (0.2, 5.0)


@dataclass
class Recommendation:
    shape: tuple[int, int]                 # (prefill, decode)
    ranked: list[dict] = field(default_factory=list)   # name, prefill, decode, attainment, ...
    took_ms: float = 0.0


def smallest(allow_colocated: bool) -> tuple[int, int]:
    return (0, 1) if allow_colocated else (1, 1)


def workload(rate: float, input_mean: float, output_mean: float, window_s: float) -> Workload:
    duration = min(MAX_WINDOW_S, max(window_s, MIN_REQUESTS / rate))
    dist = lambda m: LengthDist("normal", (max(1.0, m), max(1.0, m) / 2))   # noqa: E731
    return Workload(rate=rate, input=dist(input_mean), output=dist(output_mean),
                    duration_s=duration)


class CostCorrection:
    """Scale factors of the profile's prefill and decode costs, from the measured steps."""

    def __init__(self, profile, skip_intervals: int = 2, alpha: float = 0.5):
        self.base, self.skip_intervals, self.alpha = profile, skip_intervals, alpha
        self.factors = {"prefill": 1.0, "decode": 1.0}
        self.seen: dict[str, int] = {}       # worker -> intervals it has been seen in
        self._profile, self._at = profile, dict(self.factors)

    def observe(self, steps: dict[str, dict], workers) -> dict:
        """Fold one interval's step increments of `steps` (worker -> {(kind, bucket): [5]})
        in; `workers`: every worker in the scrape (its age counts). Returns what was used."""
        for w in workers:
            self.seen[w] = self.seen.get(w, 0) + 1
        self.seen = {w: n for w, n in self.seen.items() if w in workers}
        measured, predicted = {"prefill": 0.0, "decode": 0.0}, {"prefill": 0.0, "decode": 0.0}
        used = sorted(w for w in steps if self.seen.get(w, 0) > self.skip_intervals)
        for w in used:
            for (kind, _bucket), (n, seconds, tokens, requests, context) in steps[w].items():
                if kind in measured and n > 0:
                    measured[kind] += seconds
                    predicted[kind] += n * self._predict(kind, tokens / n, requests / n, context / n)
        for kind in self.factors:
            if predicted[kind] > 0 and measured[kind] > 0:
                ratio = min(max(measured[kind] / predicted[kind], FACTOR_BOUNDS[0]), FACTOR_BOUNDS[1])
                f = (1 - self.alpha) * self.factors[kind] + self.alpha * ratio
                self.factors[kind] = min(max(f, FACTOR_BOUNDS[0]), FACTOR_BOUNDS[1])
        return {"workers": used, "skipped": sorted(set(steps) - set(used)),
                "factors": {k: round(v, 3) for k, v in self.factors.items()}}

    def _predict(self, kind: str, tokens: float, requests: float, context: float) -> float:
        if kind == "prefill":
            return self.base.prefill_s(max(1, round(tokens)), round(context))
        return self.base.decode_s(max(1, round(requests)), round(context))

    def profile(self):
        """The base profile with its points scaled by the factors (refit when they moved)."""
        if any(abs(self.factors[k] - self._at[k]) > 0.02 for k in self.factors):
            scaled = {k: [{**p, "seconds": p["seconds"] * self.factors[k]}
                          for p in getattr(self.base, k)] for k in self.factors}
            self._profile = replace(self.base, **scaled)    # __post_init__ refits
            self._at = dict(self.factors)
        return self._profile


def rank(cands: list[plan.Candidate], attainment: float) -> list[plan.Candidate]:
    """pdserve.plan.rank where a shape meets the target; where none does (overload), the
    most capacity first: attainment, then goodput, throughput, more workers."""
    if any(c.meets(attainment) for c in cands):
        return plan.rank(cands, attainment)
    num = lambda c, k: c.summary.get(k) or 0.0      # noqa: E731
    return sorted(cands, key=lambda c: (-round(num(c, "slo_attainment"), 2), -num(c, "goodput_rps"),
                                        -num(c, "throughput_tok_s"), -c.workers))


@dataclass
class Planner:
    """Shapes for a measured load, by simulation (see the module docstring)."""
    profile: object
    max_workers: int
    slo: tuple[float, float]               # (TTFT ms, ITL ms)
    allow_colocated: bool = True
    attainment: float = 0.9
    window_s: float = 30.0
    seeds: int = 1
    cores: float = 0.0                     # 0: the profile's machine
    correction: CostCorrection | None = None

    def __post_init__(self):
        self.cores = self.cores or plan.profile_cores(self.profile)
        if self.correction is None:
            self.correction = CostCorrection(self.profile)
        eng = SchedulerConfig()
        self.settings = {"max_num_seqs": int(self.profile.options.get("max_num_seqs") or eng.max_num_seqs),
                         "max_num_batched_tokens": int(self.profile.options.get(
                             "max_num_batched_tokens") or eng.max_num_batched_tokens)}

    def shapes(self) -> list[tuple[int, int]]:
        return [(p, d) for p, d in plan.shapes(self.max_workers) if p > 0 or self.allow_colocated]

    def evaluate(self, shape: tuple[int, int], rate: float, input_mean: float,
                 output_mean: float) -> plan.Candidate:
        c = plan.Candidate(shape[0], shape[1], dict(self.settings), {})
        return plan.evaluate(self.correction.profile(), c,
                             workload(rate, input_mean, output_mean, self.window_s),
                             cores=self.cores, slo=self.slo, seeds=self.seeds)

    def recommend(self, rate: float, input_mean: float, output_mean: float) -> Recommendation:
        """The best shape for the load (no load: the smallest), and every shape's figures."""
        began = time.monotonic()
        if rate <= 0:
            return Recommendation(smallest(self.allow_colocated), [], 0.0)
        cands = rank([self.evaluate(s, rate, input_mean, output_mean) for s in self.shapes()],
                     self.attainment)
        ranked = [{"name": c.name, "prefill": c.prefill, "decode": c.decode,
                   "attainment": round(c.summary.get("slo_attainment") or 0.0, 3),
                   "meets": c.meets(self.attainment),
                   "ttft_p90_ms": c.summary.get("ttft_p90_ms"),
                   "itl_p90_ms": c.summary.get("itl_p90_ms")} for c in cands]
        return Recommendation((cands[0].prefill, cands[0].decode), ranked,
                              (time.monotonic() - began) * 1e3)

    def meets(self, shape: tuple[int, int], rate: float, input_mean: float,
              output_mean: float) -> bool:
        """Whether `shape` meets the attainment target at `rate` (no load: always)."""
        return rate <= 0 or self.evaluate(shape, rate, input_mean, output_mean).meets(self.attainment)
