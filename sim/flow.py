"""The simulated system's event loop: requests through the gateway, the prefill pool and
the decode pool, in simulated time (see system.py for what is modelled and what is not).

One request (disaggregated, as gateway/segment.py runs it):

    arrive      the gateway's Admission (gateway/admission.py, on the simulated clock):
                refused -> "rejected" (429)
    + gateway_s routed: decode first: the pick rule (gateway/affinity.py) over the decode
                workers not yet tried; that worker's Scheduler.reserve_remote; a refusal
                tries the next, none left -> "rejected" (the real decode worker queues
                such a call until room frees, decode_worker/reservations.py: not modelled
                here yet, so past max_num_seqs or a full cache the simulator predicts 429s
                where the system queues). Then a prefill worker: the pick
                rule, its PrefillAdmission (prefill_worker/admission.py); refused -> the
                next, none left -> the reservation is freed, "rejected"
    prefill     the prefill worker's Scheduler runs it (prefill_only: chunked, prefix hits)
                step by step; the step that samples its first token ends its compute
    + handover_s(tokens the decoder lacks): the first token reaches the client (TTFT), the
                prefill worker's blocks are released, the decode worker's remote_ready
    decode      one token per step of the decode worker's batch until output_length
                (preemption and recompute are the Scheduler's own)

Colocated (no prefill workers): routed to a decode worker by the same pick, added to its
Scheduler as a local request: its prompt is chunked into the decode steps.

Conditional disaggregation (system.disaggregation never | auto, with prefill workers): the
decode pick first, then gateway/disagg.py's DisaggPolicy.decide with what the gateway would
see (the prefix that worker holds, streams, engine queue and KV; the prefill workers'
queued tokens); local: colocated on that worker, as above. Its costs are seeded by the
profile's fits and learnt from the simulated first tokens, as the gateway learns them.

What each worker holds comes, as in the gateway, from a PrefixIndex (gateway/prefix_index.py)
fed by every simulated worker's own KV event log (its BlockPool's stores and evictions),
replayed before each pick (`_sync`: events arrive at once, where the real ones take a hop).
"""
from __future__ import annotations

import dataclasses
import heapq
import itertools
import math
import random

from engine.kv_cache_manager import cdiv
from engine.request import Request, RequestStatus
from engine.sampling_params import SamplingParams
from gateway.admission import Admission
from gateway.affinity import (MAX_HASHED_BLOCKS, Weights, choose, decode_bounds, decode_weights,
                              leading_hashes)
from gateway.prefix_index import PrefixIndex
from gateway.disagg import LOCAL, DecodeView, DisaggPolicy, PrefillView, costs_from_fits

from .cores import Cores
from .tokens import VOCAB, prompt_tokens
from .workers import SimWorker


@dataclasses.dataclass
class Flight:
    """One trace request on its way through the system."""
    index: int
    arrival: float
    input_length: int
    output_length: int
    hash_ids: tuple
    status: str = ""                 # "" while in flight, then ok | rejected | error
    first: float | None = None       # first token's time
    last: float | None = None        # latest token's time
    done: float | None = None
    tokens: int = 0
    dreq: Request | None = None
    preq: Request | None = None
    decode: SimWorker | None = None
    prefill: SimWorker | None = None
    queued: int = 0                  # tokens it holds in its prefill worker's admission
    learn: tuple = ()                # (kind, tokens, time routed): a cost the policy learns


class Flow:
    def __init__(self, profile, system, trace, seed: int = 0):
        self.profile, self.system, self.seed = profile, system, seed
        self.now = 0.0
        self._heap: list = []
        self._seq = itertools.count()
        self.cores = Cores(system.cores)
        self.prefill = [SimWorker("prefill", i, profile, system) for i in range(system.prefill)]
        self.decode = [SimWorker("decode", i, profile, system) for i in range(system.decode)]
        self.admission = Admission(system.max_in_flight, system.slo_ttft_s, system.slo_itl_s,
                                   clock=lambda: self.now)
        self.index = PrefixIndex()         # the simulated gateway's, fed by _sync
        self.weights = Weights(system.prefix_weight_host, system.prefix_weight_disk,
                               system.prefix_weight_recompute)
        self.block_size = int(profile.kv["block_size"])
        self.max_len = int((getattr(profile, "model", None) or {}).get("max_model_len") or 0)
        self.rng = random.Random(seed)
        self.in_flight = 0                 # the gateway's requests in flight
        self.prefilling = 0                # requests admitted to a prefill, before their first token
        self.events = 0
        self.queue_area = {"prefill": 0.0, "decode": 0.0}
        self.queue_max = {"prefill": 0, "decode": 0}
        self._last = 0.0
        self.flights = [Flight(i, r.timestamp_ms / 1e3, r.input_length, r.output_length,
                               tuple(r.hash_ids)) for i, r in enumerate(trace)]
        self._by_id: dict[str, Flight] = {}
        self._dirty: list[SimWorker] = []
        self.policy = DisaggPolicy.from_costs(
            costs_from_fits(profile.fits), mode=system.disaggregation,
            max_local_tokens=system.disagg_max_local_tokens,
            max_stall_s=system.disagg_max_stall_ms / 1e3)
        self.prefills = {"disaggregated": 0, "local": 0}

    # -- the loop ---------------------------------------------------------------------------
    def push(self, t: float, fn, *args) -> None:
        heapq.heappush(self._heap, (t, next(self._seq), fn, args))

    def run(self) -> None:
        for f in self.flights:
            self.push(f.arrival, self._arrive, f)
        while True:
            t_heap = self._heap[0][0] if self._heap else math.inf
            t_step, w = self.cores.next_done()
            if t_heap == math.inf and w is None:
                break
            if t_step <= t_heap:
                self._tick(t_step)
                self.cores.finish(t_step, w)
                self._step_done(w)
            else:
                t, _, fn, args = heapq.heappop(self._heap)
                self._tick(t)
                fn(*args)
            for d in self._dirty:
                self._kick(d)
            self._dirty.clear()
        for f in self.flights:
            if not f.status:                   # never finished: cannot be served
                f.status = "error"

    def _tick(self, t: float) -> None:
        """Advance the clock to `t`, integrating the queue lengths."""
        self.events += 1
        dt = t - self._last
        q = {"prefill": self.prefilling, "decode": self._decode_queue()}
        for k, n in q.items():
            self.queue_area[k] += n * dt
            self.queue_max[k] = max(self.queue_max[k], n)
        self._last = self.now = t

    def _decode_queue(self) -> int:
        """Requests that have begun decoding and wait for a place in a batch (preempted)."""
        return sum(1 for w in self.decode for r in w.scheduler.waiting if r.output_token_ids)

    def _kick(self, w: SimWorker) -> None:
        """An idle worker starts its next step, if its scheduler has one."""
        if w in self.cores.busy:
            return
        work = w.begin()
        if work is not None:
            w.started = self.now
            self.cores.start(self.now, w, work)

    # -- the gateway ---------------------------------------------------------------------
    def _arrive(self, f: Flight) -> None:
        if self.admission.refusal(self.in_flight) is not None:
            f.status = "rejected"
            return
        self.in_flight += 1
        self.push(self.now + self.profile.gateway_s, self._routed, f)

    def _routed(self, f: Flight) -> None:
        prompt = prompt_tokens(f.hash_ids, f.input_length, self.seed, f.index)
        if not self._fits(f):
            return self._end(f, "error")
        rid = f"r{f.index}"
        self._by_id[rid] = f
        f.dreq = Request(rid, prompt, SamplingParams(max_tokens=f.output_length), f.output_length)
        if not self.prefill:
            return self._colocate(f)
        if self.system.disaggregation != "always" and self._local(f, prompt):
            return None
        queued = sum(p.admission.queued for p in self.prefill) / len(self.prefill)
        f.learn = ("disaggregated", len(prompt) + queued, self.now)
        if not self._reserve(f):
            return self._end(f, "rejected")
        if not self._admit_prefill(f, prompt):
            f.decode.scheduler.remove(f.dreq)
            f.decode.detach()
            self._dirty.append(f.decode)
            return self._end(f, "rejected")
        self.prefills["disaggregated"] += 1

    def _fits(self, f: Flight) -> bool:
        """The engine's own refusal (LLMEngine._make_request): the request's blocks past
        the whole cache, or its tokens past the context (and an empty prompt or output,
        which the gateway's validation refuses)."""
        need = cdiv(f.input_length + f.output_length, self.block_size)
        too_long = self.max_len and f.input_length + f.output_length > self.max_len
        return (need <= int(self.profile.kv["num_blocks"]) and not too_long
                and f.input_length > 0 and f.output_length > 0)

    def _sync(self) -> None:
        """Replay every worker's new KV events into the index (a snapshot when it lags)."""
        for w in (*self.prefill, *self.decode):
            log, pos = w.kv.events, self.index.position(w.address)
            events = log.since(pos[1]) if pos is not None else None
            if events is None or not self.index.apply(w.address, log.epoch, events):
                seq, snap = log.snapshot()
                self.index.reset(w.address, log.epoch, seq, snap)

    def _hashes(self, prompt: list[int]) -> list[bytes]:
        self._sync()
        return leading_hashes(self.index, prompt, self.block_size, MAX_HASHED_BLOCKS)

    def _pick(self, pool: list[SimWorker], kind: str, exclude, hashes) -> SimWorker | None:
        g = self.system
        slack, ratio = ((g.affinity_slack, g.affinity_slack_ratio) if kind == "prefill"
                        else decode_bounds(g.affinity_slack, g.decode_affinity_slack))
        cands = [w for w in pool if w.address not in exclude]
        hits = ({w.address: self.index.match(hashes, w.address) for w in cands}
                if g.prefix_routing == "events" else None)
        weights = self.weights if kind == "prefill" else decode_weights(self.weights)
        got = choose(cands, hits, self.block_size, weights, slack, ratio)
        return got.worker if got is not None else None

    def _local(self, f: Flight, prompt: list[int]) -> bool:
        """The gateway's choice (gateway/placement.py) on the decode pick: True when local
        (then colocated on that worker)."""
        hashes = self._hashes(prompt)
        w = self._pick(self.decode, "decode", (), hashes)
        held = self.index.match(hashes, w.address).total * self.block_size
        waiting = sum(1 for r in w.scheduler.waiting if r.status == RequestStatus.WAITING
                      and not r.output_token_ids)
        view = DecodeView(w.in_flight, waiting, w.kv.num_free_blocks, int(self.profile.kv["num_blocks"]))
        pool = PrefillView(len(self.prefill), sum(p.admission.queued for p in self.prefill))
        choice = self.policy.decide(len(prompt), held, pool, view)
        if choice.kind != LOCAL:
            return False
        f.learn = ("local", choice.uncached, self.now)
        self.prefills["local"] += 1
        self._colocate(f, w, hashes)
        return True

    def _colocate(self, f: Flight, w: SimWorker | None = None, hashes=None) -> None:
        if hashes is None:
            hashes = self._hashes(f.dreq.prompt_token_ids)
        w = w or self._pick(self.decode, "decode", (), hashes)
        f.decode = w
        w.attach()
        w.scheduler.add(f.dreq)
        self.prefilling += 1
        self._dirty.append(w)

    def _reserve(self, f: Flight) -> bool:
        """Decode first (gateway/segment.py _open_decode): each refusing worker is skipped."""
        hashes = self._hashes(f.dreq.prompt_token_ids)
        tried: set[str] = set()
        while (w := self._pick(self.decode, "decode", tried, hashes)) is not None:
            tried.add(w.address)
            if w.scheduler.reserve_remote(f.dreq):
                f.decode = w
                w.attach()
                return True
        return False

    def _admit_prefill(self, f: Flight, prompt: list[int]) -> bool:
        """A prefill worker whose admission takes the call (its deadline: the decode
        reservation's hard bound, decode_worker/config.py's default; a queued call's
        KEEPALIVEs hold the idle window; and its slowdown bound)."""
        tokens = len(prompt) - f.dreq.num_cached_tokens
        hashes = self._hashes(prompt)
        tried: set[str] = set()
        while (w := self._pick(self.prefill, "prefill", tried, hashes)) is not None:
            tried.add(w.address)
            if w.admission.refusal(tokens, self.system.kv_max_reservation_s, self.now):
                continue                   # counted in its `refused`
            w.admission.started(tokens, self.now)
            f.prefill, f.queued = w, tokens
            f.preq = Request(f.dreq.request_id, prompt, SamplingParams(max_tokens=1), 1,
                             prefill_only=True)
            w.attach()
            w.scheduler.add(f.preq)
            self.prefilling += 1
            self._dirty.append(w)
            return True
        return False

    # -- the workers' steps ----------------------------------------------------------------
    def _step_done(self, w: SimWorker) -> None:
        w.busy_s += self.now - w.started
        out = w.end()
        w.max_batch = max(w.max_batch, len(out.scheduled))
        for s in out.scheduled:
            if not s.samples:
                continue
            if w.role == "prefill":
                self._prefilled(w, s.request)
            else:
                self._token(w, s.request)
        self._dirty.append(w)

    def _prefilled(self, w: SimWorker, preq: Request) -> None:
        f = self._by_id[preq.request_id]
        preq.status = RequestStatus.FINISHED_PREFILL
        w.scheduler.finish(preq)
        lacking = preq.num_prompt_tokens - f.dreq.num_cached_tokens
        self.push(self.now + self.profile.handover_s(lacking), self._handed_over, f)

    def _handed_over(self, f: Flight) -> None:
        p, d = f.prefill, f.decode
        p.scheduler.release(f.preq)
        p.admission.ended(f.queued, True, self.now)
        p.detach()
        self._dirty.append(p)
        d.scheduler.remote_ready(f.dreq)
        self._token(d, f.dreq)
        self._dirty.append(d)

    def _token(self, w: SimWorker, req: Request) -> None:
        """`req` got its next token on decode worker `w` (its first too, when colocated)."""
        f = self._by_id[req.request_id]
        req.output_token_ids.append(self.rng.randrange(VOCAB))
        f.tokens += 1
        if f.first is None:
            f.first = self.now
            self.prefilling -= 1
            if f.learn:
                kind, tokens, t0 = f.learn
                (self.policy.observe_local if kind == "local" else self.policy.observe_remote)(
                    tokens, self.now - t0)
            self.admission.first_token(self.now - f.arrival)
        else:
            self.admission.tokens(self.now - f.last, 1)
        f.last = self.now
        if len(req.output_token_ids) >= req.max_tokens:
            req.status = RequestStatus.FINISHED_LENGTH
            w.scheduler.finish(req)
            w.detach()
            self._end(f, "ok")

    def _end(self, f: Flight, status: str) -> None:
        f.status, f.done = status, self.now
        self.in_flight -= 1
