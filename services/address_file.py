"""A file of worker addresses, one `host:port` per line: how `pdserve up --autoscale` tells
the gateway (`--prefill-file`, `--decode-file`) and the prefill workers (`--decode-file`)
which workers exist right now.

    launcher: write_addresses(path, [...])  ->  path.tmp-PID written, renamed over path
    readers:  read_addresses(path)          ->  sorted, deduplicated; blank lines and `#`
                                                comments skipped

The rename is atomic, so a reader sees the old list or the new one, never half a file. A
line that is not `host:port` (IPv6 as `[addr]:port`) is a ValueError naming the line; a
missing file an OSError (a reader keeps what it knew). Standard library only.
"""
from __future__ import annotations

import os
from typing import Iterable


def check_address(address: str) -> str:
    """`address` stripped, if it is host:port or [v6]:port with a port 1-65535."""
    a = address.strip()
    host, sep, port = a.rpartition(":")
    if not sep or not host or (":" in host and not (host.startswith("[") and host.endswith("]"))):
        raise ValueError(f"bad address {a!r}: expected 'host:port' or '[ipv6]:port'")
    if not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"bad address {a!r}: port must be 1-65535")
    return a


def read_addresses(path: str) -> list[str]:
    """The addresses in `path`, sorted and deduplicated."""
    out = set()
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            line = line.split("#")[0].strip()
            if not line:
                continue
            try:
                out.add(check_address(line))
            except ValueError as e:
                raise ValueError(f"{path}:{n}: {e}") from None
    return sorted(out)


def write_addresses(path: str, addresses: Iterable[str]) -> None:
    """Replace `path` by `addresses`, one per line, atomically (a temporary file renamed)."""
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write("".join(f"{check_address(a)}\n" for a in addresses))
    os.replace(tmp, path)
