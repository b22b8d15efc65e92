"""Which workers serve a segment: a decode worker, then a prefill worker that can fill it.

Both picks run gateway/affinity.py's rule (its docstring has the formula and its constants):
the work a worker's cached prefix saves against its load, in tokens, within slack bounds.

    index     `Router.index`: the gateway's one PrefixIndex for this model, keyed by worker
              address, fed by every prefill and decode worker's own KV events (the KvEvents
              subscriber, gateway/kv_events_client.py): what the workers really hold
    hashes    `Router.hashes(pool, prompt)`: the engine's chained block hashes of the prompt
              at the pool's block size, as far as some worker holds them (at most
              MAX_HASHED_BLOCKS)
    decode    the rule over the healthy decode workers not yet tried, saved = the KV transfer
              (or local compute) its prefix cache spares, load = its KV tokens in use; slack
              `decode_bounds` (--decode-affinity-slack 2, no ratio): a decode worker's load
              sets the token rate of every stream on it, so a prefix there is a mild
              preference
    prefill   the rule over the healthy prefill workers whose KV layout (KvCompat) matches
              the decode worker's reservation, saved = the compute its prefix cache spares,
              load = its queued prompt tokens; slack --affinity-slack 16 / --affinity-slack-
              ratio 1.5; none matching while some are healthy -> FAILED_PRECONDITION.
              A worker's match runs on through the blocks this gateway's open Prefill calls
              to it are computing (`Router.inflight`, gateway/inflight.py), as device hits:
              prompts sharing a new prefix, sent together, meet on one worker, which
              computes it once (`prefill_hashes`, `open_prefill`, `close_prefill`)
    cached_on `Router.cached_on(w, hashes)`: prompt tokens the index says w holds (device +
              host + disk blocks x block size): gateway/placement.py's input for the
              disaggregation rule
    --prefix-routing none: both picks take the least-loaded worker (the index still feeds
              cached_on)

Each pick counts `pdserve:route_decisions_total{pool,reason}` (affinity.REASONS) and the
chosen worker's matched blocks in `pdserve:route_prefix_hit_blocks_total{pool}`.
"""
from __future__ import annotations

import grpc
from google.protobuf.json_format import MessageToDict
from prometheus_client import Counter

from protos.pdserve.v1 import decode_pb2
from services.metrics import PREFIX

from engine.block_hash import prefix_block_hashes

from .affinity import (MAX_HASHED_BLOCKS, REASONS, Weights, choose, decode_bounds,
                       decode_weights, leading_hashes, with_in_flight)
from .inflight import InFlight
from .prefix_index import PrefixIndex
from .registry import Worker, WorkerPool
from .request import GatewayError

PREFIX_ROUTING = ("events", "none")


class RouteMetrics:
    """pdserve:route_decisions_total{pool,reason}, pdserve:route_prefix_hit_blocks_total{pool}."""

    def __init__(self, registry):
        self.decisions = Counter(PREFIX + "route_decisions", "Worker picks, by pool and why "
                                 "(gateway/affinity.py)", ("role", "pool", "reason"),
                                 registry=registry)
        self.hit_blocks = Counter(PREFIX + "route_prefix_hit_blocks", "Prompt blocks the "
                                  "picked worker held (any tier), by pool", ("role", "pool"),
                                  registry=registry)
        for pool in ("prefill", "decode"):
            self.hit_blocks.labels("gateway", pool)
            for reason in REASONS:
                self.decisions.labels("gateway", pool, reason)

    def observe(self, pool: str, reason: str, blocks: int) -> None:
        self.decisions.labels("gateway", pool, reason).inc()
        if blocks:
            self.hit_blocks.labels("gateway", pool).inc(blocks)


class Router:
    peer_fetch_min_blocks = 0    # --peer-fetch-min-blocks, 0: --peer-fetch off (peer_prefix.py)

    def __init__(self, prefill: WorkerPool, decode: WorkerPool, slack: int, slack_ratio: float,
                 decode_slack: int = 2, prefix_routing: str = "events",
                 weights: Weights = Weights(), metrics=None):
        """`metrics`: the gateway's Metrics (its registry gets RouteMetrics), or None."""
        if prefix_routing not in PREFIX_ROUTING:
            raise ValueError(f"prefix_routing must be one of {PREFIX_ROUTING}, got {prefix_routing!r}")
        self.prefill, self.decode = prefill, decode
        self.slack, self.slack_ratio = slack, slack_ratio
        self.decode_slack = decode_slack
        self.prefix_routing, self.weights = prefix_routing, weights
        self.index = PrefixIndex()   # the workers' KV events, by worker address (prefix_index.py)
        self.inflight = InFlight()   # blocks this gateway's open Prefill calls compute
        self.metrics = RouteMetrics(metrics.registry) if metrics is not None else None

    def hashes(self, pool: WorkerPool, prompt: list[int], block_size: int = 0) -> list[bytes]:
        """The prompt's leading block hashes some worker holds (`pool`'s block size)."""
        return leading_hashes(self.index, prompt, block_size or pool.block_size(),
                              MAX_HASHED_BLOCKS)

    def prefill_hashes(self, prompt: list[int], block_size: int) -> list[bytes]:
        """All the prompt's full block hashes (at most MAX_HASHED_BLOCKS): a Prefill call
        registers them in flight, so they cannot stop where the index's knowledge does."""
        return prefix_block_hashes(prompt, block_size, MAX_HASHED_BLOCKS)

    def open_prefill(self, w: Worker, hashes: list[bytes]):
        """A Prefill call to `w` for these blocks opened: its ticket for close_prefill."""
        return self.inflight.add(w.address, hashes)

    def close_prefill(self, ticket) -> None:
        self.inflight.remove(ticket)

    def prefill_hit_tokens(self, w: Worker, hashes: list[bytes], block_size: int) -> int:
        """Prompt tokens prefill worker `w` need not compute: its index match, in any tier,
        continued by its in-flight blocks."""
        return self._prefill_hits(w, hashes).total * block_size

    def _prefill_hits(self, w: Worker, hashes: list[bytes]):
        return with_in_flight(self.index.match(hashes, w.address), hashes,
                              lambda h: self.inflight.holds(w.address, h))

    def pick_decode(self, tried: set[str], hashes: list[bytes]) -> Worker | None:
        return self._pick(self.decode, self.decode.candidates(tried), hashes,
                          *decode_bounds(self.slack, self.decode_slack),
                          weights=decode_weights(self.weights))

    def pick_prefill(self, kv: decode_pb2.KvReady, exclude: list[str],
                     hashes: list[bytes]) -> Worker:
        """A prefill worker for the reservation `kv`; raises GatewayError when none fits."""
        w = self._pick(self.prefill, self.prefill.candidates(exclude, kv.compat), hashes,
                       self.slack, self.slack_ratio, kv.compat.block_size, in_flight=True)
        if w is not None:
            return w
        if self.prefill.pick(exclude) is not None:       # healthy, but none can fill this KV
            raise GatewayError(grpc.StatusCode.FAILED_PRECONDITION,
                               f"no prefill worker's KV layout matches decode worker "
                               f"{kv.decode_worker_id or kv.kv_endpoint}: "
                               f"{MessageToDict(kv.compat)}")
        raise no_worker(self.prefill)

    def _pick(self, pool: WorkerPool, cands: list[Worker], hashes: list[bytes], slack: int,
              slack_ratio: float, block_size: int = 0, in_flight: bool = False,
              weights: Weights | None = None) -> Worker | None:
        hits = None
        if self.prefix_routing == "events":
            hits = {w.address: self._prefill_hits(w, hashes) if in_flight
                    else self.index.match(hashes, w.address) for w in cands}
        got = choose(cands, hits, block_size or pool.block_size(), weights or self.weights,
                     slack, slack_ratio)
        if got is None:
            return None
        if self.metrics is not None:
            self.metrics.observe(pool.kind, got.reason, got.hits.total)
        return got.worker

    def cached_on(self, w: Worker, hashes: list[bytes]) -> int:
        """Prompt tokens `w` holds, as the index knows from its KV events (its leading blocks
        in any tier x its pool's block size)."""
        pool = self.decode if w.kind == "decode" else self.prefill
        return self.index.match(hashes, w.address).total * pool.block_size()


def no_worker(pool: WorkerPool) -> GatewayError:
    known = ", ".join(f"{w.address} ({w.last_error or 'not ready'})"
                      for w in pool.workers.values()) or "none discovered"
    return GatewayError(grpc.StatusCode.UNAVAILABLE, f"no healthy {pool.kind} worker (known: {known})")
