"""The prefill worker's warm-up (prefill_worker/warm_up.py): the first start times the long
and the short prompt and seeds the admission with them; the next start with the same model,
engine config and threads takes those timings from the build cache (only the tiny prompt
runs), the admission's cost the same; other threads or a damaged entry measure again."""
from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest
import torch

from engine import build_cache
from engine.config import EngineConfig, EngineOptions
from engine.tiny_model import ensure_default_model
from prefill_worker import warm_up as wu
from prefill_worker.admission import PrefillAdmission


@pytest.fixture
def engine(tmp_path, monkeypatch):
    """A stand-in AsyncEngine of the tiny model's config, whose warm-up requests are counted
    (tokens) and take 1 ms + 0.1 ms a token; the build cache in a fresh folder."""
    monkeypatch.setattr(build_cache, "cache_dir", lambda: tmp_path / "cache")
    ran = []

    async def fake(ae, prefill_only, tokens=0):
        assert prefill_only
        ran.append(tokens)
        return 1e-3 + 1e-4 * (tokens or 4)
    monkeypatch.setattr(wu.worker_server, "warm_up", fake)
    config = EngineConfig.build(ensure_default_model(), EngineOptions())
    ae = SimpleNamespace(max_model_len=4096, block_size=16, engine=SimpleNamespace(config=config),
                         stats=lambda: SimpleNamespace(num_total_blocks=1024))
    return ae, ran


def _start(ae) -> tuple[float, float]:
    admission = PrefillAdmission(8192)
    asyncio.run(wu.warm_up(admission, ae))
    return admission.cost()


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
    asyncio.run(wu.warm_up(admission, ae))          # measured: 1 ms + 0.1 ms a token
    admission._samples.extend([(64, 1e-3 + 64e-5)] * (wu.MIN_CALLS - 1))   # 10x faster a token
    wu.remember(admission, ae)                      # too few calls: the entry stays
    assert _start(ae) == pytest.approx((1e-3, 1e-4))
    admission._samples.append((16, 1e-3 + 16e-5))
    wu.remember(admission, ae)
    fixed, per_token = _start(ae)
    assert fixed <= 1e-3 + 1e-9 and per_token < 0.9e-4     # the calls' faster line, in part
    slow = PrefillAdmission(8192)
    slow.seed([(256, 1.0), (8, 0.5)])
    slow._samples.extend([(64, 1.0)] * wu.MIN_CALLS)
    wu.remember(slow, ae)                           # slower calls: the faster seed stays
    assert _start(ae) == pytest.approx((fixed, per_token))
