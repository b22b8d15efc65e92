"""Token-budget scheduler (CPU only; no model, no tensors).

Each step hands out at most `max_num_batched_tokens` tokens. Running requests go first (a
decode needs 1 token, a partially prefilled prompt gets its next chunk), then waiting requests
are admitted in arrival order while budget, sequence slots and blocks last. Prefill chunking,
prefix-cache hits and remote KV are all just "fewer tokens to compute". When blocks run out
for a running request, the most recently admitted running request is preempted: its blocks
are freed and it is recomputed later from scratch (its generated tokens are kept).

In-batch prefix sharing (with prefix caching): a waiting request whose next uncached block is
one a running request has yet to compute (a full prompt block past its computed tokens,
this step's chunk included) waits, keeping its place, while requests behind it are admitted;
once the leader's chunk is cached it is a hit. Two requests with one new shared prefix, sent
together, so compute it once, not once each (SGLang's scheduler deprioritizes such requests
within a batch the same way). A follower never waits on a request that is not running.

Queues: `waiting` (deque, FIFO; preempted requests go back to its front), `running` (list, in
admission order), `remote` (dict: requests whose KV is being filled from another process).
"""
from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from .config import SchedulerConfig
from .kv_cache_manager import KVCacheManager, cdiv
from .request import Request, RequestStatus


@dataclass
class ScheduledRequest:
    request: Request
    num_new_tokens: int              # known tokens + speculative ones
    start: int                       # position of the first scheduled token
    spec_token_ids: list[int] = field(default_factory=list)   # proposed, after the known ones

    @property
    def samples(self) -> bool:
        """True when this chunk reaches the last known token: its logits give the next one."""
        return self.start + self.num_new_tokens - len(self.spec_token_ids) == self.request.num_tokens


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def num_prompt_tokens(self) -> int:
        """The prompt tokens this step runs through the model: of each request's scheduled
        positions [start, start + n), those below its prompt length (prefix hits, KV received
        or revived lie before `start`; generated and speculative tokens after the prompt)."""
        return sum(max(0, min(s.start + s.num_new_tokens, s.request.num_prompt_tokens) - s.start)
                   for s in self.scheduled)

    def __bool__(self):
        return bool(self.scheduled)


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv: KVCacheManager):
        self.config = config
        self.kv = kv
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.remote: dict[str, Request] = {}
        self.num_preemptions = 0

    # -- queues -------------------------------------------------------------------------
    def add(self, req: Request) -> None:
        req.status = RequestStatus.WAITING
        self.waiting.append(req)

    def reserve_remote(self, req: Request) -> bool:
        """Decode side: reserve blocks for the whole prompt, reusing local prefix hits; the
        rest is filled by a KV transfer. False (nothing reserved) when max_num_seqs requests
        are running or reserved, or when the reservation would leave fewer free blocks than
        the watermark the running requests grow into: a refusal the caller can retry
        elsewhere beats preempting and recomputing a running request later."""
        if len(self.running) + len(self.remote) >= self.config.max_num_seqs:
            return False
        hits, n_hit = self.kv.get_computed_blocks(req, leave_one=False)
        req.num_computed_tokens = 0
        need = cdiv(req.num_tokens, self.kv.block_size) - len(hits)
        need += sum(1 for b in hits if b.ref_cnt == 0)        # cached but free: revived
        if self.kv.num_free_blocks - need < self.watermark_blocks():
            return False
        if not self.kv.allocate_slots(req, req.num_tokens - n_hit, hits):
            return False
        req.num_cached_tokens = n_hit
        req.status = RequestStatus.WAITING_FOR_REMOTE_KV
        self.remote[req.request_id] = req
        return True

    def watermark_blocks(self) -> int:
        """Free blocks kept for running requests to grow into: one per request running or
        reserved (its next block), and at least 1% of the cache."""
        return max(len(self.running) + len(self.remote), cdiv(self.kv.pool.num_blocks, 100))

    def remote_ready(self, req: Request) -> None:
        """The transferred KV covers the whole prompt: cache it and start decoding."""
        del self.remote[req.request_id]
        req.num_computed_tokens = req.num_prompt_tokens
        self.kv.cache_blocks(req, req.num_computed_tokens)
        req.status = RequestStatus.RUNNING
        self.running.append(req)

    def finish(self, req: Request) -> None:
        """A finished request leaves the running batch. Its blocks are freed, except a
        prefill-only request's: their KV is being shipped until `release`."""
        if req.prefill_only:
            self.running.remove(req)
        else:
            self.remove(req)

    def release(self, req: Request) -> None:
        """Free the blocks of a finished prefill-only request (its KV has been shipped)."""
        self.kv.free(req)

    def accept_speculative(self, req: Request, num_computed: int) -> None:
        """After verification: the last known token and the accepted drafts have their KV in
        the cache (`num_computed` tokens); the rejected drafts' slots are given back."""
        req.num_computed_tokens = num_computed
        self.kv.cache_blocks(req, num_computed)
        self.kv.trim(req, num_computed)

    def remove(self, req: Request) -> None:
        """Take a request out of every queue and free its blocks (finish or abort)."""
        if req in self.running:
            self.running.remove(req)
        elif req.request_id in self.remote:
            del self.remote[req.request_id]
        elif req in self.waiting:
            self.waiting.remove(req)
        self.kv.free(req)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    @property
    def queued_prefill_tokens(self) -> int:
        return sum(r.num_tokens - r.num_computed_tokens for r in self.waiting) + sum(
            r.num_tokens - r.num_computed_tokens - 1 for r in self.running
            if r.num_computed_tokens < r.num_tokens - 1)

    # -- one step -----------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            n = min(req.num_tokens - req.num_computed_tokens, budget)
            # speculative tokens (engine/spec_decode.py's proposals) fit the budget and
            # the free blocks, or are dropped: never a preemption for a guess
            spec = req.spec_token_ids[:budget - n]
            if spec and not self.kv.allocate_slots(req, n + len(spec)):
                spec = []
            req.spec_token_ids = spec
            if spec or self._allocate_or_preempt(req, n, out):
                out.scheduled.append(ScheduledRequest(req, n + len(spec), req.num_computed_tokens, spec))
                budget -= n + len(spec)
                i += 1
        if out.preempted:
            return _stamped(out)
        deferred, pending = [], None     # pending: the running prompts' uncomputed blocks
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            req = self.waiting[0]
            hits, n_hit = self.kv.get_computed_blocks(req)
            nxt = self._next_block_hash(req, len(hits))
            if nxt is not None:
                if pending is None:
                    pending = self._pending_blocks()
                if nxt in pending:               # a running request computes it: wait
                    deferred.append(self.waiting.popleft())
                    continue
            n = req.num_tokens - n_hit
            if n > budget:
                if not self.config.enable_chunked_prefill:
                    break
                n = budget
            if not self.kv.allocate_slots(req, n, hits):
                break
            self.waiting.popleft()
            if pending is not None:
                pending |= self._prompt_blocks(req, n_hit)
            if req.num_cached_tokens < 0:
                req.num_cached_tokens = n_hit
            req.num_computed_tokens = n_hit
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            out.scheduled.append(ScheduledRequest(req, n, n_hit))
            budget -= n
        self.waiting.extendleft(reversed(deferred))
        return _stamped(out)

    def _next_block_hash(self, req: Request, n_hit_blocks: int) -> bytes | None:
        """The hash of the first full prompt block past the request's prefix hit (None: no
        prefix caching for it, or no full block left before its last token)."""
        if not self.kv.uses_prefix_cache(req):
            return None
        n_blocks = (req.num_tokens - 1) // self.kv.block_size
        if n_hit_blocks >= n_blocks:
            return None
        return self.kv.block_hashes(req, n_blocks)[n_hit_blocks]

    def _prompt_blocks(self, req: Request, computed: int) -> set[bytes]:
        """Hashes of the request's full prompt blocks from the one holding token `computed`
        on: blocks it has yet to compute (or computes this step)."""
        n_blocks = req.num_prompt_tokens // self.kv.block_size
        first = computed // self.kv.block_size
        if first >= n_blocks:
            return set()
        return set(self.kv.block_hashes(req, n_blocks)[first:])

    def _pending_blocks(self) -> set[bytes]:
        out: set[bytes] = set()
        for r in self.running:
            out |= self._prompt_blocks(r, r.num_computed_tokens)
        return out

    def _allocate_or_preempt(self, req: Request, n: int, out: SchedulerOutput) -> bool:
        """Blocks for `n` more tokens of a running request, preempting the most recently
        admitted requests until they fit; False if `req` itself had to go."""
        while not self.kv.allocate_slots(req, n):
            victim = self.running.pop()
            self._preempt(victim)
            out.preempted.append(victim)
            if victim is req:
                return False
        return True

    def _preempt(self, req: Request) -> None:
        self.kv.free(req)
        req.spec_token_ids = []
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        req.status = RequestStatus.PREEMPTED
        self.num_preemptions += 1
        self.waiting.appendleft(req)

    def update(self, out: SchedulerOutput) -> None:
        """After the model ran: advance computed counts and cache newly full blocks."""
        for s in out.scheduled:
            # speculative tokens count once verified (accept_speculative)
            s.request.num_computed_tokens = s.start + s.num_new_tokens - len(s.spec_token_ids)
            self.kv.cache_blocks(s.request, s.request.num_computed_tokens)


def _stamped(out: SchedulerOutput) -> SchedulerOutput:
    """Each request's first scheduling time (TTFT's queue part), once."""
    now = time.monotonic()
    for s in out.scheduled:
        if s.request.first_scheduled_time is None:
            s.request.first_scheduled_time = now
    return out
