"""gateway.discovery: static and DNS resolvers, and a WorkerSet that follows changes live."""
import asyncio
import logging
import socket

import pytest

from gateway.discovery import (DnsResolver, StaticResolver, WorkerSet, resolver_from_args,
                               split_host_port)


class FakeDns:
    """A resolve_fn whose answer the test changes while the WorkerSet runs."""

    def __init__(self, ips):
        self.ips = list(ips)
        self.error: Exception | None = None
        self.calls = 0
        self.called = asyncio.Event()

    async def __call__(self, host, port):
        self.calls += 1
        self.called.set()
        if self.error is not None:
            raise self.error
        return list(self.ips)

    async def wait_calls(self, n):
        while self.calls < n:
            self.called.clear()
            await asyncio.wait_for(self.called.wait(), 5)


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 10))


def test_static_resolver_sorts_and_dedups():
    r = StaticResolver(["10.0.0.2:50061", "10.0.0.1:50061", "10.0.0.2:50061", "[::1]:7"])
    assert run(r.resolve()) == ["10.0.0.1:50061", "10.0.0.2:50061", "[::1]:7"]


@pytest.mark.parametrize("bad", ["nohost", "h:0", "h:99999", ":80", "h:x", "::1:80", "[::1]80"])
def test_bad_addresses_are_clear_errors(bad):
    with pytest.raises(ValueError, match="bad address"):
        split_host_port(bad)


def test_resolver_from_args():
    assert isinstance(resolver_from_args("a:1, b:2", None), StaticResolver)
    r = resolver_from_args(None, "pdserve-prefill.ns.svc.cluster.local:50061")
    assert isinstance(r, DnsResolver)
    assert (r.host, r.port) == ("pdserve-prefill.ns.svc.cluster.local", 50061)
    with pytest.raises(ValueError, match="not both"):
        resolver_from_args("a:1", "b:2")
    with pytest.raises(ValueError, match="no workers"):
        resolver_from_args(None, "")


def test_dns_resolver_formats_ip_port():
    fake = FakeDns(["10.0.0.9", "10.0.0.3", "10.0.0.9", "fd00::1"])
    r = DnsResolver("svc", 50071, resolve_fn=fake)
    assert run(r.resolve()) == ["10.0.0.3:50071", "10.0.0.9:50071", "[fd00::1]:50071"]


def test_dns_resolver_default_uses_getaddrinfo():
    r = DnsResolver("localhost", 50061)
    try:
        got = run(r.resolve())
    except socket.gaierror as exc:  # pragma: no cover - a sandbox without /etc/hosts
        pytest.skip(f"localhost does not resolve here: {exc}")
    assert got and all(a.endswith(":50061") for a in got)


def test_worker_set_follows_additions_and_removals_live():
    async def main():
        fake = FakeDns(["10.0.0.1"])
        ws = WorkerSet(DnsResolver("svc", 50061, interval_s=0.01, resolve_fn=fake), name="prefill")
        changes = []
        changed = asyncio.Event()

        def on_change(added, removed):
            changes.append((added, removed))
            changed.set()

        ws.on_change(on_change)
        await ws.start()
        assert ws.current() == ["10.0.0.1:50061"]

        changed.clear()
        fake.ips = ["10.0.0.1", "10.0.0.2"]  # a pod became ready
        await asyncio.wait_for(changed.wait(), 5)
        assert ws.current() == ["10.0.0.1:50061", "10.0.0.2:50061"]

        changed.clear()
        fake.ips = ["10.0.0.2"]  # a pod drained away
        await asyncio.wait_for(changed.wait(), 5)
        assert ws.current() == ["10.0.0.2:50061"]
        await ws.stop()
        return changes

    changes = run(main())
    assert changes == [(["10.0.0.1:50061"], []), (["10.0.0.2:50061"], []),
                       ([], ["10.0.0.1:50061"])]


def test_dns_failure_keeps_last_good_set(caplog):
    async def main():
        fake = FakeDns(["10.0.0.1", "10.0.0.2"])
        ws = WorkerSet(DnsResolver("svc", 50071, interval_s=0.01, resolve_fn=fake), name="decode")
        await ws.start()
        before = ws.current()
        fake.error = socket.gaierror(socket.EAI_NONAME, "Name or service not known")
        await fake.wait_calls(fake.calls + 3)  # several failed refreshes, loop still alive
        during = ws.current()
        assert ws.consecutive_failures >= 2
        fake.error = None
        fake.ips = ["10.0.0.3"]
        await fake.wait_calls(fake.calls + 2)
        after = ws.current()
        await ws.stop()
        return before, during, after

    with caplog.at_level(logging.WARNING, logger="gateway.discovery"):
        before, during, after = run(main())
    assert before == during == ["10.0.0.1:50071", "10.0.0.2:50071"]
    assert after == ["10.0.0.3:50071"]
    assert any(r.levelno == logging.WARNING and "keeping 2" in r.getMessage()
               for r in caplog.records)


def test_hung_resolve_times_out_and_keeps_set():
    async def main():
        hang = asyncio.Event()
        state = {"hang": False}

        async def resolve_fn(host, port):
            if state["hang"]:
                await hang.wait()
            return ["10.0.0.1"]

        ws = WorkerSet(DnsResolver("svc", 1, resolve_fn=resolve_fn), resolve_timeout_s=0.05)
        await ws.start()
        state["hang"] = True
        ok = await ws.refresh()
        return ok, ws.current()

    assert run(main()) == (False, ["10.0.0.1:1"])


def test_callback_error_does_not_stop_the_set():
    async def main():
        fake = FakeDns(["10.0.0.1"])
        ws = WorkerSet(DnsResolver("svc", 1, interval_s=0.01, resolve_fn=fake))
        seen = []

        def broken(added, removed):
            raise RuntimeError("boom")

        async def good(added, removed):
            seen.append(added)

        ws.on_change(broken)
        ws.on_change(good)
        await ws.start()
        fake.ips = ["10.0.0.2"]
        await fake.wait_calls(fake.calls + 2)
        await ws.stop()
        return seen, ws.current()

    seen, current = run(main())
    assert seen == [["10.0.0.1:1"], ["10.0.0.2:1"]]
    assert current == ["10.0.0.2:1"]


def test_static_worker_set_resolves_once_without_a_task():
    async def main():
        ws = WorkerSet(StaticResolver(["h:1"]))
        await ws.start()
        assert ws._task is None
        await ws.stop()
        return ws.current()

    assert run(main()) == ["h:1"]


def test_file_resolver_follows_atomic_rewrites(tmp_path):
    """--prefill-file: the WorkerSet follows the launcher's rewrites (tmp + rename); a file
    gone missing or a bad line keeps the last good set; an empty file empties the pool."""
    from gateway.discovery import FileResolver
    from services.address_file import write_addresses
    path = str(tmp_path / "prefill.txt")
    write_addresses(path, ["127.0.0.1:2", "127.0.0.1:1"])
    assert isinstance(resolver_from_args("", "", 1.0, path), FileResolver)
    with pytest.raises(ValueError, match="only one of"):
        resolver_from_args("a:1", "", 1.0, path)
    changes = []

    async def main():
        ws = WorkerSet(FileResolver(path, interval_s=0.01), name="prefill")
        ws.on_change(lambda added, removed: changes.append((added, removed)))
        await ws.start()
        assert ws.current() == ["127.0.0.1:1", "127.0.0.1:2"]
        write_addresses(path, ["127.0.0.1:2", "127.0.0.1:3"])
        assert await ws.refresh() and ws.current() == ["127.0.0.1:2", "127.0.0.1:3"]
        (tmp_path / "prefill.txt").write_text("127.0.0.1:2\nnot an address\n")
        assert not await ws.refresh() and ws.current() == ["127.0.0.1:2", "127.0.0.1:3"]
        (tmp_path / "prefill.txt").unlink()
        assert not await ws.refresh() and ws.current() == ["127.0.0.1:2", "127.0.0.1:3"]
        write_addresses(path, [])
        assert await ws.refresh() and ws.current() == []
        await ws.stop()
    run(main())
    assert changes[1:] == [(["127.0.0.1:3"], ["127.0.0.1:1"]), ([], ["127.0.0.1:2", "127.0.0.1:3"])]
    assert not list(tmp_path.glob("*.tmp-*"))
