"""Where a segment's prompt is computed: gateway/disagg.py's rule fed with what the gateway
knows now, and its bookkeeping.

    choose(decode worker, prompt, cached)
        cached   = the prompt's leading blocks that worker holds (any tier, from its KV
                   events: Router.cached_on) x its block size
        prefill  = PrefillView(healthy prefill workers, queued tokens: the larger of their
                   loads (registry's load_tokens: this gateway's open Prefill calls exactly,
                   plus what their Stats report beyond those; not the raw Stats, which
                   still count a call that ended since the last probe: lone prompts in a
                   row then saw the one before them queued and went local, every other
                   one) and the tokens of this gateway's Prefill calls still open, counted
                   from just before each opens)
        decode   = DecodeView(running: the larger of the gateway's in-flight count on it
                   and its Stats' num_running; waiting: its engine's queue less the
                   reservations waiting for KV; KV blocks from its Stats)
        seeds    = the workers' measured prompt costs (Stats' prefill_cost: this decode
                   worker's, the healthy prefill workers' mean) for a cost line not yet
                   observed (DisaggPolicy.seed_measured)
        -> a Ticket (the Choice, the tokens it counts against the prefill queue, a clock)
    started(ticket)                 a disaggregated segment's Prefill is about to open
    first_token(ticket, now)        the first token is there: the cost it took is learnt
                                    (observe_local / observe_remote), the queue released
    done(ticket)                    the segment ended (whatever happened): queue released
    local_instead(error, ticket)    auto: the prefill pool refused the prompt for good
                                    (RESOURCE_EXHAUSTED): the segment goes local instead
                                    (counted kv_transfer_fallbacks_total{kind="local"})
    counted(ticket)                 each segment's prompt counted once by kind:
                                    pdserve:prefills_total{kind} and `counts`
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field

import grpc

from services.metrics import Metrics

from .config import GatewayConfig
from .disagg import DISAGGREGATED, KINDS, LOCAL, Choice, DecodeView, DisaggPolicy, PrefillView
from .registry import Worker, WorkerPool
from .request import GatewayError

log = logging.getLogger(__name__)


@dataclass(eq=False)
class Ticket:
    choice: Choice
    prompt_tokens: int
    queued_per_worker: float = 0.0
    t_open: float = 0.0               # loop time the segment's Decode call opened
    in_queue: bool = False            # its tokens count in the gateway's prefill queue
    observed: bool = False

    @property
    def local(self) -> bool:
        return self.choice.kind == LOCAL


@dataclass
class Placement:
    policy: DisaggPolicy
    prefill: WorkerPool
    metrics: Metrics
    counts: dict = field(default_factory=lambda: {k: 0 for k in KINDS})
    queued_tokens: int = 0            # tokens of this gateway's Prefill calls still open

    @classmethod
    def from_config(cls, cfg: GatewayConfig, prefill: WorkerPool, metrics: Metrics) -> "Placement":
        policy = DisaggPolicy.with_profile(
            cfg.profile, mode=cfg.disaggregation, max_local_tokens=cfg.disagg_max_local_tokens,
            max_stall_s=cfg.disagg_max_stall_ms / 1e3)
        return cls(policy, prefill, metrics)

    def choose(self, w: Worker, prompt: list[int], cached: int,
               prompt_logprobs: bool = False, local_reason: str = "") -> Ticket:
        """`cached`: prompt tokens the index says `w` holds (Router.cached_on).
        `prompt_logprobs`: asked for, which only a prefill worker returns: disaggregated
        (--disaggregation never: INVALID_ARGUMENT). `local_reason`: local, for it (a
        fallback: local_instead)."""
        healthy = self.prefill.healthy()
        queued = max(sum(x.load_tokens() for x in healthy), self.queued_tokens)
        s = w.stats
        running = max(w.in_flight, s.num_running if s is not None else 0)
        view = DecodeView(running=running) if s is None else DecodeView(
            running, max(s.num_waiting - s.num_waiting_for_kv, 0), s.free_kv_blocks,
            s.total_kv_blocks)
        self.policy.seed_measured(_cost(s), _mean_cost([x.stats for x in healthy]))
        choice = self.policy.decide(len(prompt), cached, PrefillView(len(healthy), queued), view)
        if local_reason:
            choice.kind, choice.reasons = LOCAL, [local_reason]
        if prompt_logprobs and choice.kind == LOCAL:
            if self.policy.mode == "never":
                raise GatewayError(grpc.StatusCode.INVALID_ARGUMENT, "prompt_logprobs need a "
                                   "prefill worker: this gateway runs --disaggregation never")
            choice.kind, choice.reasons = DISAGGREGATED, ["prompt_logprobs asked (only a "
                                                          "prefill worker returns them)"]
        return Ticket(choice, len(prompt), queued / max(len(healthy), 1))

    def local_instead(self, e, t: Ticket, params) -> str:
        """Why a segment whose Prefill failed for good computes its prompt locally instead
        ("": it does not): auto, and the prefill pool refused it (RESOURCE_EXHAUSTED: its
        queue is past its bound, so the wait there is longer than computing it here)."""
        if (self.policy.mode != "auto" or e.code() != grpc.StatusCode.RESOURCE_EXHAUSTED
                or params.prompt_logprobs is not None):
            return ""
        return f"the prefill pool refused the prompt ({e.details()}): computing it locally"

    def started(self, t: Ticket) -> None:
        if not t.in_queue and not t.local:
            t.in_queue = True
            self.queued_tokens += t.prompt_tokens

    def first_token(self, t: Ticket, now: float) -> None:
        if not t.observed and t.t_open:
            t.observed = True
            if t.local:
                self.policy.observe_local(t.choice.uncached, now - t.t_open)
            else:
                self.policy.observe_remote(t.prompt_tokens + t.queued_per_worker, now - t.t_open)
        self.done(t)

    def done(self, t: Ticket) -> None:
        if t.in_queue:
            t.in_queue = False
            self.queued_tokens -= t.prompt_tokens

    def counted(self, t: Ticket, rid: str) -> None:
        kind = t.choice.kind
        self.counts[kind] += 1
        self.metrics.observe_prefill(kind)
        log.debug("request %s: %s prefill (%s)", rid, kind, "; ".join(t.choice.reasons))


def _cost(stats) -> tuple[float, float] | None:
    """A worker's measured prompt cost from its Stats (services/prefill_cost.py; None: not
    reported)."""
    if stats is None or not stats.HasField("prefill_cost"):
        return None
    c = stats.prefill_cost
    return c.fixed_s, c.per_token_s


def _mean_cost(stats: list) -> tuple[float, float] | None:
    """The mean of the workers' measured costs (a pool is alike: one line stands for it)."""
    costs = [c for c in map(_cost, stats) if c is not None]
    if not costs:
        return None
    return sum(a for a, _ in costs) / len(costs), sum(b for _, b in costs) / len(costs)


__all__ = ["Placement", "Ticket", "LOCAL", "DISAGGREGATED"]
