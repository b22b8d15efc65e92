"""Which workers serve a segment: a decode worker, then a prefill worker that can fill it.

    decode:   least loaded healthy worker, or the prefix-affine one (the worker that
              recently served the prompt's first blocks) while it has at most
              `decode_slack` (--decode-affinity-slack, 2; --affinity-slack if smaller) more
              requests in flight than the least loaded one: affinity is a preference, not
              a pin. A decode worker's load
              sets the token rate of every stream on it and its share of a fault, while a
              prefix it holds saves only the KV transfer of those blocks; so moderate load
              with one shared prefix (a chat template's system prompt) spreads evenly
    prefill:  least loaded, or the prefix-affine one while it is at most `slack` requests,
              or at most `slack_ratio` times, busier than the least loaded one (a prefix
              hit there saves its compute), among workers whose KV layout (KvCompat) matches
              the decode worker's reservation; none matching while some are healthy ->
              FAILED_PRECONDITION

Affinity is the gateway's own bookkeeping (affinity.PrefixAffinity): prompt block hashes ->
the worker it sent them to; a worker's actual prefix cache is not consulted.
"""
from __future__ import annotations

import grpc
from google.protobuf.json_format import MessageToDict

from protos.pdserve.v1 import decode_pb2

from .affinity import PrefixAffinity, decode_bounds
from .prefix_index import PrefixIndex
from .registry import Worker, WorkerPool
from .request import GatewayError


class Router:
    peer_fetch_min_blocks = 0    # --peer-fetch-min-blocks, 0: --peer-fetch off (peer_prefix.py)

    def __init__(self, prefill: WorkerPool, decode: WorkerPool, slack: int, slack_ratio: float,
                 decode_slack: int = 2):
        self.prefill, self.decode = prefill, decode
        self.slack, self.slack_ratio = slack, slack_ratio
        self.decode_slack = decode_slack
        self._affinity = {"prefill": PrefixAffinity(), "decode": PrefixAffinity()}
        self.index = PrefixIndex()   # the workers' KV events, by worker address (prefix_index.py)

    def hashes(self, pool: WorkerPool, prompt: list[int], block_size: int = 0) -> list[bytes]:
        """The prompt's block hashes for `pool`'s affinity (its workers' block size)."""
        return self._affinity[pool.kind].block_hashes(prompt, block_size or pool.block_size())

    def pick_decode(self, tried: set[str], hashes: list[bytes]) -> Worker | None:
        return self.decode.pick(tried, self._affinity["decode"], hashes,
                                *decode_bounds(self.slack, self.decode_slack))

    def pick_prefill(self, kv: decode_pb2.KvReady, exclude: list[str],
                     hashes: list[bytes]) -> Worker:
        """A prefill worker for the reservation `kv`; raises GatewayError when none fits."""
        w = self.prefill.pick(exclude, self._affinity["prefill"], hashes, self.slack,
                              self.slack_ratio, compat=kv.compat)
        if w is not None:
            return w
        if self.prefill.pick(exclude) is not None:       # healthy, but none can fill this KV
            raise GatewayError(grpc.StatusCode.FAILED_PRECONDITION,
                               f"no prefill worker's KV layout matches decode worker "
                               f"{kv.decode_worker_id or kv.kv_endpoint}: "
                               f"{MessageToDict(kv.compat)}")
        raise no_worker(self.prefill)

    def cached_on(self, w: Worker, hashes: list[bytes]) -> int:
        """Prompt tokens the gateway last sent to `w` (full blocks of `hashes`): its guess
        at w's prefix-cache hit for the prompt."""
        pool = self.decode if w.kind == "decode" else self.prefill
        return self._affinity[w.kind].held(hashes, w.address) * pool.block_size()

    def served(self, w: Worker, hashes: list[bytes]) -> None:
        """`w` took a prompt with these block hashes: prefer it for the same prefix."""
        self._affinity[w.kind].record(hashes, w.address)


def no_worker(pool: WorkerPool) -> GatewayError:
    known = ", ".join(f"{w.address} ({w.last_error or 'not ready'})"
                      for w in pool.workers.values()) or "none discovered"
    return GatewayError(grpc.StatusCode.UNAVAILABLE, f"no healthy {pool.kind} worker (known: {known})")
