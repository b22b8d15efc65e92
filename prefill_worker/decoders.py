"""The decode workers a prefill worker may push KV to, and the KV endpoints they announce.

A Prefill names its destination's KV endpoint, copied by the gateway from the decode
worker's KvReady. The prefill worker does not take that address on trust: it connects only
to endpoints that decode workers it knows (--decode host:port,..., --decode-dns name:port or
--decode-file PATH, one address per line) announce in their Stats (`kv_endpoint`). An endpoint not (yet) known triggers a refresh
(at most one every `min_refresh_s`, shared by concurrent callers) before the Prefill is
refused: at once when the last one is older, else once that interval has passed (a refresh
a moment before a new decode worker was listed, as a cluster's DNS lists pods once ready,
refused its first Prefills: seen as 500s while a decode Deployment scaled up under load).
A decode worker still listed that misses one Stats (busy, restarting) keeps the endpoint it
announced last; one no longer listed keeps it for `unlisted_grace_s` (30 s), then loses it: a
cluster's DNS drops a pod as it starts terminating, while the gateway may still be sending
it streams (seen as 500s when a decode Deployment scaled down under load). The listing is
also re-read every `interval_s` in the background (`start`): a grace only covers a worker
this one has seen listed, and a prefill worker whose first Prefill came after a decode pod
had left the DNS, still in the gateway's lagging listing, refused it (CI, the same scale-down).
With neither option set, nothing is known and every destination is refused.
"""
from __future__ import annotations

import asyncio
import logging
import socket
import time

import grpc

from protos.pdserve.v1 import common_pb2, decode_pb2_grpc
from services.address_file import read_addresses
from services.security import MTLS, channel

log = logging.getLogger(__name__)


async def resolve(addresses: str, dns: str, file: str = "") -> list[str]:
    """host:port of every decode worker: the static list, the file's lines as it reads
    now, or every address of the name."""
    if file:
        try:
            return read_addresses(file)
        except (OSError, ValueError) as e:
            log.warning("cannot read decode workers from %s: %s", file, e)
            return []
    if addresses:
        return [a.strip() for a in addresses.split(",") if a.strip()]
    if not dns:
        return []
    host, _, port = dns.rpartition(":")
    try:
        infos = await asyncio.to_thread(socket.getaddrinfo, host, int(port), type=socket.SOCK_STREAM)
    except (OSError, ValueError) as e:
        log.warning("cannot resolve decode workers %s: %s", dns, e)
        return []
    return sorted({f"[{i[4][0]}]:{i[4][1]}" if ":" in i[4][0] else f"{i[4][0]}:{i[4][1]}"
                   for i in infos})


class KnownDecoders:
    def __init__(self, addresses: str, dns: str, mtls: MTLS | None, rpc_timeout_s: float = 2.0,
                 min_refresh_s: float = 1.0, token: str = "", file: str = "",
                 unlisted_grace_s: float = 30.0):
        self.addresses, self.dns, self.mtls, self.token = addresses, dns, mtls, token
        self.file = file
        self.rpc_timeout_s, self.min_refresh_s = rpc_timeout_s, min_refresh_s
        self.unlisted_grace_s = unlisted_grace_s
        self.endpoints: set[str] = set()
        self._by_address: dict[str, str] = {}     # listed decode worker -> its endpoint
        self._unlisted: dict[str, tuple[str, float]] = {}   # gone from the listing -> (endpoint, when)
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._refreshed = float("-inf")
        self._lock = asyncio.Lock()
        self._watch: asyncio.Task | None = None

    def start(self, interval_s: float) -> None:
        """Refresh now and every `interval_s` (0: only when an endpoint is not known)."""
        if interval_s > 0 and (self.addresses or self.dns or self.file):
            self._watch = asyncio.create_task(self._watch_loop(interval_s))

    async def _watch_loop(self, interval_s: float) -> None:
        while True:
            async with self._lock:
                try:
                    await self._refresh()
                except Exception:                   # next time; a Prefill refreshes too
                    log.exception("refreshing the decode workers failed")
            await asyncio.sleep(interval_s)

    async def allowed(self, endpoint: str) -> bool:
        """Whether a known decode worker announces `endpoint` (refreshing, within at most
        `min_refresh_s`, if needed)."""
        if endpoint in self.endpoints:
            return True
        async with self._lock:
            if endpoint not in self.endpoints:
                wait = self.min_refresh_s - (time.monotonic() - self._refreshed)
                if wait > 0:
                    await asyncio.sleep(wait)
                if endpoint not in self.endpoints:
                    await self._refresh()
        return endpoint in self.endpoints

    async def _refresh(self) -> None:
        targets = await resolve(self.addresses, self.dns, self.file)
        for gone in set(self._channels) - set(targets):
            await self._channels.pop(gone).close()

        async def announced(address: str) -> str:
            ch = self._channels.get(address)
            if ch is None:
                ch = self._channels[address] = channel(address, self.mtls, token=self.token)
            try:
                st = await decode_pb2_grpc.DecodeWorkerStub(ch).Stats(
                    common_pb2.StatsRequest(), timeout=self.rpc_timeout_s)
                return st.kv_endpoint
            except grpc.RpcError as e:
                log.info("decode worker %s did not answer Stats: %s", address, e.code().name)
                # a fresh channel next time: this one may sit in reconnect backoff (up to
                # minutes) while a decode worker that starts now would answer at once
                await self._channels.pop(address).close()
                return self._by_address.get(address, "")     # its last, while it is listed

        found = await asyncio.gather(*(announced(a) for a in targets))
        now = time.monotonic()
        for a, e in self._by_address.items():
            if a not in targets:
                self._unlisted.setdefault(a, (e, now))
        self._by_address = {a: e for a, e in zip(targets, found) if e}
        self._unlisted = {a: (e, t) for a, (e, t) in self._unlisted.items()
                          if a not in targets and now - t < self.unlisted_grace_s}
        endpoints = set(self._by_address.values()) | {e for e, _ in self._unlisted.values()}
        if endpoints != self.endpoints or self._refreshed == float("-inf"):
            log.info("known decode KV endpoints: %s", sorted(endpoints) or "none")
        self.endpoints, self._refreshed = endpoints, now

    async def close(self) -> None:
        if self._watch is not None:
            self._watch.cancel()
            await asyncio.gather(self._watch, return_exceptions=True)
        for ch in self._channels.values():
            await ch.close()
        self._channels.clear()
