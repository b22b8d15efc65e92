"""`pdserve plan`: how many prefill and decode workers, with which batch and chunk settings,
meet TTFT <= X and ITL <= Y for a workload at the lowest cost, predicted by the simulator
(sim.system.simulate) from a measured profile (`pdserve profile`).

    workload (a trace, or a rate + length distributions)     profile (measured costs)
                      \\                                       /
      for P in 0..N-1, D in 1..N, P + D <= N, each setting (max_num_seqs, max_num_batched_tokens):
          simulate(profile, SystemConfig(P, D, threads as `pdserve up` gives them), workload, seed)
          for each seed (a synthetic workload is drawn afresh per seed)  -> mean of the summaries
      rank: those meeting the SLO attainment target first, by goodput per worker (descending),
            ties by fewer workers, then lower TTFT p90; the rest after, by attainment

P = 0 is colocated serving: the D workers prefill their own prompts (the simulator's model of
it; `pdserve up` starts disaggregated systems only, P >= 1). Threads per worker follow
`pdserve up` (`UpConfig.threads`: the prefill workers split all the cores, the decode workers
half of them); colocated workers split all the cores.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from engine.config import SchedulerConfig
from sim.workload import Workload

from .up import UpConfig

_ENGINE = SchedulerConfig()
DEFAULT_MAX_NUM_SEQS = (_ENGINE.max_num_seqs, _ENGINE.max_num_seqs // 4)   # the engine's first
DEFAULT_MAX_NUM_BATCHED_TOKENS = (_ENGINE.max_num_batched_tokens,
                                  _ENGINE.max_num_batched_tokens // 4)
PREDICTED_KEYS = ("ttft_p50_ms", "ttft_p90_ms", "itl_p50_ms", "itl_p90_ms", "e2e_p50_ms",
                  "goodput_rps", "slo_attainment", "throughput_tok_s", "rejected_429")


@dataclass
class Candidate:
    """One configuration and its predicted summary (the mean over seeds)."""
    prefill: int
    decode: int
    settings: dict
    threads: dict
    summary: dict = field(default_factory=dict)

    @property
    def workers(self) -> int:
        return self.prefill + self.decode

    @property
    def goodput_per_worker(self) -> float:
        return _num(self.summary, "goodput_rps") / self.workers

    @property
    def name(self) -> str:
        return f"{self.decode} colocated" if self.prefill == 0 else f"{self.prefill}P{self.decode}D"

    def meets(self, attainment: float) -> bool:
        return _num(self.summary, "slo_attainment") >= attainment

    def to_json(self, attainment: float) -> dict:
        return {"prefill": self.prefill, "decode": self.decode, "settings": self.settings,
                "threads": self.threads, "workers": self.workers,
                "goodput_per_worker": self.goodput_per_worker,
                "meets_attainment": self.meets(attainment),
                "predicted": {k: self.summary.get(k) for k in PREDICTED_KEYS}}


def threads_for(prefill: int, decode: int, cores: float) -> tuple[int, int]:
    """(prefill, decode) torch threads per worker, as `pdserve up` gives them on `cores`."""
    if prefill == 0:
        return 0, max(1, int(cores) // decode)
    return UpConfig(prefill=prefill, decode=decode, grpc_port=0,
                    http_port=0).threads(cores=max(1, int(cores)))


def shapes(max_workers: int) -> list[tuple[int, int]]:
    """Every (P, D) with P in 0..N-1, D in 1..N, P + D <= N (P = 0: colocated)."""
    return [(p, d) for p in range(max_workers) for d in range(1, max_workers + 1)
            if p + d <= max_workers]


def _system(p: int, d: int, settings: dict, cores: float, slo: tuple[float, float],
            admission: bool):
    from sim.system import SystemConfig
    pt, dt = threads_for(p, d, cores)
    return SystemConfig(prefill=p, decode=d, cores=cores, prefill_threads=max(pt, 1),
                        decode_threads=dt, slo_ttft_s=slo[0] / 1000 if admission else 0.0,
                        slo_itl_s=slo[1] / 1000 if admission else 0.0, **settings)


def evaluate(profile, cand: Candidate, workload: Workload, *, cores: float,
             slo: tuple[float, float], seeds: int = 1, admission: bool = False,
             simulate=None) -> Candidate:
    """Simulate `cand` on `workload` for `seeds` seeds; its summary is their mean."""
    if simulate is None:
        from sim.system import simulate
    system = _system(cand.prefill, cand.decode, cand.settings, cores, slo, admission)
    runs = []
    for seed in range(seeds):
        result = simulate(profile, system, workload.records(seed), seed=seed)
        runs.append(result.summary(slo_ttft_ms=slo[0] or None, slo_itl_ms=slo[1] or None))
    cand.summary = {k: _mean([r.get(k) for r in runs]) for k in runs[0]}
    return cand


def _mean(xs: list):
    """The mean of the numbers among xs (None where there are none; a bool: all of them)."""
    if all(isinstance(x, bool) for x in xs):
        return all(xs)
    nums = [x for x in xs if isinstance(x, (int, float)) and not isinstance(x, bool)]
    return sum(nums) / len(nums) if nums else None


def _num(s: dict, key: str, default: float = 0.0) -> float:
    v = s.get(key)
    return default if v is None else v


def rank(cands: list[Candidate], attainment: float) -> list[Candidate]:
    """Meeting the target first by goodput per worker, fewer workers, lower TTFT p90; then
    the rest by attainment, then goodput per worker."""
    def key(c: Candidate):
        s = c.summary
        if c.meets(attainment):
            return (0, -round(c.goodput_per_worker, 9), c.workers,
                    _num(s, "ttft_p90_ms", float("inf")))
        return (1, -_num(s, "slo_attainment"), -round(c.goodput_per_worker, 9), c.workers)
    return sorted(cands, key=key)


def candidates(max_workers: int, cores: float, max_num_seqs=DEFAULT_MAX_NUM_SEQS,
               max_num_batched_tokens=DEFAULT_MAX_NUM_BATCHED_TOKENS) -> list[Candidate]:
    out = []
    for p, d in shapes(max_workers):
        pt, dt = threads_for(p, d, cores)
        for seqs in max_num_seqs:
            for tokens in max_num_batched_tokens:
                out.append(Candidate(p, d, {"max_num_seqs": seqs,
                                            "max_num_batched_tokens": tokens},
                                     {"prefill": pt, "decode": dt}))
    return out


def search(profile, workload: Workload, *, max_workers: int, cores: float,
           slo: tuple[float, float], attainment: float = 0.9, seeds: int = 1,
           max_num_seqs=DEFAULT_MAX_NUM_SEQS,
           max_num_batched_tokens=DEFAULT_MAX_NUM_BATCHED_TOKENS, admission: bool = False,
           simulate=None, progress=None) -> list[Candidate]:
    """Every candidate simulated, ranked (see `rank`)."""
    cands = candidates(max_workers, cores, max_num_seqs, max_num_batched_tokens)
    for i, c in enumerate(cands, 1):
        evaluate(profile, c, workload, cores=cores, slo=slo, seeds=seeds, admission=admission,
                 simulate=simulate)
        if progress:
            progress(f"[{i}/{len(cands)}] {c.name} {c.settings}: goodput "
                     f"{_num(c.summary, 'goodput_rps'):.3g} req/s, attainment "
                     f"{_num(c.summary, 'slo_attainment'):.2f}")
    return rank(cands, attainment)


def capacity(profile, cand: Candidate, workload: Workload, *, cores: float,
             slo: tuple[float, float], attainment: float = 0.9, seeds: int = 1,
             simulate=None, steps: int = 10) -> float:
    """The highest mean rate (req/s) at which `cand` meets the attainment target: bisection
    (in log space) between rates that do and do not, found by doubling from the workload's."""
    def ok(rate: float) -> bool:
        c = Candidate(cand.prefill, cand.decode, cand.settings, cand.threads)
        return evaluate(profile, c, workload.at_rate(rate), cores=cores, slo=slo, seeds=seeds,
                        simulate=simulate).meets(attainment)
    lo = hi = workload.mean_rate
    if ok(lo):
        while ok(hi * 2) and hi < 1e4 * lo:
            hi *= 2
        lo, hi = hi, hi * 2
    else:
        while not ok(lo / 2) and lo > 1e-4 * hi:
            lo /= 2
        lo, hi = lo / 2, lo
        if lo <= 1e-4 * hi:
            return 0.0
    for _ in range(steps):
        mid = (lo * hi) ** 0.5
        lo, hi = (mid, hi) if ok(mid) else (lo, mid)
    return lo


def profile_cores(profile) -> float:
    """The cores the profile's machine offered: its affinity, else its logical cores."""
    m = profile.machine or {}
    return float(m.get("cores") or len(m.get("affinity") or ()) or m.get("logical_cores") or 1)


def table(ranked: list[Candidate], attainment: float, top: int) -> str:
    head = ("| rank | P | D | threads P/D | max_num_seqs | max_batched_tokens | goodput/worker "
            "| goodput req/s | SLO attainment | TTFT p50 ms | TTFT p90 ms | ITL p50 ms | "
            "ITL p90 ms |")
    lines = [head, "|" + " --- |" * (head.count("|") - 1)]
    for i, c in enumerate(ranked[:top], 1):
        s = c.summary
        mark = "" if c.meets(attainment) else " (misses)"
        cells = [i, c.prefill, c.decode, f"{c.threads['prefill']}/{c.threads['decode']}",
                 c.settings["max_num_seqs"], c.settings["max_num_batched_tokens"],
                 f"{c.goodput_per_worker:.3f}", _cell(s, "goodput_rps", ".3f"),
                 _cell(s, "slo_attainment", ".3f") + mark, _cell(s, "ttft_p50_ms", ".0f"),
                 _cell(s, "ttft_p90_ms", ".0f"), _cell(s, "itl_p50_ms", ".1f"),
                 _cell(s, "itl_p90_ms", ".1f")]
        lines.append("| " + " | ".join(str(x) for x in cells) + " |")
    return "\n".join(lines)


def _cell(s: dict, key: str, fmt: str) -> str:
    v = s.get(key)
    return "-" if v is None else format(v, fmt)
