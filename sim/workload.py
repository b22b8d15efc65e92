"""Synthetic workloads for the simulator and `pdserve plan`: length distributions, open-loop
arrivals, and rescaling a trace's rate.

A length is given as one of (`parse_lengths`):

    "128"            fixed: every request 128 tokens
    "512:128"        normal, mean 512 and standard deviation 128, rounded, clamped >= 1
    "lengths.json"   a histogram: {"edges": [e0, e1, ..., ek], "counts": [c1, ..., ck]};
                     a bin is drawn by its count, the length uniform in [e(i-1), e(i))
    "lengths.txt"    one length per line (blank lines and `#` comments skipped): each
                     request draws one of them, as observed (the empirical distribution)

Arrivals (`poisson`, `bursty`) are drawn from a seeded `random.Random`: the same arguments
give the same trace. `bursty` spaces arrivals by a gamma distribution whose coefficient of
variation is `cv` (1: Poisson; 2-4: the bursts seen in production chat traces), keeping the
mean rate. Records carry no `hash_ids`: every synthetic prompt is its own, with no prefix
shared (a replayed trace keeps its own).
"""
from __future__ import annotations

import json
import math
import random
from dataclasses import dataclass, replace
from pathlib import Path

from sim.trace import TraceRecord


@dataclass(frozen=True)
class LengthDist:
    """A distribution of token counts. kind: "fixed" (values = (n,)), "normal" (values =
    (mean, sd)), "histogram" (edges, counts) or "empirical" (values = the observed lengths)."""
    kind: str
    values: tuple[float, ...]
    counts: tuple[float, ...] = ()
    spec: str = ""

    def sample(self, rng: random.Random) -> int:
        if self.kind == "fixed":
            return int(self.values[0])
        if self.kind == "normal":
            return max(1, round(rng.gauss(self.values[0], self.values[1])))
        if self.kind == "empirical":
            return int(rng.choice(self.values))
        i = rng.choices(range(len(self.counts)), weights=self.counts)[0]
        lo, hi = self.values[i], self.values[i + 1]
        return max(1, int(lo + rng.random() * (hi - lo)))

    @property
    def mean(self) -> float:
        if self.kind in ("fixed", "normal"):
            return float(self.values[0])   # normal: before the clamp at 1
        if self.kind == "empirical":
            return sum(self.values) / len(self.values)
        mids = [(a + b) / 2 for a, b in zip(self.values, self.values[1:])]
        return sum(m * c for m, c in zip(mids, self.counts)) / sum(self.counts)

    def __str__(self) -> str:
        return self.spec or f"{self.kind}{self.values}"


def parse_lengths(spec: str) -> LengthDist:
    """`spec` as the module docstring says; a ValueError names what is wrong with it."""
    text = str(spec).strip()
    if not text:
        raise ValueError("a length spec is empty: give N, MEAN:SD or a histogram file")
    if _is_number(text):
        n = _positive(text, "a fixed length")
        return LengthDist("fixed", (float(int(n)),), spec=text)
    if ":" in text and all(_is_number(p) for p in text.split(":")):
        mean_s, sd_s = text.split(":")
        mean, sd = _positive(mean_s, "the mean"), float(sd_s)
        if sd < 0:
            raise ValueError(f"length spec {text!r}: the standard deviation must be >= 0")
        return LengthDist("normal", (mean, sd), spec=text)
    path = Path(text)
    if not path.is_file():
        raise ValueError(f"length spec {text!r} is not N, MEAN:SD or an existing file")
    return _from_file(path)


def _is_number(s: str) -> bool:
    try:
        return math.isfinite(float(s))
    except ValueError:
        return False


def _positive(s: str, what: str) -> float:
    x = float(s)
    if x < 1:
        raise ValueError(f"{what} must be >= 1 token, got {s}")
    return x


def _from_file(path: Path) -> LengthDist:
    text = path.read_text()
    if text.lstrip().startswith("{"):
        return _histogram(json.loads(text), str(path))
    values = []
    for n, line in enumerate(text.splitlines(), 1):
        line = line.split("#")[0].strip()
        if not line:
            continue
        if not line.isdigit() or int(line) < 1:
            raise ValueError(f"{path}:{n}: a length per line (an integer >= 1), got {line!r}")
        values.append(float(line))
    if not values:
        raise ValueError(f"{path}: no lengths in it")
    return LengthDist("empirical", tuple(values), spec=str(path))


def _histogram(d: dict, where: str) -> LengthDist:
    edges, counts = d.get("edges"), d.get("counts")
    if not isinstance(edges, list) or not isinstance(counts, list):
        raise ValueError(f"{where}: a histogram is {{\"edges\": [...], \"counts\": [...]}}")
    if len(edges) != len(counts) + 1 or not counts:
        raise ValueError(f"{where}: {len(edges)} edges for {len(counts)} counts "
                         "(edges must be one more than counts)")
    if any(not isinstance(x, (int, float)) for x in edges + counts):
        raise ValueError(f"{where}: edges and counts must be numbers")
    if edges[0] < 1 or any(b <= a for a, b in zip(edges, edges[1:])):
        raise ValueError(f"{where}: edges must start at >= 1 and increase")
    if any(c < 0 for c in counts) or sum(counts) <= 0:
        raise ValueError(f"{where}: counts must be >= 0 with a positive total")
    return LengthDist("histogram", tuple(map(float, edges)), tuple(map(float, counts)),
                      spec=where)


def poisson(rate: float, duration_s: float, input: LengthDist, output: LengthDist,
            seed: int = 0) -> list[TraceRecord]:
    """Open-loop Poisson arrivals at `rate` requests/s over [0, duration_s)."""
    return bursty(rate, duration_s, input, output, seed, cv=1.0)


def bursty(rate: float, duration_s: float, input: LengthDist, output: LengthDist,
           seed: int = 0, cv: float = 2.0) -> list[TraceRecord]:
    """Arrivals at mean `rate`/s with gamma gaps of coefficient of variation `cv` (1: Poisson)."""
    if rate <= 0 or duration_s <= 0:
        raise ValueError(f"rate ({rate}) and duration ({duration_s} s) must be > 0")
    if cv <= 0:
        raise ValueError(f"cv must be > 0, got {cv}")
    rng = random.Random(seed)
    shape = 1.0 / (cv * cv)          # gamma(k, theta): mean k*theta = 1/rate, cv = 1/sqrt(k)
    theta = 1.0 / (rate * shape)
    out, t = [], rng.gammavariate(shape, theta)
    while t < duration_s:
        out.append(TraceRecord(timestamp_ms=t * 1000.0, input_length=input.sample(rng),
                               output_length=output.sample(rng)))
        t += rng.gammavariate(shape, theta)
    return out


def scale(trace: list[TraceRecord], rate_scale: float) -> list[TraceRecord]:
    """The same requests arriving `rate_scale` times as fast (timestamps divided by it)."""
    if rate_scale <= 0:
        raise ValueError(f"rate_scale must be > 0, got {rate_scale}")
    return [replace(r, timestamp_ms=r.timestamp_ms / rate_scale) for r in trace]


def mean_rate(trace: list[TraceRecord]) -> float:
    """Requests per second over the trace's arrival window (its start, 0, to its last arrival)."""
    span_s = max((r.timestamp_ms for r in trace), default=0.0) / 1000.0
    return len(trace) / span_s if span_s > 0 else float(len(trace))


@dataclass(frozen=True)
class Workload:
    """What `pdserve plan` plans for: a replayed trace (`trace`, its rate scaled by
    `rate_scale`), or Poisson/bursty arrivals at `rate` with lengths drawn from `input` and
    `output` over `duration_s` (a fresh draw per seed: plans sample the distributions)."""
    trace: tuple[TraceRecord, ...] = ()
    rate_scale: float = 1.0
    rate: float = 0.0
    input: LengthDist | None = None
    output: LengthDist | None = None
    duration_s: float = 120.0
    cv: float = 1.0

    def records(self, seed: int = 0) -> list[TraceRecord]:
        if self.trace:
            return scale(list(self.trace), self.rate_scale)
        return bursty(self.rate, self.duration_s, self.input, self.output, seed, cv=self.cv)

    @property
    def mean_rate(self) -> float:
        return mean_rate(list(self.trace)) * self.rate_scale if self.trace else self.rate

    def at_rate(self, rate: float) -> "Workload":
        """The same workload arriving at `rate` requests/s on average."""
        if self.trace:
            return replace(self, rate_scale=rate / mean_rate(list(self.trace)))
        return replace(self, rate=rate)

    def describe(self) -> str:
        if self.trace:
            return (f"trace of {len(self.trace)} requests at {self.mean_rate:.3g} req/s "
                    f"(rate x{self.rate_scale:g})")
        arrivals = "Poisson" if self.cv == 1 else f"bursty (cv {self.cv:g})"
        return (f"{arrivals} {self.rate:g} req/s for {self.duration_s:g} s, input {self.input}, "
                f"output {self.output} tokens")
