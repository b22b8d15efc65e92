"""prefill_worker/decoders.py: which KV endpoints a prefill worker pushes to. A decode worker
listed only after a refresh (a cluster's DNS lists pods once ready) is found by the next
refresh, which a Prefill for it waits for (at most min_refresh_s) instead of being refused;
a listed decode worker that misses one Stats keeps its endpoint; an unlisted one loses it;
an endpoint nobody announces is still refused."""
from __future__ import annotations

import asyncio
import time

import grpc

from prefill_worker import decoders as D


class _Down(grpc.RpcError):
    def code(self):
        return grpc.StatusCode.UNAVAILABLE


def _fake(monkeypatch, listed: list[str], answers: dict[str, str]):
    """The decode workers listed (a mutable list) and each one's Stats answer (its endpoint;
    missing: UNAVAILABLE)."""
    async def resolve(addresses, dns, file=""):
        return list(listed)

    class Stub:
        def __init__(self, ch):
            self.address = ch

        async def Stats(self, req, timeout):
            if self.address not in answers:
                raise _Down()
            return type("S", (), {"kv_endpoint": answers[self.address]})()

    class Channel(str):
        async def close(self):
            pass

    monkeypatch.setattr(D, "resolve", resolve)
    monkeypatch.setattr(D.decode_pb2_grpc, "DecodeWorkerStub", Stub)
    monkeypatch.setattr(D, "channel", lambda address, mtls, token="": Channel(address))


def test_a_decode_worker_listed_after_a_refresh_is_found_by_the_next(monkeypatch):
    listed, answers = ["d0:1"], {"d0:1": "ucx://d0:9", "d1:1": "ucx://d1:9"}
    _fake(monkeypatch, listed, answers)
    known = D.KnownDecoders("", "decode:1", None, min_refresh_s=0.3)

    async def main():
        assert await known.allowed("ucx://d0:9")          # the first refresh: d0 only
        listed.append("d1:1")                              # d1 is listed a moment later
        t0 = time.monotonic()
        assert await known.allowed("ucx://d1:9")          # waits for the next refresh
        waited = time.monotonic() - t0
        assert waited <= 0.3 + 0.2, waited
        t0 = time.monotonic()
        assert not await known.allowed("ucx://nobody:9")   # still refused, within the interval
        assert time.monotonic() - t0 <= 0.3 + 0.2
    asyncio.run(main())


def test_a_listed_decode_worker_missing_one_stats_keeps_its_endpoint(monkeypatch):
    listed, answers = ["d0:1", "d1:1"], {"d0:1": "ucx://d0:9", "d1:1": "ucx://d1:9"}
    _fake(monkeypatch, listed, answers)
    known = D.KnownDecoders("", "decode:1", None, min_refresh_s=0.0, unlisted_grace_s=0.0)

    async def main():
        assert await known.allowed("ucx://d0:9") and await known.allowed("ucx://d1:9")
        del answers["d1:1"]                                # busy: no Stats answer
        assert not await known.allowed("ucx://other:9")    # a refresh
        assert "ucx://d1:9" in known.endpoints
        listed.remove("d1:1")                              # gone from the listing
        assert not await known.allowed("ucx://other:9")
        assert known.endpoints == {"ucx://d0:9"}
    asyncio.run(main())


def test_a_decode_worker_gone_from_the_listing_keeps_its_endpoint_for_the_grace(monkeypatch):
    """A terminating pod leaves the DNS while the gateway may still send it streams: its
    endpoint stays allowed for unlisted_grace_s, then goes."""
    listed, answers = ["d0:1", "d1:1"], {"d0:1": "ucx://d0:9", "d1:1": "ucx://d1:9"}
    _fake(monkeypatch, listed, answers)
    known = D.KnownDecoders("", "decode:1", None, min_refresh_s=0.0, unlisted_grace_s=0.4)

    async def main():
        assert await known.allowed("ucx://d1:9")
        listed.remove("d1:1")                              # terminating: out of the DNS
        assert not await known.allowed("ucx://other:9")    # a refresh
        assert await known.allowed("ucx://d1:9")           # still allowed, within the grace
        await asyncio.sleep(0.5)
        assert not await known.allowed("ucx://other:9")    # a refresh past the grace
        assert known.endpoints == {"ucx://d0:9"}
        listed.append("d1:1")                              # listed again: known again
        assert not await known.allowed("ucx://other:9")
        assert known.endpoints == {"ucx://d0:9", "ucx://d1:9"}
    asyncio.run(main())


def test_the_background_refresh_knows_a_worker_before_any_prefill_names_it(monkeypatch):
    """CI's scale-down: the prefill worker's first Prefill came after decode-0 had left the
    DNS (the gateway, re-reading it every few seconds, still sent it streams). Refreshed only
    on demand, it had never seen decode-0 listed and refused; the background refresh saw it
    and the grace keeps it. Without the refresh (interval 0) the same run refuses."""
    for interval_s, expected in ((0.05, True), (0.0, False)):
        listed, answers = ["d0:1"], {"d0:1": "ucx://d0:9"}
        _fake(monkeypatch, listed, answers)
        known = D.KnownDecoders("", "decode:1", None, min_refresh_s=0.0, unlisted_grace_s=30.0)

        async def main():
            known.start(interval_s)
            deadline = time.monotonic() + 5
            while interval_s and "ucx://d0:9" not in known.endpoints:   # the first refresh
                assert time.monotonic() < deadline
                await asyncio.sleep(0.01)
            listed.remove("d0:1")                          # terminating: out of the DNS
            await asyncio.sleep(0.2)                       # refreshes with d0 unlisted
            allowed = await known.allowed("ucx://d0:9")   # the first Prefill
            await known.close()
            return allowed
        assert asyncio.run(main()) is expected, interval_s
