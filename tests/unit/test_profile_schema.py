"""sim.profile: the schema round trip, the version refusal, and the fits recovering known costs."""
from __future__ import annotations

import json
import random

import pytest

from sim import profile as prof


def test_round_trip_through_a_file(tmp_path):
    p = prof.example()
    path = tmp_path / "p.json"
    p.save(path)
    q = prof.Profile.load(path)
    assert q == p
    assert q.schema == prof.SCHEMA
    for n, c in ((16, 0), (300, 700), (2000, 0)):
        assert q.prefill_s(n, c) == pytest.approx(p.prefill_s(n, c))
    assert q.decode_s(7, 3000) == pytest.approx(p.decode_s(7, 3000))
    assert json.loads(path.read_text())["schema"] == "pdserve.profile/1"


def test_another_major_version_is_refused(tmp_path):
    d = prof.example().to_json()
    d["schema"] = "pdserve.profile/2"
    with pytest.raises(ValueError, match="not supported"):
        prof.Profile.from_json(d)
    d["schema"] = "pdserve.profile/1.3"       # a minor bump reads fine
    assert prof.Profile.from_json(d).schema == "pdserve.profile/1.3"
    d["schema"] = "something.else/1"
    with pytest.raises(ValueError, match="not a pdserve profile"):
        prof.Profile.from_json(d)
    (tmp_path / "bad.json").write_text("{oops")
    with pytest.raises(ValueError, match="not JSON"):
        prof.Profile.load(tmp_path / "bad.json")


def test_missing_fields_and_bad_points_are_named():
    d = prof.example().to_json()
    del d["gateway_s"]
    with pytest.raises(ValueError, match="gateway_s"):
        prof.Profile.from_json(d)
    d = prof.example().to_json()
    d["decode"][2]["seconds"] = -1.0
    with pytest.raises(ValueError, match=r"decode\[2\]\.seconds"):
        prof.Profile.from_json(d)


def _noisy(rng, value, rel):
    return value * (1.0 + rng.uniform(-rel, rel))


def test_prefill_fit_recovers_a_known_cost():
    rng = random.Random(1)
    a, b, c = 0.01, 0.004, 3e-6
    pts = [{"chunk_tokens": n, "cached_tokens": k,
            "seconds": _noisy(rng, a + b * n + c * n * (k + n / 2), 0.02)}
           for k in (0, 256, 1024, 2048) for n in (16, 32, 64, 128, 256, 512)]
    fa, fb, fc = prof.fit_prefill(pts)
    assert fb == pytest.approx(b, rel=0.05)
    assert fc == pytest.approx(c, rel=0.15)
    p = _with(prefill=pts)
    for n, k in ((100, 0), (512, 2048), (48, 700)):
        assert p.prefill_s(n, k) == pytest.approx(a + b * n + c * n * (k + n / 2), rel=0.05)


def test_decode_fit_recovers_a_known_cost():
    rng = random.Random(2)
    a, b, c = 0.02, 0.003, 1.5e-6
    pts = [{"batch": bs, "context_tokens": bs * ctx,
            "seconds": _noisy(rng, a + b * bs + c * bs * ctx, 0.02)}
           for bs in (1, 2, 4, 8, 16, 32) for ctx in (64, 512, 2048)]
    fa, fb, fc = prof.fit_decode(pts)
    assert fa == pytest.approx(a, rel=0.15)
    assert fb == pytest.approx(b, rel=0.15)
    assert fc == pytest.approx(c, rel=0.1)


def test_handover_fit_and_no_negative_costs():
    pts = [{"prompt_tokens": n, "seconds": 0.001 + 2e-5 * n} for n in (64, 256, 1024, 4096)]
    p = _with(handover=pts)
    assert p.handover_s(2048) == pytest.approx(0.001 + 2e-5 * 2048, rel=1e-6)
    assert p.handover_s(0) == 0.0
    # a cost that falls with work cannot be fitted by non-negative coefficients: no cost < 0
    falling = [{"batch": b, "context_tokens": 100 * b, "seconds": 0.1 - 0.005 * b}
               for b in (1, 2, 4, 8)]
    q = _with(decode=falling)
    assert all(c >= 0 for c in q.fits["decode"])
    assert q.decode_s(100, 10000) >= 0.0
    assert q.decode_s(0, 0) == 0.0 and q.prefill_s(0) == 0.0


def test_costs_grow_with_work_and_few_points_give_a_constant():
    p = prof.example()
    assert p.prefill_s(64) < p.prefill_s(512) < p.prefill_s(512, 2048)
    assert p.decode_s(1, 128) < p.decode_s(8, 1024) < p.decode_s(16, 16384)
    one = _with(prefill=[{"chunk_tokens": 128, "cached_tokens": 0, "seconds": 0.5}])
    assert one.prefill_s(4096) == pytest.approx(0.5)


def test_nnls_matches_scipy():
    scipy_opt = pytest.importorskip("scipy.optimize")
    import numpy as np
    rng = np.random.default_rng(3)
    for _ in range(20):
        a = rng.uniform(0, 1, (12, 3))
        y = a @ rng.uniform(-1, 1, 3) + rng.normal(0, 0.05, 12)
        ref, _ = scipy_opt.nnls(a, y)
        assert prof.nnls(a, y) == pytest.approx(ref, abs=1e-7)


def _with(**tables) -> prof.Profile:
    d = prof.example().to_json()
    d.update(tables)
    return prof.Profile.from_json(d)
