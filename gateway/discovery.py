"""Worker discovery for the gateway: which prefill/decode addresses exist right now.

A resolver answers one question, `await resolver.resolve() -> ["ip:port", ...]` (sorted,
deduplicated):

- `StaticResolver`: a fixed list from the command line (`--prefill host:port,host:port`).
- `DnsResolver`: the A/AAAA records of one name, e.g. a Kubernetes headless Service
  (`pdserve-prefill.NS.svc.cluster.local:50061`). A headless Service publishes one record
  per *ready* pod, so a pod that starts draining (its gRPC health turns NOT_SERVING, its
  readiness probe fails) leaves the answer, and a new pod joins it once ready.
- `FileResolver`: one address per line of a file (`--prefill-file PATH`; blank lines and
  `#` comments skipped), re-read every interval. `pdserve up --autoscale` rewrites it
  atomically (services/address_file.py: a temporary file renamed over it), adding a worker only
  once it is SERVING and removing one before it is retired, so a reader never sees half a
  file. A missing or unreadable file is a failed resolve (the last good set is kept).

A `WorkerSet` owns one resolver and keeps `current()` fresh:

    start() -> first resolve (awaited) -> every interval_s: resolve
                                          |-- ok, same set:   nothing
                                          |-- ok, new set:    swap, call on_change(added, removed)
                                          '-- error/timeout:  keep the last good set, WARNING

The loop never raises: a DNS outage leaves the gateway routing to the workers it last knew
(the worker registry's health checks remove dead ones). Every resolve has a deadline.
A successful but empty answer is applied as is: it is the truth, not a failure.

Only the standard library, asyncio and services.address_file are imported here.
"""
from __future__ import annotations

import asyncio
import inspect
import logging
import socket
from typing import Awaitable, Callable, Iterable, Protocol, Union

from services.address_file import read_addresses

log = logging.getLogger(__name__)

# resolve_fn(host, port) -> IP strings (plain, or awaitable). Injected by tests.
ResolveFn = Callable[[str, int], Union[Iterable[str], Awaitable[Iterable[str]]]]
ChangeCallback = Callable[[list[str], list[str]], Union[None, Awaitable[None]]]

DEFAULT_INTERVAL_S = 5.0


class Resolver(Protocol):
    # Seconds between refreshes; None means the answer never changes (resolve once).
    interval_s: float | None

    async def resolve(self) -> list[str]: ...


def split_host_port(address: str) -> tuple[str, int]:
    """'host:port' or '[v6]:port' -> (host, port); a clear ValueError otherwise."""
    address = address.strip()
    if address.startswith("["):
        host, sep, rest = address[1:].partition("]")
        if not sep or not rest.startswith(":"):
            raise ValueError(f"bad address {address!r}: expected '[ipv6]:port'")
        port_text = rest[1:]
    else:
        host, sep, port_text = address.rpartition(":")
        if not sep:
            raise ValueError(f"bad address {address!r}: expected 'host:port'")
        if ":" in host:
            raise ValueError(f"bad address {address!r}: write IPv6 as '[addr]:port'")
    if not host:
        raise ValueError(f"bad address {address!r}: empty host")
    if not port_text.isdigit() or not 0 < int(port_text) < 65536:
        raise ValueError(f"bad address {address!r}: port must be 1-65535")
    return host, int(port_text)


def join_host_port(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


class StaticResolver:
    """A fixed list of 'host:port' addresses."""

    interval_s: float | None = None

    def __init__(self, addresses: list[str]) -> None:
        parsed = [split_host_port(a) for a in addresses]
        self._addresses = sorted({join_host_port(h, p) for h, p in parsed})

    async def resolve(self) -> list[str]:
        return list(self._addresses)

    def __repr__(self) -> str:
        return f"StaticResolver({self._addresses})"


class DnsResolver:
    """Every address one DNS name resolves to, each with the same port."""

    def __init__(self, host: str, port: int, interval_s: float = DEFAULT_INTERVAL_S,
                 resolve_fn: ResolveFn | None = None) -> None:
        if not host:
            raise ValueError("DnsResolver: empty host")
        if not 0 < port < 65536:
            raise ValueError(f"DnsResolver: port {port} out of range 1-65535")
        if interval_s <= 0:
            raise ValueError(f"DnsResolver: interval_s must be > 0, got {interval_s}")
        self.host, self.port, self.interval_s = host, port, interval_s
        self._resolve_fn = resolve_fn or _getaddrinfo_ips

    async def resolve(self) -> list[str]:
        ips = self._resolve_fn(self.host, self.port)
        if inspect.isawaitable(ips):
            ips = await ips
        return sorted({join_host_port(ip, self.port) for ip in ips})

    def __repr__(self) -> str:
        return f"DnsResolver({self.host}:{self.port}, every {self.interval_s}s)"


class FileResolver:
    """The addresses listed in a file, one per line, re-read every interval_s."""

    def __init__(self, path: str, interval_s: float = DEFAULT_INTERVAL_S) -> None:
        if not path:
            raise ValueError("FileResolver: empty path")
        if interval_s <= 0:
            raise ValueError(f"FileResolver: interval_s must be > 0, got {interval_s}")
        self.path, self.interval_s = path, interval_s

    async def resolve(self) -> list[str]:
        return read_addresses(self.path)     # a small local file: no thread needed

    def __repr__(self) -> str:
        return f"FileResolver({self.path}, every {self.interval_s}s)"


async def _getaddrinfo_ips(host: str, port: int) -> list[str]:
    loop = asyncio.get_running_loop()
    infos = await loop.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    return [sockaddr[0] for _family, _type, _proto, _name, sockaddr in infos]


def resolver_from_args(static: str | None, dns: str | None,
                       interval_s: float = DEFAULT_INTERVAL_S, file: str | None = None) -> Resolver:
    """`--prefill a:1,b:2` -> StaticResolver; `--prefill-dns name:port` -> DnsResolver;
    `--prefill-file PATH` -> FileResolver."""
    static = (static or "").strip()
    dns = (dns or "").strip()
    file = (file or "").strip()
    if sum(map(bool, (static, dns, file))) > 1:
        raise ValueError("give only one of a static list (host:port,...), a DNS name "
                         "(name:port) or a file of addresses (not both)")
    if file:
        return FileResolver(file, interval_s=interval_s)
    if dns:
        host, port = split_host_port(dns)
        return DnsResolver(host, port, interval_s=interval_s)
    if static:
        addresses = [a for a in static.split(",") if a.strip()]
        return StaticResolver(addresses)
    raise ValueError("no workers: give a static list (host:port,...) or a DNS name (name:port)")


class WorkerSet:
    """The current addresses of one pool, refreshed in the background."""

    def __init__(self, resolver: Resolver, *, name: str = "workers",
                 interval_s: float | None = None, resolve_timeout_s: float = 5.0) -> None:
        self.resolver = resolver
        self.name = name
        # None (a static resolver): resolve once at start, no background loop.
        self.interval_s = interval_s if interval_s is not None else resolver.interval_s
        self.resolve_timeout_s = resolve_timeout_s
        self._current: list[str] = []
        self._callbacks: list[ChangeCallback] = []
        self._task: asyncio.Task | None = None
        self.consecutive_failures = 0

    def current(self) -> list[str]:
        return list(self._current)

    def on_change(self, callback: ChangeCallback) -> None:
        """callback(added, removed), sorted lists; plain or async; errors are logged."""
        self._callbacks.append(callback)

    async def start(self) -> None:
        """Resolve once (so current() is filled on return), then refresh in the background."""
        if self._task is not None:
            return
        await self.refresh()
        if self.interval_s is not None:
            self._task = asyncio.create_task(self._run(), name=f"worker-discovery-{self.name}")

    async def stop(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            try:
                await task
            except asyncio.CancelledError:
                pass

    async def refresh(self) -> bool:
        """One resolve. Returns False (and keeps the last good set) on any failure."""
        try:
            new = await asyncio.wait_for(self.resolver.resolve(), self.resolve_timeout_s)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # DNS errors, timeouts, a broken resolve_fn
            self.consecutive_failures += 1
            log.warning("%s discovery via %r failed (%d in a row): %s: %s; keeping %d known "
                        "address(es)", self.name, self.resolver, self.consecutive_failures,
                        type(exc).__name__, exc, len(self._current))
            return False
        if self.consecutive_failures:
            log.info("%s discovery recovered after %d failure(s)", self.name,
                     self.consecutive_failures)
        self.consecutive_failures = 0
        await self._apply(sorted(set(new)))
        return True

    async def _apply(self, new: list[str]) -> None:
        old = set(self._current)
        added = [a for a in new if a not in old]
        removed = sorted(old.difference(new))
        if not added and not removed:
            return
        self._current = new
        log.info("%s: +%s -%s -> %d address(es)", self.name, added, removed, len(new))
        for callback in list(self._callbacks):
            try:
                result = callback(added, removed)
                if inspect.isawaitable(result):
                    await result
            except Exception:
                log.exception("%s: on_change callback %r failed", self.name, callback)

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            await self.refresh()  # never raises except CancelledError
