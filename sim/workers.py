"""One simulated worker: the engine's own `Scheduler` over its own `KVCacheManager` (and so
`BlockPool`: prefix hits, chunked prefill, preemption are the engine's), with the model's
forward pass replaced by the profile's cost of the batch the scheduler gave (`step_cost`).

A worker is busy while a step is in progress (the step's wall time is set by sim/cores.py's
processor sharing); between steps it asks its scheduler for the next one, and is idle when
the scheduler has nothing to run. It has what the gateway's pick rule reads
(gateway/affinity.py: address, in_flight, load_key(), requests_total, load_tokens()), and
its KVCacheManager's KV event log (`kv.events`), which feeds the simulated gateway's prefix
index as the real worker's feeds the real one's.
"""
from __future__ import annotations

from engine.config import SchedulerConfig
from engine.kv_cache_manager import KVCacheManager
from engine.scheduler import Scheduler, SchedulerOutput
from prefill_worker.admission import PrefillAdmission

# the prefill worker's warm-up prompts (services/prefill_cost.py WARM_UP_*_TOKENS): the
# admission's cost model is seeded from the profile's cost of these two lengths
WARM_UP_LENGTHS = (256, 8)


def fixed_cost(profile) -> float:
    """A prefill pass's fixed part (weights read, launch, sampling): the profile's line
    through 1 and 2 tokens, back to 0 tokens, clamped to [0, cost of 1 token]."""
    one, two = profile.prefill_s(1, 0), profile.prefill_s(2, 0)
    return min(max(0.0, 2 * one - two), one)


def step_cost(profile, out: SchedulerOutput, fixed: float) -> float:
    """Seconds (at the profiled threads, cores to itself) of one engine step running `out`.

        decodes   the scheduled items computing one token past the prompt: one
                  decode_s(batch, sum of their contexts)
        chunks    the rest (prompt chunks, recomputes after preemption): prefill_s(n, start)
                  each, as the profile measured one chunk alone; one forward pass runs them
                  all, so the fixed cost of a pass is counted once per step: every chunk
                  after the first (every chunk, when decodes ride the step) less `fixed`
    """
    batch = context = 0
    chunks = 0.0
    k = 0
    for s in out.scheduled:
        req = s.request
        if s.num_new_tokens == 1 and s.start >= req.num_prompt_tokens:
            batch += 1
            context += s.start + 1
        else:
            chunks += profile.prefill_s(s.num_new_tokens, s.start)
            k += 1
    cost = profile.decode_s(batch, context) if batch else 0.0
    if k:
        cost += max(0.0, chunks - fixed * (k if batch else k - 1))
    return cost


class SimWorker:
    def __init__(self, role: str, index: int, profile, system):
        self.role = role                          # "prefill" | "decode"
        self.address = f"{role}-{index}"
        self.threads = system.prefill_threads if role == "prefill" else system.decode_threads
        kv = profile.kv
        self.kv = KVCacheManager(int(kv["num_blocks"]), int(kv["block_size"]))
        self.scheduler = Scheduler(SchedulerConfig(
            max_num_batched_tokens=system.max_num_batched_tokens,
            max_num_seqs=system.max_num_seqs), self.kv)
        # the profile measured a worker with profile.threads threads: other thread counts
        # scale its cost linearly (an approximation: say so where it matters)
        options = getattr(profile, "options", None) or {}
        measured = options.get(f"{role}_threads") or getattr(profile, "threads", 1) or 1
        self.speed = self.threads / max(1, int(measured))
        self.profile, self.fixed = profile, fixed_cost(profile)
        self.step: SchedulerOutput | None = None
        self.started = 0.0                         # when the step in progress began
        self.busy_s = 0.0                          # wall seconds with a step in progress
        self.steps = 0
        self.max_batch = 0                         # most requests in one step
        self.streams = 0                           # the gateway's calls open on it
        self.requests_total = 0
        self.admission = None
        if role == "prefill":
            self.admission = PrefillAdmission(system.max_queued_prefill_tokens,
                                              max_queue_delay_factor=system.max_queue_delay_factor)
            self.admission.seed([(n, profile.prefill_s(n, 0)) for n in WARM_UP_LENGTHS])

    # -- what the gateway's pick reads ----------------------------------------------------
    @property
    def in_flight(self) -> int:
        return self.streams

    def load_key(self):
        s = self.scheduler
        return self.streams, len(s.running) + len(s.waiting), -self.kv.num_free_blocks

    def load_tokens(self) -> int:
        """What the gateway's rule weighs (gateway/registry.py Worker.load_tokens), exact
        here: prefill, prompt tokens queued in its admission; decode, KV tokens in use."""
        if self.role == "prefill":
            return self.admission.queued
        return (self.kv.pool.num_blocks - self.kv.num_free_blocks) * self.kv.block_size

    def attach(self) -> None:
        self.streams += 1
        self.requests_total += 1

    def detach(self) -> None:
        self.streams -= 1

    def stats(self) -> dict:
        return {"address": self.address, "role": self.role, "steps": self.steps,
                "busy_s": self.busy_s, "requests": self.requests_total,
                "max_batch": self.max_batch, "preemptions": self.scheduler.num_preemptions,
                "prefix_hit_tokens": self.kv.prefix_hits,
                "refused": self.admission.refused if self.admission else 0}

    # -- steps ------------------------------------------------------------------------------
    def begin(self) -> float | None:
        """Schedule the next step; its work in seconds, or None when there is nothing to run."""
        out = self.scheduler.schedule()
        if not out and out.preempted:            # it preempted all it held: admit again
            out = self.scheduler.schedule()
        if not out:
            return None
        self.step = out
        self.steps += 1
        return step_cost(self.profile, out, self.fixed) / self.speed

    def end(self) -> SchedulerOutput:
        """The step's model pass is over: the scheduler advances its requests."""
        out, self.step = self.step, None
        self.scheduler.update(out)
        return out
