"""Simulate a whole pdserve system on a profile: `simulate(profile, SystemConfig, trace)`.

What runs is pdserve's own policy code, in simulated time (sim/flow.py's event loop):
the gateway's Admission (gateway/admission.py) and pick rule (gateway/affinity.py: load
against the prefix each worker holds, from the workers' own KV events), decode-first reservation (engine Scheduler.reserve_remote), the
prefill worker's PrefillAdmission (prefill_worker/admission.py), and in every worker the
engine's Scheduler + KVCacheManager + BlockPool (chunked prefill, prefix-cache hits on
block hashes of real token ids, KV capacity, preemption). What is replaced by the profile
(sim/profile.py) is only time: a step's model pass costs what the profile says for the batch
the scheduler gave (sim/workers.py step_cost), the KV handover handover_s, the gateway
gateway_s. The workers share `cores` (sim/cores.py: processor sharing).

Not modelled (the limits of the prediction): the gateway's own CPU (gateway_s is a delay,
not a core's work), the Stats lag of its picks (the simulated gateway sees every worker's
queue at once), token streaming and RPC jitter, reservation expiry mid-prefill, failures
and migration, speculative decoding, and thread scaling beyond the profiled thread count
(linear: see SimWorker.speed). Oversubscribed cores are shared fairly and losslessly
(sim/cores.py); real torch threads that outnumber cores lose more to spinning and switches.

Colocated (prefill=0) is what a decode worker's engine does with a local prompt (its own
Scheduler mixes the chunks into decode steps); `pdserve up` itself still asks for
--prefill >= 1, so that prediction says what a colocated deployment would do.
"""
from __future__ import annotations

from dataclasses import dataclass, field, fields

from engine.config import SchedulerConfig
from gateway.config import GatewayConfig
from prefill_worker.config import PrefillWorkerConfig

from .flow import Flow
from .stats import mean_itl_s, summarize

# decode_worker/config.py's hard bound on a reservation (sim may not import a decode worker; a
# test compares). Its idle window (--kv-expiry-s) is not modelled: a queued prompt's reservation
# is kept alive by the prefill worker's KEEPALIVEs, so only the hard bound ends one.
KV_MAX_RESERVATION_S = 600.0


def _default(cls, name: str):
    return next(f.default for f in fields(cls) if f.name == name)


@dataclass
class SystemConfig:
    prefill: int                 # prefill workers (0: colocated, decode workers prefill)
    decode: int
    cores: float                 # cores the whole system shares (processor sharing)
    prefill_threads: int = 1     # torch threads per prefill worker
    decode_threads: int = 1
    max_num_seqs: int = _default(SchedulerConfig, "max_num_seqs")
    max_num_batched_tokens: int = _default(SchedulerConfig, "max_num_batched_tokens")
    slo_ttft_s: float = 0.0      # the gateway's admission SLOs (0: off), as `up` passes them
    slo_itl_s: float = 0.0
    # the rest: the gateway's and workers' own defaults
    max_in_flight: int = _default(GatewayConfig, "max_in_flight")
    affinity_slack: int = _default(GatewayConfig, "affinity_slack")
    affinity_slack_ratio: float = _default(GatewayConfig, "affinity_slack_ratio")
    decode_affinity_slack: int = _default(GatewayConfig, "decode_affinity_slack")
    prefix_routing: str = _default(GatewayConfig, "prefix_routing")
    prefix_weight_host: float = _default(GatewayConfig, "prefix_weight_host")
    prefix_weight_disk: float = _default(GatewayConfig, "prefix_weight_disk")
    prefix_weight_recompute: float = _default(GatewayConfig, "prefix_weight_recompute")
    max_queued_prefill_tokens: int = _default(PrefillWorkerConfig, "max_queued_prefill_tokens")
    max_queue_delay_factor: float = _default(PrefillWorkerConfig, "max_queue_delay_factor")
    # conditional disaggregation (gateway/disagg.py); always: as before it existed
    disaggregation: str = "always"
    disagg_max_local_tokens: int = _default(GatewayConfig, "disagg_max_local_tokens")
    disagg_max_stall_ms: float = _default(GatewayConfig, "disagg_max_stall_ms")
    kv_max_reservation_s: float = KV_MAX_RESERVATION_S

    def __post_init__(self):
        if self.prefill < 0 or self.decode < 1:
            raise ValueError(f"need prefill >= 0 and decode >= 1 workers, got "
                             f"{self.prefill}P{self.decode}D")
        if self.cores <= 0 or self.prefill_threads < 1 or self.decode_threads < 1:
            raise ValueError("cores must be > 0 and threads >= 1")
        SchedulerConfig(self.max_num_batched_tokens, self.max_num_seqs)   # its own checks


@dataclass
class SimRequest:
    arrival_s: float
    ttft_s: float | None
    e2e_s: float | None
    itl_s: float | None
    output_tokens: int
    status: str                  # "ok" | "rejected" | "error"

    def record(self) -> dict:
        """The per-request record of sim/stats.py."""
        return {"ttft_s": self.ttft_s, "itl_s": self.itl_s, "e2e_s": self.e2e_s,
                "output_tokens": self.output_tokens, "status": self.status}


@dataclass
class SimResult:
    requests: list[SimRequest]
    duration_s: float            # first arrival to the last request's end
    utilisation: dict            # {"prefill": 0..1, "decode": 0..1}: busy fraction, pool mean
                                 # (prefill 0 when colocated: the decode workers' is all)
    queue: dict                  # time-averaged and most requests: "prefill_*" admitted and
                                 # before their first token, "decode_*" preempted mid-decode
                                 # and waiting for a batch place: {"prefill_mean",
                                 # "prefill_max", "decode_mean", "decode_max"}
    events: int = 0              # simulated events (the simulator's work)
    steps: dict = field(default_factory=dict)    # {"prefill": n, "decode": n} engine steps
    preemptions: int = 0
    workers: list[dict] = field(default_factory=list)   # SimWorker.stats() of each
    prefills: dict = field(default_factory=dict)   # {"disaggregated": n, "local": n}, as the
                                 # gateway's prefills_total (colocated: not counted)

    def summary(self, slo_ttft_ms=None, slo_itl_ms=None) -> dict:
        """The keys of `pdserve bench --json` (sim/stats.py summarize) over the run."""
        return summarize([r.record() for r in self.requests], self.duration_s or 1e-9,
                         slo_ttft_ms, slo_itl_ms)


def simulate(profile, system: SystemConfig, trace, *, seed: int = 0) -> SimResult:
    """Run `trace` (list[TraceRecord], arrivals from its start) through `system`."""
    flow = Flow(profile, system, list(trace), seed)
    flow.run()
    return _result(flow)


def _result(flow: Flow) -> SimResult:
    reqs = []
    for f in flow.flights:
        ok = f.status == "ok"
        ttft = f.first - f.arrival if ok else None
        e2e = f.done - f.arrival if ok else None
        reqs.append(SimRequest(f.arrival, ttft, e2e, mean_itl_s(ttft, e2e, f.tokens) if ok else None,
                               f.tokens if ok else 0, f.status))
    start = min((f.arrival for f in flow.flights), default=0.0)
    duration = max(flow.now - start, 0.0)
    span = duration or 1.0

    def util(pool):
        return sum(w.busy_s for w in pool) / (span * len(pool)) if pool else 0.0

    queue = {"prefill_mean": flow.queue_area["prefill"] / span,
             "prefill_max": flow.queue_max["prefill"],
             "decode_mean": flow.queue_area["decode"] / span,
             "decode_max": flow.queue_max["decode"]}
    return SimResult(reqs, duration, {"prefill": util(flow.prefill), "decode": util(flow.decode)},
                     queue, flow.events,
                     {"prefill": sum(w.steps for w in flow.prefill),
                      "decode": sum(w.steps for w in flow.decode)},
                     sum(w.scheduler.num_preemptions for w in flow.prefill + flow.decode),
                     [w.stats() for w in flow.prefill + flow.decode], dict(flow.prefills))
