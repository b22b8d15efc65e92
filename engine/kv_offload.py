"""Host and disk tiers under the block pool (engine/kv_tiers.py holds them): a block cached in
the device pool is copied down as it is cached, and a prefix lookup continues its device hit
with host, then disk blocks, loaded back into device blocks instead of recomputed when
loading measures cheaper than computing.

    KVCacheManager.cache_blocks -> stored(blocks)      engine thread: queues, never waits
          | copy queue (bounded)
          v
    copier thread: device block -> host slot           HOST "stored" (LRU evicts: "removed")
          | disk queue (bounded): with a host tier, the block the host evicts to make room
          | (a staging copy of its slot, taken before the slot is refilled); with none, the
          | device block itself (a staging copy)
          v
    disk thread: one file, written atomically          DISK "stored" (LRU evicts: "removed")
    close(): the host tier's blocks not on disk yet written down (oldest first, within the
    deadline), so a restart finds them

Device -> host is write-through, host -> disk write-back: while the host tier holds the
working set the disk costs nothing (written through, each block's checksum, file and fsync
on every worker raised a 2-core benchmark's TTFT p90 by half: bench/RESULTS.md, issue 31,
2026-12-07); a worker that dies without close() loses what only its host tier held.

    BlockPool.allocate evicts b -> before_reuse([b])   b's copy, if still pending, runs now
                                                       (or is waited for) before b is reused
    KVCacheManager.get_computed_blocks -> revive(hashes)   host/disk hits -> fresh device
                                                       blocks: loaded, cached, freed (ref 0,
                                                       most recent): the caller's device hits

Why write-through to the host (copy when cached, not when evicted): eviction happens inside `allocate`,
on the engine's critical path, right before the block is overwritten; a copy there would
stall every step that reuses a block. A cached block's KV does not change until it is reused
(block_pool.py invariant 2), so it can be copied any time before, off the critical path;
eviction then costs nothing. The price: copy bandwidth for blocks never evicted, bounded by
the queues (a full queue drops the copy, counted in `dropped`: a tier is a cache, never a
promise). The host tier is the copier's own memory, so its evictions can wait for a staging
copy (0.1 ms a block here) and go to the disk write-back, as above; without a host tier the
disk is written through, and holds what was computed even after a crash.

Invariants (`check()`, besides the tiers' H1-H4 and D1-D4):
  O1. a device block whose copy is queued or running is in `pending`; `before_reuse`
      finishes that copy before the block is handed out: no copy reads overwritten KV
  O2. no pin outlives its copy: once `flush()` returns True nothing is pending or queued and
      no host slot is pinned. Requests hold device blocks only (a revival frees its blocks
      back to the pool before returning them as hits), so a finished or aborted request
      leaves nothing behind in any tier
  O3. a revived block is byte-identical to the block copied down (disk: blake2b checked)
  O4. revival only when cheaper: the EWMA of a tier's load seconds per block below the EWMA
      of the engine's prefill seconds per token (`on_step`, a step observer) times
      block_size; unmeasured counts as cheaper (so it gets measured), and a tier judged
      slower is tried again every PROBE_EVERY declines (so a stale estimate heals)
Threads: the engine thread calls stored / before_reuse / revive / on_step; the copier and
the disk thread drain their queues; the tiers and the counters have their own locks. On CUDA
the copier copies on its own stream, after an event recorded on the engine's stream when the
blocks were cached, into pinned host slots (a fixed arena of --kv-offload-host-gb, apart from
kvtransfer's staging buffers); loads back are blocking copies on the engine's stream.
"""
from __future__ import annotations

import logging
import threading
import time
from collections import Counter, deque
from dataclasses import dataclass

import torch

from .kv_events import DEVICE, DISK, HOST
from .kv_tiers import BlockLayout, DiskTier, HostTier, TierCosts, layout_key

log = logging.getLogger(__name__)

QUEUE_BLOCKS = 256          # each queue's bound, in blocks
DISK_QUEUE_BYTES = 256 << 20    # ... and the disk queue's in bytes (its staging copies)


@dataclass
class TierStats:
    blocks: dict            # tier -> blocks held (device: cached blocks)
    hits: dict              # tier -> blocks revived from it
    bytes: dict             # (tier, "in"|"out") -> bytes loaded from / written to it
    seconds: dict           # (tier, "in"|"out") -> seconds spent doing so
    dropped: int            # copies dropped at a full queue or a host tier all pinned


class _Copy:
    """One block's copy down, run once by whichever thread claims it first (O1)."""
    __slots__ = ("block_id", "block_hash", "event", "lock", "done")

    def __init__(self, block_id: int, block_hash: bytes, event):
        self.block_id, self.block_hash, self.event = block_id, block_hash, event
        self.lock = threading.Lock()
        self.done = False


class OffloadManager:
    def __init__(self, kv_cache: torch.Tensor, kv_scales: torch.Tensor | None, block_size: int,
                 host: HostTier | None, disk: DiskTier | None, queue_blocks: int = QUEUE_BLOCKS):
        self.kv_cache, self.kv_scales, self.host, self.disk = kv_cache, kv_scales, host, disk
        self.layout = (host if host is not None else disk).layout
        self.costs = TierCosts(block_size)
        self.queue_blocks = queue_blocks
        self.disk_queue_blocks = max(4, min(queue_blocks, DISK_QUEUE_BYTES // self.layout.nbytes))
        self.cuda = kv_cache.device.type == "cuda"
        self.stream = torch.cuda.Stream(kv_cache.device) if self.cuda else None
        self._cv = threading.Condition()
        self.pending: dict[int, _Copy] = {}
        self._copies: deque[_Copy] = deque()
        self._writes: deque = deque()
        self._busy = 0
        self._stop = False
        self._stats = threading.Lock()
        self.hits: Counter = Counter()
        self.bytes: Counter = Counter()
        self.seconds: Counter = Counter()
        self.dropped = 0
        self._threads = [threading.Thread(target=self._loop, args=(self._copies, self._run),
                                          name="kv-offload-copy", daemon=True)]
        if disk is not None:
            self._threads.append(threading.Thread(target=self._loop, args=(self._writes, self._write),
                                                  name="kv-offload-disk", daemon=True))
        for t in self._threads:
            t.start()

    # -- engine thread ------------------------------------------------------------------
    def stored(self, blocks) -> None:
        """Newly cached device blocks: queue their copies down (write-through)."""
        event = None
        for b in blocks:
            h = b.block_hash
            to_host = self.host is not None and h not in self.host
            if not to_host and (self.disk is None or h in self.disk):
                self._touch(h)
                continue
            if self.cuda and event is None:
                event = torch.cuda.Event()
                event.record()
            with self._cv:
                if len(self._copies) >= self.queue_blocks:
                    self._drop()
                    continue
                job = _Copy(b.block_id, h, event)
                self.pending[b.block_id] = job
                self._copies.append(job)
                self._cv.notify_all()

    def before_reuse(self, blocks) -> None:
        """`blocks` (just evicted from the device pool) are about to be overwritten (O1)."""
        for b in blocks:
            job = self.pending.get(b.block_id)
            if job is not None:
                self._run(job)

    def revive(self, pool, hashes: list[bytes], limit: int) -> list:
        """Device blocks holding the leading `hashes` found in the host or disk tier (at most
        `limit`), loaded and cached; free in the pool (ref 0), as a device hit is."""
        plan = []
        for h in hashes[:max(limit, 0)]:
            tier = HOST if self.host is not None and h in self.host else \
                DISK if self.disk is not None and h in self.disk else None
            if tier is None or pool.lookup(h) is not None or not self.costs.worth(tier):
                break
            plan.append(tier)
        if not plan:
            return []
        blocks = pool.allocate(len(plan))
        loaded = []
        for h, tier, b in zip(hashes, plan, blocks):
            if not self._load(h, tier, b.block_id):
                break
            loaded.append(b)
        pool.cache_all(loaded, hashes[:len(loaded)])
        pool.free(reversed(blocks))
        self.stored(loaded)                 # a disk hit goes up to the host tier
        return loaded

    def on_step(self, duration_s: float, tokens: dict) -> None:
        self.costs.observe_step(duration_s, tokens)

    def _load(self, h: bytes, tier: str, block_id: int) -> bool:
        t0 = time.perf_counter()
        dst_kv = self.kv_cache[:, :, block_id]
        dst_sc = self.kv_scales[:, :, block_id] if self.kv_scales is not None else None
        if tier == HOST:
            slot = self.host.pin(h)
            if slot is None:
                return False
            try:
                self._put(dst_kv, dst_sc, *self.host.views(slot))
            finally:
                self.host.unpin(slot)
        else:
            got = self.disk.read(h)
            if got is None:
                return False
            self._put(dst_kv, dst_sc, *got)
        dt = time.perf_counter() - t0
        self.costs.observe_load(tier, dt)
        self._count(tier, "in", dt, hit=True)
        return True

    @staticmethod
    def _put(dst_kv, dst_sc, kv, sc) -> None:
        dst_kv.copy_(kv)
        if dst_sc is not None:
            dst_sc.copy_(sc)

    # -- copier and disk threads ----------------------------------------------------------
    def _loop(self, queue: deque, work) -> None:
        while True:
            with self._cv:
                while not queue and not self._stop:
                    self._cv.wait()
                if self._stop:
                    return
                item = queue.popleft()
                self._busy += 1
            try:
                work(item)
            except Exception:
                log.exception("KV offload: %s failed", work.__name__)
            finally:
                with self._cv:
                    self._busy -= 1
                    self._cv.notify_all()

    def _run(self, job: _Copy) -> None:
        with job.lock:
            if job.done:
                return
            try:
                self._copy_down(job)
            finally:
                job.done = True
                with self._cv:
                    if self.pending.get(job.block_id) is job:
                        del self.pending[job.block_id]
                    self._cv.notify_all()

    def _copy_down(self, job: _Copy) -> None:
        b, h = job.block_id, job.block_hash
        src_kv = self.kv_cache[:, :, b]
        src_sc = self.kv_scales[:, :, b] if self.kv_scales is not None else None
        if self.host is not None and h not in self.host:
            t0 = time.perf_counter()
            slot, victim = self.host.reserve_evicting()
            if slot is None:
                self._drop()
            else:
                if victim is not None:
                    self._spill(victim, *self.host.views(slot))     # before it is refilled
                self._copy(*self.host.views(slot), src_kv, src_sc, job.event)
                self.host.commit(slot, h)
                self._count(HOST, "out", time.perf_counter() - t0)
        if self.host is None or h not in self.host:     # no host copy: straight to the disk
            self._spill(h, src_kv, src_sc, job.event)   # (else it goes when the host lets it go)

    def _spill(self, h: bytes, kv, sc, event=None) -> None:
        """Queue block `h` (its payload `kv`, `sc`, copied here to a staging buffer first)
        for the disk thread, unless the disk holds it or has no tier; a full queue drops it."""
        if self.disk is None or h in self.disk:
            return
        with self._cv:
            if len(self._writes) >= self.disk_queue_blocks:
                self._drop()
                return
        stage_kv = torch.empty(self.layout.shape, dtype=self.layout.dtype)
        stage_sc = torch.empty(self.layout.scale_shape) if sc is not None else None
        self._copy(stage_kv, stage_sc, kv, sc, event)
        if self.stream is not None:
            self.stream.synchronize()       # the staging copy is read by the disk thread
        with self._cv:                      # again: the engine thread may spill beside the copier
            if len(self._writes) >= self.disk_queue_blocks:
                self._drop()
                return
            self._writes.append((h, stage_kv, stage_sc))
            self._cv.notify_all()

    def _copy(self, kv, sc, src_kv, src_sc, event) -> None:
        if self.stream is None:
            self._put(kv, sc, src_kv, src_sc)
            return
        with torch.cuda.stream(self.stream):
            if event is not None:
                self.stream.wait_event(event)
            kv.copy_(src_kv, non_blocking=True)
            if sc is not None:
                sc.copy_(src_sc, non_blocking=True)
        self.stream.synchronize()

    def _write(self, item) -> None:
        h, kv, sc = item                    # a staging copy: no host slot stays pinned
        t0 = time.perf_counter()
        if self.disk.write(h, kv, sc):
            self._count(DISK, "out", time.perf_counter() - t0)

    # -- bookkeeping ------------------------------------------------------------------------
    def _touch(self, h: bytes) -> None:
        for tier in (self.host, self.disk):
            if tier is not None:
                tier.touch(h)

    def _drop(self) -> None:
        with self._stats:
            self.dropped += 1

    def _count(self, tier: str, direction: str, seconds: float, hit: bool = False) -> None:
        with self._stats:
            self.bytes[tier, direction] += self.layout.nbytes
            self.seconds[tier, direction] += seconds
            if hit:
                self.hits[tier] += 1

    def stats(self, device_blocks: int = 0) -> TierStats:
        blocks = {DEVICE: device_blocks, HOST: len(self.host) if self.host is not None else 0,
                  DISK: len(self.disk) if self.disk is not None else 0}
        with self._stats:
            return TierStats(blocks, dict(self.hits), dict(self.bytes), dict(self.seconds),
                             self.dropped)

    def flush(self, timeout_s: float = 30.0) -> bool:
        """Wait until every queued copy and write is done (O2); False at the deadline."""
        deadline = time.monotonic() + timeout_s
        with self._cv:
            while self._copies or self._writes or self._busy or self.pending:
                left = deadline - time.monotonic()
                if left <= 0 or self._stop:
                    return False
                self._cv.wait(left)
        return True

    def _spill_host(self, deadline: float) -> None:
        """Write the host tier's blocks the disk lacks down to it, oldest first (the disk's
        LRU order after a restart follows the host's), on this thread, until `deadline`."""
        if self.host is None or self.disk is None:
            return
        with self.host.lock:
            hashes = [h for h in self.host.lru if h not in self.disk]
        for n, h in enumerate(hashes):
            if time.monotonic() > deadline:
                log.warning("KV offload: %d host blocks not written to disk at close (deadline)",
                            len(hashes) - n)
                return
            if (slot := self.host.pin(h)) is not None:
                try:
                    self._write((h, *self.host.views(slot)))
                finally:
                    self.host.unpin(slot)

    def check(self) -> None:
        """O2 and the tiers' invariants; call after flush()."""
        assert not self.pending and not self._copies and not self._writes, "copies in flight"
        if self.host is not None:
            self.host.check()
            assert not any(self.host.pins), "a host slot is still pinned"
        if self.disk is not None:
            self.disk.check()

    def close(self, timeout_s: float = 10.0) -> None:
        """Finish the queued copies and writes (bounded by `timeout_s`), stop the threads."""
        if self._stop:
            return
        deadline = time.monotonic() + timeout_s
        if not self.flush(timeout_s):
            log.warning("KV offload: copies still queued at close were dropped")
        self._spill_host(deadline)
        with self._cv:
            self._stop = True
            self._cv.notify_all()
        for t in self._threads:
            t.join(timeout_s)
        if self.disk is not None:
            self.disk.close()


def attach(kv, runner, config) -> OffloadManager | None:
    """The tiers --kv-offload-host-gb / --kv-offload-disk ask for, under `kv` (a
    KVCacheManager) over `runner`'s cache; None when both are off."""
    cc = config.cache
    if not cc.kv_offload_host_gb and not cc.kv_offload_disk:
        return None
    if not cc.enable_prefix_caching:
        log.warning("KV offload tiers need the prefix cache: off with --no-enable-prefix-caching")
        return None
    layout = BlockLayout.of(runner.kv_cache, runner.kv_scales, **layout_key(config, runner))
    host = disk = None
    if cc.kv_offload_host_gb:
        slots = int(cc.kv_offload_host_gb * 2**30) // layout.nbytes
        if slots < 1:
            raise ValueError(f"--kv-offload-host-gb {cc.kv_offload_host_gb} holds no KV block "
                             f"({layout.nbytes} bytes)")
        host = HostTier(layout, slots, kv.events, pinned=runner.kv_cache.device.type == "cuda")
    if cc.kv_offload_disk:
        disk = DiskTier(cc.kv_offload_disk, layout, int(cc.kv_offload_disk_gb * 2**30), kv.events)
    log.info("KV offload: host tier %s, disk tier %s (blocks of %d bytes)",
             f"{host.num_slots} blocks" if host is not None else "off",
             f"{disk.dir} ({cc.kv_offload_disk_gb} GiB)" if disk is not None else "off", layout.nbytes)
    mgr = OffloadManager(runner.kv_cache, runner.kv_scales, cc.block_size, host, disk)
    kv.attach_offload(mgr)
    return mgr
