"""The KV offload tiers without a model (engine/kv_tiers.py, engine/kv_offload.py): random
requests over a tiny block pool with both tiers under it, every block's KV a function of its
hash, so a revived block that is not byte-identical to what was copied down (a copy that
raced the block's reuse, a wrong slot, a wrong file) is caught; after every few operations
the invariants: sizes bounded, each tier's hashes exactly the event log's, no pin left.
Then the tiers' LRU order each against a reference OrderedDict."""
import random
from collections import OrderedDict

import pytest
import torch

from engine.kv_cache_manager import KVCacheManager
from engine.kv_events import DISK, HOST, KvEventLog
from engine.kv_offload import OffloadManager
from engine.kv_tiers import BlockLayout, DiskTier, HostTier
from engine.request import Request
from engine.sampling_params import SamplingParams

pytestmark = pytest.mark.timeout(120)
L, P, N, BS, H, D = 2, 2, 8, 4, 1, 3


def payload(h: bytes, dtype=torch.float32) -> torch.Tensor:
    g = torch.Generator().manual_seed(int.from_bytes(h[:8], "little"))
    x = torch.randn((L, P, BS, H, D), generator=g) * 50
    return x.to(dtype)


def scale_of(h: bytes) -> torch.Tensor:
    return torch.full((L, P, H), float(h[0]) + 0.5)


def make(tmp_path, dtype=torch.float32, host_slots=5, disk_blocks=6, queue=256):
    kv_cache = torch.zeros((L, P, N, BS, H, D), dtype=dtype)
    scales = None if dtype == torch.float32 else torch.zeros((L, P, N, H))
    kv = KVCacheManager(N, BS)
    layout = BlockLayout.of(kv_cache, scales, model="m")
    host = HostTier(layout, host_slots, kv.events, pinned=False) if host_slots else None
    disk = DiskTier(tmp_path / "disk", layout, disk_blocks * (layout.nbytes + 300), kv.events) \
        if disk_blocks else None
    mgr = OffloadManager(kv_cache, scales, BS, host, disk, queue_blocks=queue)
    kv.attach_offload(mgr)
    return kv, mgr, kv_cache, scales


def check_all(kv, mgr):
    assert mgr.flush(30)
    mgr.check()
    kv.pool.check()
    if mgr.host is not None:
        assert len(mgr.host) <= mgr.host.num_slots
    if mgr.disk is not None:
        assert mgr.disk.bytes <= mgr.disk.capacity


def one_request(kv, kv_cache, scales, rng, i, dtype):
    """A prompt of 1-3 shared leading blocks plus its own; its hits must hold the very KV
    written for their hashes; the rest is 'computed' (written) and cached."""
    base = rng.randrange(4)
    ids = [base * 100 + t for t in range(rng.randrange(1, 4) * BS)] + \
        [rng.randrange(1000, 2000) for _ in range(rng.randrange(0, 2 * BS))] + [1]
    req = Request(f"r{i}", ids, SamplingParams(), 1)
    hits, n = kv.get_computed_blocks(req)
    for b, h in zip(hits, req.block_hashes):
        assert torch.equal(kv_cache[:, :, b.block_id], payload(h, dtype)), "revived KV differs"
        if scales is not None:
            assert torch.equal(scales[:, :, b.block_id], scale_of(h))
    if not kv.allocate_slots(req, req.num_tokens - n, hits):
        return None
    hashes = kv.block_hashes(req, req.num_tokens // BS)
    for j in range(len(hits), len(hashes)):
        kv_cache[:, :, req.block_ids[j]] = payload(hashes[j], dtype)
        if scales is not None:
            scales[:, :, req.block_ids[j]] = scale_of(hashes[j])
    req.num_computed_tokens = req.num_tokens
    kv.cache_blocks(req, req.num_tokens)
    return req


@pytest.mark.parametrize("dtype,host_slots,disk_blocks", [
    (torch.float32, 5, 6), (torch.int8, 5, 6), (torch.float32, 0, 6), (torch.float32, 6, 0)])
def test_random_operations_keep_every_invariant_and_revive_identical_kv(
        tmp_path, dtype, host_slots, disk_blocks):
    kv, mgr, kv_cache, scales = make(tmp_path, dtype, host_slots, disk_blocks)
    rng, live = random.Random(7), []
    for i in range(150):
        req = one_request(kv, kv_cache, scales, rng, i, dtype)
        if req is not None:
            live.append(req)
        while live and (len(live) > 2 or rng.random() < 0.5):
            kv.free(live.pop(rng.randrange(len(live))))
        if i % 10 == 9:
            check_all(kv, mgr)
    for req in live:
        kv.free(req)
    check_all(kv, mgr)
    assert kv.pool.num_free_blocks == N
    st = mgr.stats()
    lower = (HOST,) if host_slots else (DISK,)
    assert sum(st.hits.get(t, 0) for t in lower) > 0, st      # the tiers were really used
    mgr.close()


def test_a_copy_still_queued_when_its_block_is_reused_runs_first(tmp_path):
    """The copier is held up: eviction does the copy itself (O1), never losing the KV."""
    kv, mgr, kv_cache, scales = make(tmp_path, host_slots=8, disk_blocks=0)
    with mgr._cv:                             # the copier cannot take a job while we hold it
        rng = random.Random(1)
        reqs = [one_request(kv, kv_cache, scales, rng, i, torch.float32) for i in range(3)]
        for r in reqs:
            if r is not None:
                kv.free(r)
        assert mgr.pending
        blocks = kv.pool.allocate(N)          # evicts every cached block, copies pending
        expected = {h for h in kv.events.held(HOST)}
    assert not mgr.pending and expected
    for h in expected:
        slot = mgr.host.pin(h)
        assert torch.equal(mgr.host.views(slot)[0], payload(h))
        mgr.host.unpin(slot)
    kv.pool.free(blocks)
    check_all(kv, mgr)
    mgr.close()


def cache_prompt(kv, kv_cache, ids, rid):
    """A prompt of whole blocks computed (its KV written from its hashes), cached and freed;
    its hashes, and how many of its blocks the lookup found."""
    req = Request(rid, ids + [1], SamplingParams(), 1)
    hits, n = kv.get_computed_blocks(req)
    for b, h in zip(hits, req.block_hashes):
        assert torch.equal(kv_cache[:, :, b.block_id], payload(h)), "revived KV differs"
    assert kv.allocate_slots(req, req.num_tokens - n, hits)
    hashes = kv.block_hashes(req, len(ids) // BS)
    for j in range(len(hits), len(hashes)):
        kv_cache[:, :, req.block_ids[j]] = payload(hashes[j])
    req.num_computed_tokens = req.num_tokens
    kv.cache_blocks(req, req.num_tokens)
    kv.free(req)
    return hashes, len(hits)


def test_the_disk_gets_what_the_host_lets_go_and_the_rest_at_close(tmp_path):
    """Host -> disk is write-back: while the host tier has room no file is written; a block
    the host evicts is written from its slot before the slot is refilled (a revival from
    the disk returns its very KV); close() writes what the host still holds."""
    kv, mgr, kv_cache, scales = make(tmp_path, host_slots=6, disk_blocks=40)
    prompts = [[p * 1000 + t for t in range(2 * BS)] for p in range(6)]   # 2 blocks each
    first = [cache_prompt(kv, kv_cache, ids, f"p{i}")[0] for i, ids in enumerate(prompts[:3])]
    check_all(kv, mgr)
    assert len(mgr.host) == 6 and len(mgr.disk) == 0      # the host holds all: no file
    assert not list(mgr.disk.dir.glob("*.kvb"))
    for i, ids in enumerate(prompts[3:]):                  # 6 more blocks: the first 6 go down
        cache_prompt(kv, kv_cache, ids, f"q{i}")
    check_all(kv, mgr)
    spilled = {h for hs in first for h in hs}
    assert set(mgr.disk.lru) == spilled and not spilled & set(mgr.host.lru)
    kv.pool.free(kv.pool.allocate(N))                      # the device pool forgets them all
    hashes, hit = cache_prompt(kv, kv_cache, prompts[0], "again")
    assert hit == 2 and mgr.stats().hits.get(DISK) == 2    # revived from the disk, identical
    check_all(kv, mgr)
    held = set(mgr.host.lru)
    mgr.close()                                            # the host's blocks written down
    assert held <= {bytes.fromhex(f.stem) for f in mgr.disk.dir.glob("*.kvb")}


def test_host_tier_lru_order(tmp_path):
    events = KvEventLog()
    layout = BlockLayout.of(torch.zeros((L, P, N, BS, H, D)), None, model="m")
    host, ref = HostTier(layout, 3, events, pinned=False), OrderedDict()
    rng = random.Random(3)
    for step in range(200):
        h = bytes([rng.randrange(8)]) * 16
        if rng.random() < 0.3:
            host.touch(h)
            if h in ref:
                ref.move_to_end(h)
        elif h not in host:
            slot = host.reserve()
            if len(ref) == 3:
                ref.popitem(last=False)
            host.commit(slot, h)
            ref[h] = True
        assert list(host.lru) == list(ref), step
        host.check()
    pinned = host.pin(next(iter(host.lru)))   # the oldest, pinned: the next-oldest goes
    second = list(host.lru)[0]
    host.commit(host.reserve(), b"new" * 5 + b"x")
    assert pinned in host.lru.values() and second not in host.lru
    host.unpin(pinned)
    host.check()


def test_disk_tier_lru_bound_restart_and_corruption(tmp_path):
    events = KvEventLog()
    layout = BlockLayout.of(torch.zeros((L, P, N, BS, H, D)), None, model="m")
    size = layout.nbytes + 300
    disk = DiskTier(tmp_path, layout, 3 * size, events)
    hs = [bytes([i]) * 16 for i in range(5)]
    for h in hs[:3]:
        disk.write(h, payload(h), None)
    disk.touch(hs[0])                         # order now 1, 2, 0
    disk.write(hs[3], payload(hs[3]), None)   # evicts 1
    assert list(disk.lru) == [hs[2], hs[0], hs[3]]
    disk.check()
    disk.close()
    # a restart with the same key reuses them (and reports them); another key does not
    again = KvEventLog()
    disk = DiskTier(tmp_path, layout, 3 * size, again)
    assert set(disk.lru) == {hs[2], hs[0], hs[3]} and again.held(DISK) == set(disk.lru)
    assert torch.equal(disk.read(hs[0])[0], payload(hs[0]))
    f = disk.path(hs[3])                      # a flipped payload byte: deleted at load
    raw = bytearray(f.read_bytes())
    raw[-1] ^= 0xFF
    f.write_bytes(bytes(raw))
    assert disk.read(hs[3]) is None and not f.exists() and hs[3] not in again.held(DISK)
    disk.close()
    other = BlockLayout.of(torch.zeros((L, P, N, BS, H, D)), None, model="another")
    log3 = KvEventLog()
    disk = DiskTier(tmp_path, other, 3 * size, log3)
    assert not disk.lru and not list(disk.dir.glob("*.kvb")) and not log3.held(DISK)
    disk.close()


def test_one_directory_serves_several_workers_each_its_own_slot(tmp_path):
    layout = BlockLayout.of(torch.zeros((L, P, N, BS, H, D)), None, model="m")
    a = DiskTier(tmp_path, layout, 1 << 20, KvEventLog())
    b = DiskTier(tmp_path, layout, 1 << 20, KvEventLog())
    assert a.dir != b.dir
    a.close()
    c = DiskTier(tmp_path, layout, 1 << 20, KvEventLog())
    assert c.dir == a.dir
    b.close()
    c.close()


def test_the_flags_reach_both_workers_and_pdserve_up():
    """K3's flags: on `pdserve prefill|decode` (the engine's options, flattened) and handed on
    by `pdserve up` to every worker (config_argv of its engine options)."""
    import argparse

    from decode_worker.config import DecodeWorkerConfig
    from engine.config import EngineOptions
    from prefill_worker.config import PrefillWorkerConfig
    from services.cli_args import config_argv, config_from_args, dataclass_args
    for cls in (PrefillWorkerConfig, DecodeWorkerConfig):
        p = argparse.ArgumentParser()
        dataclass_args(p, cls)
        cfg = config_from_args(cls, p.parse_args(["--model", "m", "--kv-offload-host-gb", "1.5",
                                                  "--kv-offload-disk", "/d", "--kv-offload-disk-gb", "8"]))
        c = cfg.engine.cache
        assert (c.kv_offload_host_gb, c.kv_offload_disk, c.kv_offload_disk_gb) == (1.5, "/d", 8.0)
    argv = config_argv(EngineOptions.of(kv_offload_host_gb=2.0, kv_offload_disk="/d"))
    assert argv == ["--kv-offload-host-gb", "2.0", "--kv-offload-disk", "/d"]
    with pytest.raises(ValueError, match="kv_offload_host_gb"):
        EngineOptions.of(kv_offload_host_gb=-1)


def test_revival_is_declined_when_measured_slower_and_measured_again_now_and_then():
    from engine.kv_tiers import PROBE_EVERY, TierCosts
    c = TierCosts(block_size=16)
    assert c.worth(DISK)                        # nothing measured: try it
    c.observe_step(0.016, {"a": 16})            # 1 ms per token: 16 ms a block
    c.observe_load(DISK, 0.004)
    c.observe_step(0.020, {"a": 8, "b": 1})     # the 4 ms load is not compute
    assert abs(c.compute_s_per_token - (0.001 + 0.2 * ((0.016 / 9) - 0.001))) < 1e-12
    assert c.worth(DISK)
    c.observe_step(0.005, {"a": 1, "b": 1})     # a decode step measures nothing
    for _ in range(60):
        c.observe_load(DISK, 0.5)               # the disk became slow
    c.loading_s = 0.0
    answers = [c.worth(DISK) for _ in range(2 * PROBE_EVERY)]
    assert answers.count(True) == 2 and answers[PROBE_EVERY - 1]
