"""The offload tiers in a real engine (engine/kv_offload.py under LLMEngine): a prompt
evicted from a tiny device pool is revived from host memory or disk, so only its suffix is
computed and its greedy tokens are those of the first run; a new engine over the same disk
directory (a restart) serves it computing only the new suffix, equal to an engine without
tiers (with a host tier too: the disk written back as the host evicts and at close; on the
default model with a 3000-token prompt as well); a corrupt or foreign file is ignored and deleted; aborted requests leave no block and
no pin in any tier; the worker's /metrics collector reports the tiers."""
import pytest
import torch
from prometheus_client import CollectorRegistry

from engine.llm_engine import LLMEngine
from engine.sampling_params import SamplingParams
from engine.tiny_model import make_tiny_model
from services.kv_tier_metrics import KvTierMetrics

pytestmark = pytest.mark.timeout(300)
torch.set_num_threads(1)
GREEDY = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
P = [3 + i % 50 for i in range(64)]                   # 4 blocks of 16
OTHERS = [[7 + (i * 13 + j) % 90 for j in range(60)] for i in range(4)]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return str(make_tiny_model(tmp_path_factory.mktemp("tiny") / "m"))


class Computed:
    """A step observer: the tokens each request computed."""

    def __init__(self):
        self.tokens = {}

    def on_step(self, duration_s, tokens):
        for rid, n in tokens.items():
            self.tokens[rid] = self.tokens.get(rid, 0) + n


def engine(model_dir, **opts):
    seen = Computed()
    return LLMEngine.from_model_dir(model_dir, num_blocks=opts.pop("num_blocks", 12), block_size=16,
                                    step_observers=[seen], **opts), seen


def run(e, rid, prompt):
    e.add_request(rid, prompt, GREEDY)
    while e.has_unfinished_requests():
        for o in e.step():
            if o.finished and o.request_id == rid:
                out = o
    return out


def evict_and_rerun(e, prompt=P, others=OTHERS):
    first = run(e, "first", prompt)
    for i, other in enumerate(others):
        run(e, f"other{i}", other)
    return first, run(e, "again", prompt)


def metric(registry, name, **labels):
    return registry.get_sample_value("pdserve:" + name, {"role": "prefill", **labels})


@pytest.mark.parametrize("tier,opts", [("host", {"kv_offload_host_gb": 0.01}),
                                       ("disk", {"kv_offload_disk": "DIR"})])
def test_an_evicted_prefix_is_revived_not_recomputed(model_dir, tmp_path, tier, opts):
    opts = {k: str(tmp_path) if v == "DIR" else v for k, v in opts.items()}
    e, seen = engine(model_dir, **opts)
    reg = CollectorRegistry()
    KvTierMetrics("prefill", reg).bind(e)
    first, again = evict_and_rerun(e)
    assert first.num_cached_tokens == 0 and again.num_cached_tokens == 48   # 3 blocks: leave one
    assert seen.tokens["again"] == 64 - 48 + GREEDY.max_tokens - 1          # only the suffix
    assert again.token_ids == first.token_ids
    assert metric(reg, "kv_tier_hits_total", tier=tier) == 3
    assert metric(reg, "kv_tier_bytes_total", tier=tier, direction="in") > 0
    assert metric(reg, "kv_tier_bytes_total", tier=tier, direction="out") > 0
    assert metric(reg, "kv_tier_seconds_total", tier=tier, direction="in") > 0
    assert metric(reg, "kv_tier_blocks", tier=tier) > 0
    assert e.offload.flush(30)
    e.offload.check()
    e.kv.pool.check()
    e.close()


def test_a_restart_reuses_the_disk_and_ignores_bad_files(model_dir, tmp_path):
    e, _ = engine(model_dir, kv_offload_disk=str(tmp_path))
    first = run(e, "first", P)
    e.close()                                  # flushes the writes, frees the directory
    files = sorted(tmp_path.glob("slot-0/*.kvb"))
    assert len(files) == 4
    (tmp_path / "slot-0" / ("ab" * 16 + ".kvb")).write_bytes(b"PDKVB1\n garbage")
    longer = P + [11 + i % 7 for i in range(20)]
    plain, _ = engine(model_dir)               # the path the tiers replace
    want = run(plain, "want", longer)
    e, seen = engine(model_dir, kv_offload_disk=str(tmp_path))
    assert not (tmp_path / "slot-0" / ("ab" * 16 + ".kvb")).exists()     # deleted at start
    assert len(e.kv_events.held("disk")) == 4
    got = run(e, "got", longer)
    assert got.num_cached_tokens == 64 and seen.tokens["got"] == 20 + GREEDY.max_tokens - 1
    assert got.token_ids == want.token_ids
    assert run(e, "p", P).token_ids == first.token_ids
    e.close()
    # a payload byte flipped in P's second block: that block and the rest are computed
    e, _ = engine(model_dir, kv_offload_disk=str(tmp_path))
    h1 = e.kv.block_hashes(e._make_request("x", P, GREEDY), 2)[1]
    f = tmp_path / "slot-0" / (h1.hex() + ".kvb")
    raw = bytearray(f.read_bytes())
    raw[-5] ^= 0x40
    f.write_bytes(bytes(raw))
    again = run(e, "again", P)
    assert again.num_cached_tokens == 16 and again.token_ids == first.token_ids
    assert e.offload.flush(30)
    e.offload.check()                          # the corrupt file is gone, and from the log
    e.close()


def test_with_a_host_tier_the_disk_is_written_at_close_and_serves_the_restart(model_dir, tmp_path):
    both = {"kv_offload_host_gb": 0.01, "kv_offload_disk": str(tmp_path)}
    e, _ = engine(model_dir, **both)
    first = run(e, "first", P)
    assert e.offload.flush(30)
    assert not list(tmp_path.glob("slot-0/*.kvb"))        # the host holds it: no file yet
    e.close()                                              # ... written down at close
    assert len(list(tmp_path.glob("slot-0/*.kvb"))) == 4
    e, seen = engine(model_dir, **both)
    again = run(e, "again", P)
    assert again.num_cached_tokens == 48 and seen.tokens["again"] == 16 + GREEDY.max_tokens - 1
    assert again.token_ids == first.token_ids
    assert e.offload.stats().hits["disk"] == 3
    e.close()


def test_aborted_requests_leave_nothing_in_any_tier(model_dir, tmp_path):
    e, _ = engine(model_dir, num_blocks=24, kv_offload_host_gb=0.002, kv_offload_disk=str(tmp_path),
                  max_num_batched_tokens=32)
    run(e, "warm", P)
    for i, other in enumerate(OTHERS):
        run(e, f"o{i}", other)
    for i in range(3):                          # P's prefix revived, then aborted mid-prompt
        e.add_request(f"a{i}", P + [i] * 40, SamplingParams(temperature=0.0, max_tokens=30,
                                                                ignore_eos=True))
    for _ in range(3):
        e.step()
    assert any(0 < r.num_computed_tokens < r.num_prompt_tokens for r in e.requests.values())
    for i in range(3):
        assert e.abort_request(f"a{i}")
    assert not e.requests and e.kv.num_free_blocks == 24 and not e.kv.req_blocks
    assert e.offload.flush(30)
    e.offload.check()                           # no pending copy, no pinned host slot
    e.kv.pool.check()
    e.close()


def test_the_default_model_revives_from_the_host_tier():
    """SmolLM2-135M (30 layers, 3 KV heads): the same revival, the same greedy tokens."""
    from pdserve.default_model import resolve_default_model
    d = str(resolve_default_model())
    e, seen = engine(d, num_blocks=8, kv_offload_host_gb=0.05)
    first, again = evict_and_rerun(e, others=OTHERS[:2])       # 8 blocks: two evict P
    assert e.offload.stats().hits == {"host": 3}
    assert again.num_cached_tokens == 48 and seen.tokens["again"] == 16 + GREEDY.max_tokens - 1
    assert again.token_ids == first.token_ids
    e.close()


def test_the_default_model_long_prompt_written_back_to_disk_serves_the_restart(default_model_dir, tmp_path):
    """SmolLM2-135M, a 3000-token prompt (188 blocks) through a host tier of ~28 blocks: the
    host's evictions write most of it to the disk during the run, close() the rest; after a
    restart the prompt and a new suffix compute only the suffix, with the greedy tokens of an
    engine without tiers."""
    d = str(default_model_dir)
    long = [1] + [100 + (i * 7919) % 40000 for i in range(2999)]
    longer = long + [200 + i for i in range(40)]
    both = {"kv_offload_host_gb": 0.01, "kv_offload_disk": str(tmp_path), "num_blocks": 200}
    e, _ = engine(d, **both)
    run(e, "first", long)
    assert e.offload.flush(60)
    on_disk = len(list(tmp_path.glob("slot-0/*.kvb")))
    host = len(e.offload.host)
    print(f"host tier {host} blocks, disk {on_disk} files after the run")
    assert host < 40 and on_disk >= 187 - host, (host, on_disk)   # written back as the host evicted
    e.close()
    assert len(list(tmp_path.glob("slot-0/*.kvb"))) == 187            # the rest at close
    plain, _ = engine(d, num_blocks=200)
    want = run(plain, "want", longer)
    plain.close()
    e, seen = engine(d, **both)
    got = run(e, "got", longer)
    assert got.num_cached_tokens == 187 * 16
    assert seen.tokens["got"] == len(longer) - 187 * 16 + GREEDY.max_tokens - 1
    assert got.token_ids == want.token_ids
    e.close()


def test_a_workers_metrics_carry_the_tier_series(model_dir):
    """What a worker process sets up (services/telemetry.py) exposes the tiers on /metrics."""
    from prometheus_client.exposition import generate_latest

    from services.telemetry import start_role_telemetry
    tel = start_role_telemetry("decode")
    e, _ = engine(model_dir, kv_offload_host_gb=0.01)
    tel.watch_steps(e)
    evict_and_rerun(e)
    text = generate_latest(tel.metrics.registry).decode()
    assert 'pdserve:kv_tier_hits_total{role="decode",tier="host"} 3.0' in text
    assert 'pdserve:kv_tier_blocks{role="decode",tier="disk"} 0.0' in text
    assert 'pdserve:kv_tier_bytes_total{direction="in",role="decode",tier="host"}' in text
    tel.close()
    e.close()


def test_a_peer_export_revives_an_offloaded_prefix_before_pinning_it(model_dir):
    # prefill_worker/peer_export.py's pin on a worker whose device pool evicted the prompt:
    # the blocks come back from the host tier with the KV the prompt computed
    from types import SimpleNamespace

    from engine.block_hash import prefix_block_hashes
    from prefill_worker.peer_export import PeerExport
    e, _ = engine(model_dir, kv_offload_host_gb=0.01)
    hashes = prefix_block_hashes(P, 16)
    run(e, "first", P)
    kv_before = torch.stack([e.kv_cache[:, :, e.kv.pool.lookup(h).block_id] for h in hashes])
    for i, other in enumerate(OTHERS):
        run(e, f"other{i}", other)
    assert e.kv.offload.flush()                                # the copies to the host are done
    assert e.kv.pool.lookup(hashes[0]) is None                 # evicted from the device pool
    export = PeerExport(SimpleNamespace(engine=e, block_size=16), None, "")
    blocks = export._pin(hashes)
    assert blocks is not None and len(blocks) == 4
    assert all(e.kv.pool.blocks[b].ref_cnt == 1 for b in blocks)
    assert torch.equal(torch.stack([e.kv_cache[:, :, b] for b in blocks]), kv_before)
    export._unpin(blocks)
    assert e.kv.num_held_blocks() == 0
    assert export._pin(prefix_block_hashes([1] * 32, 16)) is None   # held nowhere
    e.close()
