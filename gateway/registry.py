"""Worker registry: one pool of prefill or decode workers, health-probed, load-ranked.

    WorkerSet (discovery) --on_change--> WorkerPool.add/remove (one gRPC channel each)
    every health_interval_s, per worker:  Health.Check  -> healthy = SERVING
                                          Stats         -> last stats (load, free blocks)
    a call that fails with UNAVAILABLE -> mark_failed(): skipped until the next probe passes
    a probe that times out is load, not death (a kubelet's failureThreshold): a healthy
        worker stays in routing through SLOW_PROBES_TOLERATED timeouts in a row; any other
        probe error (refused, reset) or NOT_SERVING takes it out at once
    hold(seconds): skipped at least that long, whatever the probes say (a fault they do not
        see: a decode worker's KV endpoint)
    a worker whose Stats name another model (KvCompat.model, the KV handshake's model name:
        its model directory's) than the pool's `model` never becomes healthy: logged once
        at ERROR, its last_error says which model it serves, counted by `states()`
    probes unanswered (an RPC error, not NOT_SERVING) for stall_timeout_s -> mark_lost():
        the streams open on it are cut (Worker.streams; the gateway migrates them). A
        draining worker answers NOT_SERVING: it is only skipped and keeps its streams.
    a segment's call on it: attach(segment, tokens) when it opens, detach(segment) when it
        ends; in_flight is the number attached, requests_total the number ever attached,
        open_tokens the sum of their tokens (a Prefill: the prompt tokens it computes; a
        Decode: the prompt tokens whose KV it holds)

Load: `load_key()` = (gateway-side requests in flight, the worker's own running + waiting,
-free KV blocks): in-flight counts are exact and immediate; Stats lag by one probe interval,
so they break ties. `load_tokens()`: the load in tokens the routing rule weighs against the
tokens a cached prefix saves (gateway/affinity.py): `open_tokens` (this gateway's calls,
exact) plus what its Stats report (prefill: queued prompt tokens; decode: KV tokens in use)
beyond the open_tokens it had when those Stats arrived (other gateways' calls, a probe old).
`candidates(exclude, compat)` are the workers a pick may choose; `pick` the least loaded.
"""
from __future__ import annotations

import asyncio
import logging
from typing import Sequence

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client.core import GaugeMetricFamily

from protos.pdserve.v1 import common_pb2
from services import service_names
from services.security import MTLS, channel

from .affinity import choose

log = logging.getLogger(__name__)

RETIRE_TIMEOUT_S = 600.0
SLOW_PROBES_TOLERATED = 2


class Worker:
    def __init__(self, kind: str, address: str, stub_cls, mtls: MTLS | None = None, token: str = ""):
        self.kind = kind
        self.address = address
        # A restarted worker is probed back in within a health interval: gRPC's default
        # reconnect backoff would grow to ~20 s while it was down; at 1 s it still added up to
        # a second to start-up (the gateway's wait for workers that had just come up), so
        # 250 ms, as the launcher's probes (a few connection attempts a second while down)
        self.channel = channel(address, mtls, [
            ("grpc.max_receive_message_length", 64 << 20),
            ("grpc.enable_retries", 0),
            ("grpc.initial_reconnect_backoff_ms", 100),
            ("grpc.min_reconnect_backoff_ms", 100),
            ("grpc.max_reconnect_backoff_ms", 250)], token=token)
        self.stub = stub_cls(self.channel)
        self.health = health_pb2_grpc.HealthStub(self.channel)
        self.healthy = False
        self.stats = None            # last PrefillStats / DecodeStats
        self.requests_total = 0      # calls this gateway opened on it (breaks load ties)
        self.last_error = ""
        self.streams: set = set()    # who holds an open call on it (attach/detach): each is
                                     # cut if it is lost (.cut(worker, reason))
        self.tokens_of: dict = {}    # holder -> (tokens, as its Stats count them) (attach)
        self.open_tokens = 0         # the sum of the first (the work), ...
        self.open_stats_tokens = 0   # ... of the second
        self.stats_open_tokens = 0   # open_stats_tokens when `stats` arrived (load_tokens)
        self.failing_since: float | None = None   # loop time of the first unanswered probe
        self.slow_probes = 0         # probe timeouts in a row
        self.held_until = 0.0        # loop time before which probes may not bring it back
        self.wrong_model = ""        # the model its Stats name, when not its pool's
        self.health_status = ""      # its last Health.Check answer (SERVING, NOT_SERVING:
                                     # draining or warming up; "": none, the probe failed)

    @property
    def in_flight(self) -> int:
        """Calls this gateway has open on it now (one per attached holder)."""
        return len(self.streams)

    def attach(self, holder, tokens: int = 0, stats_tokens: int | None = None) -> None:
        """`holder` (a segment, with .cut(worker, reason)) opened a call on this worker: it
        counts in `in_flight`, `requests_total`, `open_tokens` (its `tokens`: the work) and
        `open_stats_tokens` (as the worker's Stats count it: a queued Prefill's whole
        prompt; default `tokens`) until detach(holder), and is cut if the worker is lost.
        The only place these go up."""
        if holder in self.streams:
            raise RuntimeError(f"{self.kind} worker {self.address}: {holder!r} attached twice")
        self.streams.add(holder)
        self.requests_total += 1
        both = (tokens, tokens if stats_tokens is None else stats_tokens)
        self.tokens_of[holder] = both
        self.open_tokens += both[0]
        self.open_stats_tokens += both[1]

    def detach(self, holder) -> None:
        """`holder`'s call ended (or was cancelled); a holder not attached is ignored."""
        self.streams.discard(holder)
        tokens, stats_tokens = self.tokens_of.pop(holder, (0, 0))
        self.open_tokens -= tokens
        self.open_stats_tokens -= stats_tokens

    def load_key(self):
        s = self.stats
        queued = (s.num_running + s.num_waiting) if s is not None else 0
        free = s.free_kv_blocks if s is not None else 0
        return self.in_flight, queued, -free

    def load_tokens(self) -> int:
        """Its load in tokens (the module docstring): prefill, prompt tokens queued; decode,
        KV tokens in use. This gateway's own calls exactly (open_tokens), plus what its last
        Stats report beyond the calls it had open then, as Stats count them (a queued
        prompt whole, cached part too; other gateways' load, a probe old):
        a call that ended since is not counted again from Stats that still show it."""
        s, reported = self.stats, 0
        if s is not None and self.kind == "prefill":
            reported = s.queued_prefill_tokens
        elif s is not None:
            reported = (s.total_kv_blocks - s.free_kv_blocks) * (s.compat.block_size or 16)
        return self.open_tokens + max(0, reported - self.stats_open_tokens)

    def mark_failed(self, error: str) -> None:
        if self.healthy:
            log.warning("%s worker %s marked unhealthy: %s", self.kind, self.address, error)
        self.healthy = False
        self.last_error = error

    def hold(self, seconds: float, error: str) -> None:
        """Unhealthy for at least `seconds`, even if its probes pass meanwhile."""
        self.mark_failed(error)
        self.held_until = asyncio.get_running_loop().time() + seconds

    def mark_lost(self, error: str) -> None:
        """Stalled or gone: unhealthy, and every stream open on it is cut."""
        if self.streams:
            log.warning("%s worker %s lost (%s): cutting its %d stream(s)", self.kind,
                        self.address, error, len(self.streams))
        self.mark_failed(error)
        for s in list(self.streams):
            s.cut(self, f"{self.kind} worker {self.address} lost: {error}")

    async def close(self) -> None:
        await self.channel.close(grace=None)


class WorkerPool:
    """The workers of one role; kept in sync with a WorkerSet and probed periodically."""

    def __init__(self, kind: str, stub_cls, health_interval_s: float, probe_timeout_s: float,
                 mtls: MTLS | None = None, stall_timeout_s: float = 3.0,
                 retire_timeout_s: float = RETIRE_TIMEOUT_S, model: str = "", token: str = ""):
        self.kind = kind
        self.model = model           # what its workers' Stats must name ("": any)
        self.stall_timeout_s = stall_timeout_s
        self.retire_timeout_s = retire_timeout_s
        self._stub_cls = stub_cls
        self._mtls, self._token = mtls, token     # how its workers' RPCs are reached
        self.health_interval_s = health_interval_s
        self.probe_timeout_s = probe_timeout_s
        self.workers: dict[str, Worker] = {}
        self._task: asyncio.Task | None = None
        self._retiring: dict[Worker, asyncio.Task] = {}    # removed, requests still on them
        self._service = service_names.BY_ROLE[kind]

    async def on_change(self, added: list[str], removed: list[str]) -> None:
        for a in removed:
            w = self.workers.pop(a, None)
            if w is not None:
                # Out of routing now; its channel stays open for the requests still on it (a
                # worker that left DNS is usually draining them) and closes once they end.
                self._retiring[w] = asyncio.create_task(self._retire(w), name=f"retire-{a}")
        new = [self.workers.setdefault(a, Worker(self.kind, a, self._stub_cls, self._mtls, self._token)) for a in added]
        await asyncio.gather(*(self.probe(w) for w in new))

    async def start(self) -> None:
        await self.probe_all()
        self._task = asyncio.create_task(self._run(), name=f"health-{self.kind}")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None
        for t in self._retiring.values():
            t.cancel()
        await asyncio.gather(*self._retiring.values(), return_exceptions=True)
        await asyncio.gather(*(w.close() for w in [*self.workers.values(), *self._retiring]),
                             return_exceptions=True)
        self.workers.clear()
        self._retiring.clear()

    async def _retire(self, w: Worker) -> None:
        """Close a removed worker's channel once no request is on it (each has a deadline;
        retire_timeout_s bounds the wait regardless: streams still open then are cut, so the
        gateway migrates them instead of ending them as cancelled)."""
        deadline = asyncio.get_running_loop().time() + self.retire_timeout_s
        while w.in_flight and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(self.health_interval_s)
        if w.streams:
            w.mark_lost(f"removed from discovery {self.retire_timeout_s:g}s ago")
        self._retiring.pop(w, None)
        await w.close()

    async def until_healthy(self, timeout_s: float, interval_s: float = 0.1) -> bool:
        """At start (`--wait-for-workers-s`): probe the workers not yet healthy every
        interval_s until all are (True) or timeout_s passes (False)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while not all(w.healthy for w in self.workers.values()):
            if loop.time() >= deadline:
                return False
            await asyncio.sleep(min(interval_s, max(0.0, deadline - loop.time())))
            await asyncio.gather(*(self.probe(w) for w in list(self.workers.values()) if not w.healthy))
        return True

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.health_interval_s)
            await self.probe_all()

    async def probe_all(self) -> None:
        await asyncio.gather(*(self.probe(w) for w in list(self.workers.values())))

    async def probe(self, w: Worker) -> None:
        """Health.Check (the service's name, "" if the server does not know it), then Stats."""
        was = w.healthy
        now = asyncio.get_running_loop().time()
        answered = slow = False
        w.health_status = ""
        try:
            status = await self._check(w)
            answered = True
            healthy = status == health_pb2.HealthCheckResponse.SERVING
            w.health_status = health_pb2.HealthCheckResponse.ServingStatus.Name(status)
            w.last_error = "" if healthy else f"health status {w.health_status}"
            if healthy:
                stats = await w.stub.Stats(common_pb2.StatsRequest(),
                                           timeout=self.probe_timeout_s)
                healthy = self._check_model(w, stats)
                if healthy:
                    w.stats, w.stats_open_tokens = stats, w.open_stats_tokens
        except grpc.aio.AioRpcError as e:
            healthy = False
            slow = e.code() == grpc.StatusCode.DEADLINE_EXCEEDED
            w.last_error = f"{e.code().name}: {e.details()}"
        except asyncio.CancelledError:
            raise
        except Exception as e:  # never let one bad worker stop the loop
            healthy = False
            w.last_error = f"{type(e).__name__}: {e}"
        w.slow_probes = w.slow_probes + 1 if slow else 0
        if slow and was and w.slow_probes <= SLOW_PROBES_TOLERATED:
            healthy = True
        w.healthy = healthy and asyncio.get_running_loop().time() >= w.held_until
        if answered:
            w.failing_since = None
        else:
            w.failing_since = now if w.failing_since is None else w.failing_since
            if now - w.failing_since >= self.stall_timeout_s:
                w.mark_lost(w.last_error)
        if healthy and not was:
            log.info("%s worker %s is healthy", self.kind, w.address)
        elif was and not healthy:
            log.warning("%s worker %s is unhealthy: %s", self.kind, w.address, w.last_error)

    def _check_model(self, w: Worker, stats) -> bool:
        """Whether `stats` name this pool's model (or none: an older worker); if not, the
        worker's last_error says which it serves."""
        served = stats.compat.model if stats is not None and stats.HasField("compat") else ""
        wrong = served if self.model and served and served != self.model else ""
        if wrong and wrong != w.wrong_model:
            log.error("%s worker %s serves model %r, but this pool is model %r's: kept out "
                      "of routing (check the pool's addresses or DNS name)", self.kind,
                      w.address, wrong, self.model)
        w.wrong_model = wrong
        if wrong:
            w.last_error = f"serves model {wrong!r}, not {self.model!r}"
        return not wrong

    def states(self) -> dict[str, int]:
        """Workers by state: healthy, wrong_model, unhealthy."""
        out = dict.fromkeys(("healthy", "wrong_model", "unhealthy"), 0)
        for w in self.workers.values():
            out["healthy" if w.healthy else "wrong_model" if w.wrong_model else "unhealthy"] += 1
        return out

    def retiring(self) -> list[Worker]:
        """Workers removed from discovery that still have calls on them (closed once none)."""
        return list(self._retiring)

    async def _check(self, w: Worker) -> int:
        try:
            r = await w.health.Check(health_pb2.HealthCheckRequest(service=self._service),
                                     timeout=self.probe_timeout_s)
        except grpc.aio.AioRpcError as e:
            if e.code() != grpc.StatusCode.NOT_FOUND:
                raise
            r = await w.health.Check(health_pb2.HealthCheckRequest(service=""),
                                     timeout=self.probe_timeout_s)
        return r.status

    def healthy(self, exclude: Sequence[str] = ()) -> list[Worker]:
        return [w for w in self.workers.values() if w.healthy and w.address not in exclude]

    def candidates(self, exclude: Sequence[str] = (), compat=None) -> list[Worker]:
        """The healthy workers not excluded; with `compat` (a KvCompat), only those whose KV
        layout matches it, or whose Stats have not arrived yet (they would refuse a mismatch
        themselves)."""
        cands = self.healthy(exclude)
        if compat is not None:
            cands = [w for w in cands if w.stats is None or not w.stats.HasField("compat")
                     or w.stats.compat == compat]
        return cands

    def pick(self, exclude: Sequence[str] = (), compat=None) -> Worker | None:
        """The least-loaded of `candidates` (None: none)."""
        got = choose(self.candidates(exclude, compat))
        return got.worker if got is not None else None

    def block_size(self, default: int = 16) -> int:
        for w in self.workers.values():
            if w.stats is not None and w.stats.compat.block_size:
                return w.stats.compat.block_size
        return default


class PoolStates:
    """A Prometheus collector: pdserve:gateway_workers{pool, state}, each pool's workers by
    state (`WorkerPool.states`); wrong_model > 0 means a pool lists another model's worker."""

    def __init__(self, pools: Sequence[WorkerPool]):
        self.pools = pools

    def collect(self):
        fam = GaugeMetricFamily("pdserve:gateway_workers", "Workers the gateway knows, by "
                                "pool and state", labels=("role", "pool", "state"))
        for pool in self.pools:
            for state, n in pool.states().items():
                fam.add_metric(("gateway", pool.kind, state), n)
        yield fam
