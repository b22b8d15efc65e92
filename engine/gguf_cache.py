"""A GGUF file's parsed header (metadata, vocabulary and tensor table), cached on disk so
that each process (both workers and the gateway, at every start) reads it instead of
parsing it again: SmolLM2's header holds 98k strings (49k tokens, 49k merges), 0.3-0.8 s
of parsing per process on a busy 2-core machine, against a few milliseconds to read back.

    $XDG_CACHE_HOME/pdserve/gguf-headers/<sha256(resolved path)[:24]>.json, two lines:
      1  {"version", "path", "size", "mtime_ns", "header_len", "header_sha256", "payload_sha256"}
      2  the payload: {"meta": {key: value}, "tensors": [[name, dims, type, offset]], "data_start"}

Trusted only when all of it agrees: this format's version, the file's size and mtime (any
change to the file is a miss), the SHA-256 of the file's header bytes as they are now
(`header_len` bytes from the start: a file rewritten in place with the same size and mtime
is still caught), and the SHA-256 of the payload line (a torn, truncated or edited cache
file). Anything else (missing, unreadable, corrupt, stale) is a miss: the header is parsed
again and the entry rewritten (atomically: a temporary file, then rename), with a log line
saying why when an entry existed. A cache that cannot be written (read-only home) costs
only the parse. Metadata values are JSON's: strings, numbers, booleans and lists of them,
as engine/gguf.py's reader returns them (NaN and infinities as Python's json writes them).
Entries of files that no longer exist are dropped whenever an entry is written.
Torch-free (the gateway reads GGUF tokenizers).
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
from pathlib import Path

from .paths import cache_dir

log = logging.getLogger(__name__)

VERSION = 1


def cache_file(path: str | Path) -> Path:
    """Where the header of the GGUF file `path` is cached."""
    key = hashlib.sha256(str(Path(path).resolve()).encode()).hexdigest()[:24]
    return cache_dir() / "gguf-headers" / f"{key}.json"


def remove_caches(path: str | Path) -> None:
    """Forget what is cached for the GGUF file `path` (bench/startup.py --cold-cache)."""
    cache_file(path).unlink(missing_ok=True)


def _stamp(path: Path) -> dict:
    st = path.stat()
    return {"version": VERSION, "path": str(path.resolve()), "size": st.st_size,
            "mtime_ns": st.st_mtime_ns}


def load(path: str | Path, buf) -> tuple[dict, list, int] | None:
    """(metadata, [(name, dims, type, offset)], data start) of the GGUF file `path`, whose
    bytes are `buf` (its mmap), if its cache entry is there and trusted; else None."""
    path = Path(path)
    entry = cache_file(path)
    try:
        with open(entry, "rb") as f:
            head, payload = f.readline(), f.read()
    except OSError:
        return None                      # no entry: the usual first start
    why = _untrusted(path, buf, head, payload)
    if why:
        log.info("GGUF header cache %s for %s: %s; parsing the file again", entry, path.name, why)
        return None
    try:
        body = json.loads(payload)
        tensors = [(str(name), tuple(int(d) for d in dims), int(kind), int(offset))
                   for name, dims, kind, offset in body["tensors"]]
        return dict(body["meta"]), tensors, int(body["data_start"])
    except (ValueError, TypeError, KeyError) as e:   # checksummed, so only a writer's bug
        log.info("GGUF header cache %s for %s: unusable (%r); parsing the file again", entry, path.name, e)
        return None


def _untrusted(path: Path, buf, head: bytes, payload: bytes) -> str:
    """Why the entry (`head` line, `payload`) may not be used for `path` ("": it may)."""
    try:
        stamp = json.loads(head)
        if not isinstance(stamp, dict):
            return "not a cache entry"
    except ValueError:
        return "unreadable stamp line"
    now = _stamp(path)
    changed = [k for k in now if stamp.get(k) != now[k]]
    if changed:
        return f"stale ({', '.join(changed)} changed)"
    n = stamp.get("header_len")
    if not isinstance(n, int) or not 0 < n <= len(buf):
        return "bad header length"
    if hashlib.sha256(buf[:n]).hexdigest() != stamp.get("header_sha256"):
        return "the file's header bytes changed"
    if hashlib.sha256(payload).hexdigest() != stamp.get("payload_sha256"):
        return "corrupt (payload checksum mismatch)"
    return ""


def store(path: str | Path, buf, meta: dict, tensors: list, data_start: int, header_len: int) -> None:
    """Cache the parsed header of `path` (`buf`: its bytes; `header_len`: how many of them
    the parse read). Best effort: a cache that cannot be written is logged and skipped."""
    path = Path(path)
    entry = cache_file(path)
    try:
        payload = json.dumps({"meta": meta, "tensors": [[n, list(d), int(k), int(o)] for n, d, k, o in tensors],
                              "data_start": data_start}, separators=(",", ":")).encode()
        stamp = {**_stamp(path), "header_len": header_len,
                 "header_sha256": hashlib.sha256(buf[:header_len]).hexdigest(),
                 "payload_sha256": hashlib.sha256(payload).hexdigest()}
        entry.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=entry.parent, prefix=entry.name, suffix=".tmp")
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(json.dumps(stamp).encode() + b"\n" + payload)
            os.replace(tmp, entry)
        finally:
            Path(tmp).unlink(missing_ok=True)
        _prune(entry.parent)
    except (OSError, TypeError, ValueError) as e:
        log.info("GGUF header of %s not cached: %s", path.name, e)


def _prune(folder: Path) -> None:
    """Drop the entries of files that are gone (e.g. tests' temporary GGUF files): read at a
    miss only, one stamp line each."""
    for entry in folder.glob("*.json"):
        try:
            with open(entry, "rb") as f:
                gone = not Path(json.loads(f.readline())["path"]).exists()
        except (OSError, ValueError, TypeError, KeyError):
            gone = True
        if gone:
            entry.unlink(missing_ok=True)
