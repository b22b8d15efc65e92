"""A worker's prompt cost at its warm-up (services/prefill_cost.py): the first start times
the long and the short prompt and seeds the prefill admission with them; the next start with
the same model, engine config, threads and role takes those timings from the build cache
(only the tiny prompt runs), the admission's cost the same; other threads, the other role or
a damaged entry measure again."""
from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest
import torch

from engine import build_cache
from engine.config import EngineConfig, EngineOptions
from engine.tiny_model import ensure_default_model
from services import prefill_cost as wu, worker_server
from prefill_worker.admission import PrefillAdmission


@pytest.fixture
def engine(tmp_path, monkeypatch):
    """A stand-in AsyncEngine of the tiny model's config, whose warm-up requests are counted
    (tokens) and take 1 ms + 0.1 ms a token; the build cache in a fresh folder."""
    monkeypatch.setattr(build_cache, "cache_dir", lambda: tmp_path / "cache")
    ran = []

    async def fake(ae, prefill_only, tokens=0):
        ran.append(tokens)
        return 1e-3 + 1e-4 * (tokens or 4) + (0 if prefill_only else 1e-3)
    monkeypatch.setattr(worker_server, "warm_up", fake)
    config = EngineConfig.build(ensure_default_model(), EngineOptions())
    ae = SimpleNamespace(max_model_len=4096, block_size=16, engine=SimpleNamespace(config=config),
                         stats=lambda: SimpleNamespace(num_total_blocks=1024))
    return ae, ran


def _start(ae) -> tuple[float, float]:
    """A prefill worker's start (PrefillRole.warm_up): the admission's cost."""
    admission = PrefillAdmission(8192)
    samples, _cached = asyncio.run(wu.measure(ae, True))
    admission.seed(samples)
    return admission.cost()


def _remember(admission, ae) -> None:
    """A prefill worker's drain."""
    if admission.num_samples >= wu.MIN_CALLS:
        wu.remember(ae, True, admission.estimate)


def test_the_second_start_takes_the_seed_from_the_cache(engine, monkeypatch):
    ae, ran = engine
    first = _start(ae)
    assert ran == [0, wu.WARM_UP_LONG_TOKENS, wu.WARM_UP_SHORT_TOKENS]
    assert first == pytest.approx((1e-3, 1e-4))
    ran.clear()
    assert _start(ae) == pytest.approx(first) and ran == [0]      # only the tiny prompt
    threads = torch.get_num_threads()
    monkeypatch.setattr(torch, "get_num_threads", lambda: threads + 1)
    ran.clear()
    _start(ae)
    assert ran == [0, wu.WARM_UP_LONG_TOKENS, wu.WARM_UP_SHORT_TOKENS]   # other threads


def test_a_damaged_entry_is_measured_again(engine):
    ae, ran = engine
    _start(ae)
    entry, = (build_cache.cache_dir() / "built").glob(f"{wu.KIND}-*")
    entry.write_text(entry.read_text().replace("256", "255"))
    ran.clear()
    assert _start(ae) == pytest.approx((1e-3, 1e-4))
    assert ran == [0, wu.WARM_UP_LONG_TOKENS, wu.WARM_UP_SHORT_TOKENS]


def test_the_drain_makes_a_slow_cached_seed_faster_never_slower(engine):
    ae, ran = engine
    admission = PrefillAdmission(8192)
    admission.seed(asyncio.run(wu.measure(ae, True))[0])   # measured: 1 ms + 0.1 ms a token
    admission._samples.extend([(64, 1e-3 + 64e-5)] * (wu.MIN_CALLS - 1))   # 10x faster a token
    _remember(admission, ae)                      # too few calls: the entry stays
    assert _start(ae) == pytest.approx((1e-3, 1e-4))
    admission._samples.append((16, 1e-3 + 16e-5))
    _remember(admission, ae)
    fixed, per_token = _start(ae)
    assert fixed <= 1e-3 + 1e-9 and per_token < 0.9e-4     # the calls' faster line, in part
    slow = PrefillAdmission(8192)
    slow.seed([(256, 1.0), (8, 0.5)])
    slow._samples.extend([(64, 1.0)] * wu.MIN_CALLS)
    _remember(slow, ae)                           # slower calls: the faster seed stays
    assert _start(ae) == pytest.approx((fixed, per_token))


def test_a_decode_worker_measures_its_own_line_to_the_first_token(engine):
    """The decode role's timings are its own (a decode worker's engine differs), cached apart
    from the prefill role's; the line is fitted from them as the admission's is."""
    ae, ran = engine
    _start(ae)
    ran.clear()
    samples, cached = asyncio.run(wu.measure(ae, False))
    assert not cached and ran == [0, wu.WARM_UP_LONG_TOKENS, wu.WARM_UP_SHORT_TOKENS]
    assert wu.fit(samples) == pytest.approx((2e-3, 1e-4))
    ran.clear()
    assert asyncio.run(wu.measure(ae, False)) == (samples, True) and ran == [0]
    assert asyncio.run(wu.measure(ae, True))[1] and ran == [0, 0]   # neither evicted the other
    proto = wu.to_proto(wu.fit(samples))
    assert (proto.fixed_s, proto.per_token_s) == pytest.approx((2e-3, 1e-4))
    assert wu.to_proto(None) is None


def test_fit_is_the_least_squares_line_clamped():
    assert wu.fit([]) is None
    assert wu.fit([(100, 0.2), (100, 0.4)]) == pytest.approx((0.0, 3e-3))    # one length
    assert wu.fit([(8, 0.01), (256, 0.258), (128, 0.13)]) == pytest.approx((0.002, 1e-3), rel=1e-2)
    fixed, per_token = wu.fit([(10, 0.0), (100, 0.3), (200, 0.7)])     # intercept < 0: origin
    assert fixed == 0.0 and per_token == pytest.approx((100 * 0.3 + 200 * 0.7) / (100 + 100**2 + 200**2))
    assert wu.fit([(8, 0.5), (256, 0.1)]) == (pytest.approx(0.3 - 132 * 1e-7), 1e-7)  # falls: flat


def test_two_workers_time_one_after_the_other(engine, monkeypatch, tmp_path, caplog):
    """Two warm-ups timing at once (a prefill and a decode worker of one `pdserve up`)
    take turns; a slot held past the wait times anyway, and says so."""
    ae, _ = engine
    monkeypatch.setattr(wu, "cache_dir", lambda: tmp_path / "cache")
    spans = []

    async def slow(ae, prefill_only, tokens=0):
        t0 = asyncio.get_running_loop().time()
        await asyncio.sleep(0.05)
        spans.append((t0, asyncio.get_running_loop().time()))
        return 1e-3 + 1e-4 * (tokens or 4)
    monkeypatch.setattr(worker_server, "warm_up", slow)

    async def both():
        return await asyncio.gather(wu.measure(ae, True), wu.measure(ae, False))
    asyncio.run(both())
    timed = sorted(spans)[2:]                 # the two tiny prompts run outside the slot
    pairs = [timed[i:i + 2] for i in (0, 2)]
    assert [b[0] >= a[1] for a, b in pairs] == [True, True]      # each worker's two in a row
    assert pairs[1][0][0] >= pairs[0][1][1]                      # then the other's

    import fcntl
    with open(tmp_path / "cache" / "warm-up-timing.lock", "a") as other:
        fcntl.flock(other, fcntl.LOCK_EX)

        async def held():
            t0 = asyncio.get_running_loop().time()
            async with wu.timing_lock(0.1):
                return asyncio.get_running_loop().time() - t0
        assert 0.1 <= asyncio.run(held()) < 5
    assert "another worker's timing still runs" in caplog.text
