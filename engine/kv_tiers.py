"""The KV offload tiers under the block pool: host memory and local disk. Each holds whole KV
blocks by their chained hash (engine/block_hash.py), is bounded and evicts least recently
used first, and reports what it holds to the worker's `KvEventLog` in its own tier (HOST,
DISK). engine/kv_offload.py moves blocks between them and the device pool.

A block's payload (`BlockLayout`): its slice of the runner's paged cache, kv_cache[:, :, b]
-> [layers, parts, block_size, heads, dim] in the cache's dtype, and for an 8-bit cache
kv_scales[:, :, b] -> [layers, parts, heads] fp32.

HostTier: a fixed arena of `num_slots` payloads (pinned memory on CUDA, so copies in and out
are DMA; on CPU pages committed as first written), one lock.
  H1. a slot is free (in `free`), reserved (being filled, in neither), or holds exactly one
      hash (`lru[h] == slot`); never two of these
  H2. `lru` is oldest first: `commit`, `pin` and `touch` move a hash to its end; `reserve`
      evicts the oldest unpinned hash when no slot is free
  H3. a pinned slot (a reader copies out of it outside the lock) is never evicted
  H4. events: the log's HOST set always equals `lru`'s keys

DiskTier: one file per block in its own directory, named `<hash hex>.kvb`:
    b"PDKVB1\\n" | header length (u32 le) | header JSON {key, hash, nbytes, blake2b} | payload
  written as a temporary file, fsync'ed, renamed (a reader never sees half a file).
  D1. `lru` (hash -> file bytes) lists exactly the files it wrote or found valid at start;
      their bytes total at most `capacity`
  D2. `lru` is oldest first (at start by mtime); `write`, `read` and `touch` move to its end
  D3. a file whose header key differs from this engine's (model, weights' dtype and
      quantization, KV layout and dtype, block size, shape, K shift) or that is malformed is
      deleted at start and never loaded; its payload's blake2b is checked at each load (a
      corrupt one is deleted and reported "removed")
  D4. events: the log's DISK set always equals `lru`'s keys (files found at start included)
TierCosts: the measurements behind engine/kv_offload.py's O4 (revive only when cheaper).

Several workers may be given one directory (`pdserve up` passes the same flag to all): each
takes the first `slot-<i>` subdirectory no other process holds (an exclusive flock), so a
restarted worker reuses one whose files are of its model and layout.
"""
from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import math
import os
import struct
import threading
from collections import Counter, OrderedDict
from dataclasses import dataclass
from pathlib import Path

import torch

from .kv_events import DISK, HOST, KvEventLog

log = logging.getLogger(__name__)

MAGIC = b"PDKVB1\n"
SUFFIX = ".kvb"
MAX_SLOTS = 64                      # subdirectories one disk tier directory serves
ALPHA = 0.2                         # EWMA weight of the newest measurement (TierCosts)
PROBE_EVERY = 32                    # declines of a tier between two measurements anyway (O4)


@dataclass(frozen=True)
class BlockLayout:
    shape: tuple[int, ...]          # one block's KV: (layers, parts, block_size, heads, dim)
    dtype: torch.dtype
    scale_shape: tuple[int, ...] | None   # (layers, parts, heads) fp32, 8-bit caches only
    key: str                        # what must match for a file to be reused (D3)

    @property
    def kv_bytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize

    @property
    def nbytes(self) -> int:
        return self.kv_bytes + (math.prod(self.scale_shape) * 4 if self.scale_shape else 0)

    @classmethod
    def of(cls, kv_cache: torch.Tensor, kv_scales: torch.Tensor | None, **key) -> "BlockLayout":
        L, P, _, bs, H, D = kv_cache.shape
        scale = (L, P, H) if kv_scales is not None else None
        shape = (L, P, bs, H, D)
        key = dict(key, shape=list(shape), kv_dtype=str(kv_cache.dtype), scales=scale is not None)
        return cls(shape, kv_cache.dtype, scale, json.dumps(key, sort_keys=True))


def layout_key(config, runner) -> dict:
    """What a disk tier's file must have been written with to be reused (kv_tiers D3)."""
    mc = config.model
    shift = runner.k_shift
    return {"model": mc.name, "architecture": mc.architecture, "kv_layout": mc.kv_layout(),
            "dtype": str(config.torch_dtype), "quantization": config.quantization,
            "block_size": config.cache.block_size,
            "k_shift": None if shift is None else hashlib.blake2b(
                shift.detach().cpu().contiguous().view(torch.uint8).numpy(), digest_size=16).hexdigest()}


class HostTier:
    def __init__(self, layout: BlockLayout, num_slots: int, events: KvEventLog, pinned: bool):
        if num_slots < 1:
            raise ValueError(f"a host tier needs at least one block slot, got {num_slots}")
        self.layout, self.events, self.num_slots = layout, events, num_slots
        self.kv = _arena((num_slots, *layout.shape), layout.dtype, pinned)
        self.scales = _arena((num_slots, *layout.scale_shape), torch.float32, pinned) \
            if layout.scale_shape else None
        self.lock = threading.Lock()
        self.free = list(range(num_slots - 1, -1, -1))
        self.lru: OrderedDict[bytes, int] = OrderedDict()
        self.pins = [0] * num_slots

    def __len__(self) -> int:
        return len(self.lru)

    def __contains__(self, h: bytes) -> bool:
        return h in self.lru

    def views(self, slot: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        return self.kv[slot], (self.scales[slot] if self.scales is not None else None)

    def reserve(self) -> int | None:
        """A slot to fill: a free one, else the oldest unpinned one's (evicted, H2); None if
        every slot is pinned."""
        return self.reserve_evicting()[0]

    def reserve_evicting(self) -> tuple[int | None, bytes | None]:
        """`reserve`, and the hash it evicted (None if the slot was free). Until the caller
        fills the slot, it still holds the evicted block's payload, and only the caller
        can reach it (reserved: neither free nor held)."""
        with self.lock:
            if self.free:
                return self.free.pop(), None
            victim = next((h for h, s in self.lru.items() if not self.pins[s]), None)
            if victim is None:
                return None, None
            slot = self.lru.pop(victim)
        self.events.removed([victim], HOST)
        return slot, victim

    def commit(self, slot: int, h: bytes) -> None:
        """The reserved slot now holds block `h` (or goes back free if `h` is held already)."""
        with self.lock:
            if h in self.lru:
                self.free.append(slot)
                return
            self.lru[h] = slot
        self.events.stored([h], HOST)

    def release(self, slot: int) -> None:
        """An unfilled reserved slot goes back free."""
        with self.lock:
            self.free.append(slot)

    def pin(self, h: bytes) -> int | None:
        """Keep block `h` where it is until `unpin` (its slot is read outside the lock)."""
        with self.lock:
            slot = self.lru.get(h)
            if slot is not None:
                self.lru.move_to_end(h)
                self.pins[slot] += 1
            return slot

    def unpin(self, slot: int) -> None:
        with self.lock:
            self.pins[slot] -= 1

    def touch(self, h: bytes) -> None:
        with self.lock:
            if h in self.lru:
                self.lru.move_to_end(h)

    def check(self) -> None:
        with self.lock:
            held = list(self.lru.values())
            assert len(set(held)) == len(held), "a slot holds two hashes"
            assert not set(held) & set(self.free), "a slot both free and held"
            assert len(held) + len(self.free) <= self.num_slots
            assert all(p >= 0 for p in self.pins)
            assert self.events.held(HOST) == set(self.lru), "event log != host tier"


def _arena(shape, dtype, pinned: bool) -> torch.Tensor:
    if pinned:
        return torch.empty(shape, dtype=dtype, pin_memory=True)
    from .runner import lazy_zeros
    return lazy_zeros(shape, dtype, "cpu")


class DiskTier:
    def __init__(self, root: str | Path, layout: BlockLayout, capacity_bytes: int,
                 events: KvEventLog):
        if capacity_bytes < layout.nbytes:
            raise ValueError(f"a disk tier of {capacity_bytes} bytes holds no block "
                             f"({layout.nbytes} bytes)")
        self.layout, self.capacity, self.events = layout, capacity_bytes, events
        self.dir, self._lock_file = _claim_dir(Path(root))
        self.lock = threading.Lock()
        self.lru: OrderedDict[bytes, int] = OrderedDict()
        self.bytes = 0
        self._scan()

    def __len__(self) -> int:
        return len(self.lru)

    def __contains__(self, h: bytes) -> bool:
        return h in self.lru

    def path(self, h: bytes) -> Path:
        return self.dir / (h.hex() + SUFFIX)

    def _scan(self) -> None:
        """Index the valid files of an earlier run (D3), oldest first; delete the rest."""
        for tmp in self.dir.glob(".tmp-*"):
            tmp.unlink(missing_ok=True)
        found = []
        for f in self.dir.glob("*" + SUFFIX):
            try:
                h = bytes.fromhex(f.stem)
                with open(f, "rb") as fh:
                    hdr, off = _read_header(fh)
                size = f.stat()
                ok = (hdr["key"] == self.layout.key and hdr["hash"] == f.stem
                      and hdr["nbytes"] == self.layout.nbytes and size.st_size == off + hdr["nbytes"])
            except (OSError, ValueError, KeyError, TypeError):
                ok = False
            if not ok:
                log.warning("KV disk tier: ignoring and deleting %s (another model or layout, "
                            "or not a whole block file)", f)
                f.unlink(missing_ok=True)
                continue
            found.append((size.st_mtime, h, size.st_size))
        for _, h, n in sorted(found):
            self.lru[h] = n
            self.bytes += n
        self._evict_to(self.capacity)
        if self.lru:
            self.events.stored(list(self.lru), DISK)
            log.info("KV disk tier %s: %d blocks of an earlier run reused", self.dir, len(self.lru))

    def write(self, h: bytes, kv: torch.Tensor, scales: torch.Tensor | None) -> int:
        """Store block `h` (atomically, D1), evicting the oldest to stay within capacity;
        the bytes written (0 if it was held already)."""
        if h in self:
            self.touch(h)
            return 0
        parts = [kv.contiguous().view(torch.uint8).reshape(-1).numpy()]
        if scales is not None:
            parts.append(scales.contiguous().view(torch.uint8).reshape(-1).numpy())
        digest = hashlib.blake2b(digest_size=32)
        for p in parts:
            digest.update(p)
        hdr = json.dumps({"key": self.layout.key, "hash": h.hex(), "nbytes": self.layout.nbytes,
                          "blake2b": digest.hexdigest()}).encode()
        tmp = self.dir / f".tmp-{h.hex()}-{os.getpid()}-{threading.get_ident()}"
        with open(tmp, "wb") as f:
            f.write(MAGIC + struct.pack("<I", len(hdr)) + hdr)
            for p in parts:
                f.write(memoryview(p))
            f.flush()
            os.fsync(f.fileno())
        size = len(MAGIC) + 4 + len(hdr) + self.layout.nbytes
        os.replace(tmp, self.path(h))
        with self.lock:
            if h in self.lru:
                return 0
            self.lru[h] = size
            self.bytes += size
        self.events.stored([h], DISK)
        self._evict_to(self.capacity)
        return size

    def read(self, h: bytes) -> tuple[torch.Tensor, torch.Tensor | None] | None:
        """Block `h`'s payload, or None when it is not (or no longer) held or its file is
        corrupt (then deleted, D3)."""
        if h not in self:
            return None
        try:
            with open(self.path(h), "rb") as f:
                hdr, _ = _read_header(f)
                buf = bytearray(self.layout.nbytes)
                n = f.readinto(buf)
            ok = (n == len(buf) and hdr["key"] == self.layout.key
                  and hashlib.blake2b(buf, digest_size=32).hexdigest() == hdr["blake2b"])
        except FileNotFoundError:
            ok = None                       # evicted meanwhile by the writer
        except (OSError, ValueError, KeyError, TypeError):
            ok = False
        if not ok:
            if ok is False:
                log.warning("KV disk tier: corrupt block file %s deleted", self.path(h))
            self._drop(h)
            return None
        self.touch(h)
        lay = self.layout
        kv = torch.frombuffer(buf, dtype=torch.uint8, count=lay.kv_bytes).view(lay.dtype).view(lay.shape)
        scales = None
        if lay.scale_shape:
            scales = torch.frombuffer(buf, dtype=torch.float32, offset=lay.kv_bytes).view(lay.scale_shape)
        return kv, scales

    def touch(self, h: bytes) -> None:
        with self.lock:
            if h in self.lru:
                self.lru.move_to_end(h)

    def _drop(self, h: bytes) -> None:
        with self.lock:
            n = self.lru.pop(h, None)
            if n is None:
                return
            self.bytes -= n
        self.path(h).unlink(missing_ok=True)
        self.events.removed([h], DISK)

    def _evict_to(self, capacity: int) -> None:
        gone = []
        with self.lock:
            while self.bytes > capacity and self.lru:
                h, n = self.lru.popitem(last=False)
                self.bytes -= n
                gone.append(h)
        for h in gone:
            self.path(h).unlink(missing_ok=True)
        if gone:
            self.events.removed(gone, DISK)

    def check(self) -> None:
        with self.lock:
            assert self.bytes == sum(self.lru.values()) <= self.capacity
            on_disk = {bytes.fromhex(f.stem) for f in self.dir.glob("*" + SUFFIX)}
            assert on_disk == set(self.lru), "files != disk tier index"
            assert self.events.held(DISK) == set(self.lru), "event log != disk tier"

    def close(self) -> None:
        if self._lock_file is not None:
            self._lock_file.close()         # releases the flock
            self._lock_file = None


def _read_header(f) -> tuple[dict, int]:
    if f.read(len(MAGIC)) != MAGIC:
        raise ValueError("not a KV block file")
    (n,) = struct.unpack("<I", f.read(4))
    if n > 1 << 16:
        raise ValueError("header too long")
    hdr = json.loads(f.read(n))
    return hdr, len(MAGIC) + 4 + n


def _claim_dir(root: Path) -> tuple[Path, object]:
    """The first `slot-<i>` under `root` no other process holds, and its held lock file."""
    root.mkdir(parents=True, exist_ok=True)
    for i in range(MAX_SLOTS):
        d = root / f"slot-{i}"
        d.mkdir(exist_ok=True)
        f = open(d / ".lock", "a+")
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return d, f
        except OSError:
            f.close()
    raise ValueError(f"KV disk tier {root}: all {MAX_SLOTS} slot directories are in use")


class TierCosts:
    """engine/kv_offload.py's O4: what a load from each tier and a computed token cost
    (EWMAs), and whether a revival is worth it."""

    def __init__(self, block_size: int):
        self.block_size = block_size
        self.compute_s_per_token: float | None = None
        self.load_s: dict[str, float] = {}
        self.declined: Counter = Counter()
        self.loading_s = 0.0        # load time inside the step being measured

    def observe_load(self, tier: str, seconds: float) -> None:
        old = self.load_s.get(tier)
        self.load_s[tier] = seconds if old is None else old + ALPHA * (seconds - old)
        self.loading_s += seconds

    def observe_step(self, seconds: float, tokens: dict) -> None:
        """A step observer's reading: prefill steps (a request computing more than one token)
        measure the compute time per token, less the loads done inside the step."""
        spent, self.loading_s = self.loading_s, 0.0
        if not any(n > 1 for n in tokens.values()):
            return
        per = max(seconds - spent, 0.0) / sum(tokens.values())
        old = self.compute_s_per_token
        self.compute_s_per_token = per if old is None else old + ALPHA * (per - old)

    def worth(self, tier: str) -> bool:
        load, comp = self.load_s.get(tier), self.compute_s_per_token
        if load is None or comp is None or load < comp * self.block_size:
            return True
        self.declined[tier] += 1
        return self.declined[tier] % PROBE_EVERY == 0
