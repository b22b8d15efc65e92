"""The one definition of the latency figures that `pdserve bench` measures and the simulator
predicts, so the two compare key by key.

Percentiles (`pct`) interpolate linearly between the closest ranks, numpy's default
("linear", type 7 of Hyndman and Fan): pct(xs, q) == numpy.percentile(xs, q).

A per-request record is a dict
    {"ttft_s": float, "itl_s": float | None, "e2e_s": float, "output_tokens": int,
     "status": "ok" | "rejected" | "error"}            (+ optional "tokens_from_usage": bool)
with itl_s the request's mean inter-token latency: the time from its first to its last token
over output_tokens - 1 (None when it produced fewer than two tokens; pdserve bench times it
between the first and last content chunks, `mean_itl_s` from a simulated request's times). So
ITL percentiles are over requests, and a server that sends several tokens in one chunk is not
credited with a zero gap.

`summarize` returns the keys of `pdserve bench --json` (SUMMARY_KEYS). Latency percentiles are
over the completed ("ok") requests; a percentile with no data is None. A request meets the SLOs
when it completed, its TTFT <= slo_ttft_ms (if given) and its ITL <= slo_itl_ms (if given; a
request without an ITL meets that one). goodput_rps = requests meeting the SLOs / window_s;
slo_attainment = the same count / requests sent; throughput_tok_s = output tokens of completed
requests / window_s. With no SLO given every completed request counts as good.
"""
from __future__ import annotations

import math
from typing import Iterable, Sequence

SUMMARY_KEYS = ("requests", "completed", "errors", "rejected_429", "duration_s",
                "ttft_p50_ms", "ttft_p90_ms", "ttft_p99_ms", "itl_p50_ms", "itl_p90_ms",
                "e2e_p50_ms", "e2e_p90_ms", "throughput_tok_s", "goodput_rps",
                "slo_attainment", "tokens_from_usage")
STATUSES = ("ok", "rejected", "error")


def pct(xs: Sequence[float], q: float) -> float:
    """The q-th percentile (0 <= q <= 100) of xs, linear between closest ranks; nan if empty."""
    if not 0 <= q <= 100:
        raise ValueError(f"percentile {q} is not in [0, 100]")
    s = sorted(xs)
    if not s:
        return float("nan")
    pos = (len(s) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def _ms(xs: list[float], q: float) -> float | None:
    return round(pct(xs, q) * 1000.0, 3) if xs else None


def meets_slo(r: dict, slo_ttft_ms: float | None, slo_itl_ms: float | None) -> bool:
    if r["status"] != "ok":
        return False
    if slo_ttft_ms and r["ttft_s"] * 1000.0 > slo_ttft_ms:
        return False
    itl = r.get("itl_s")
    return not (slo_itl_ms and itl is not None and itl * 1000.0 > slo_itl_ms)


def summarize(records: Iterable[dict], window_s: float, slo_ttft_ms: float | None = None,
              slo_itl_ms: float | None = None) -> dict:
    """The bench summary (SUMMARY_KEYS) of per-request records over an arrival window."""
    recs = list(records)
    bad = [r.get("status") for r in recs if r.get("status") not in STATUSES]
    if bad:
        raise ValueError(f"unknown request status {bad[0]!r} (one of {STATUSES})")
    if not window_s > 0:
        raise ValueError(f"window_s must be > 0, got {window_s}")
    ok = [r for r in recs if r["status"] == "ok"]
    ttft = [r["ttft_s"] for r in ok]
    e2e = [r["e2e_s"] for r in ok]
    itl = [r["itl_s"] for r in ok if r.get("itl_s") is not None]
    good = sum(meets_slo(r, slo_ttft_ms, slo_itl_ms) for r in recs)
    return {
        "requests": len(recs), "completed": len(ok),
        "errors": sum(r["status"] == "error" for r in recs),
        "rejected_429": sum(r["status"] == "rejected" for r in recs),
        "duration_s": round(window_s, 6),
        "ttft_p50_ms": _ms(ttft, 50), "ttft_p90_ms": _ms(ttft, 90), "ttft_p99_ms": _ms(ttft, 99),
        "itl_p50_ms": _ms(itl, 50), "itl_p90_ms": _ms(itl, 90),
        "e2e_p50_ms": _ms(e2e, 50), "e2e_p90_ms": _ms(e2e, 90),
        "throughput_tok_s": round(sum(r["output_tokens"] for r in ok) / window_s, 3),
        "goodput_rps": round(good / window_s, 4),
        "slo_attainment": round(good / len(recs), 4) if recs else None,
        "tokens_from_usage": all(r.get("tokens_from_usage", True) for r in ok),
    }


def mean_itl_s(ttft_s: float, e2e_s: float, output_tokens: int) -> float | None:
    """A request's mean inter-token latency when its e2e ends at its last token; None with
    fewer than two tokens."""
    return (e2e_s - ttft_s) / (output_tokens - 1) if output_tokens >= 2 else None
