"""sim/workload.py: length specs, seeded arrivals whose statistics match their definition
(checked against scipy-free closed forms: a Poisson process's gaps have mean 1/rate and
coefficient of variation 1), and rate rescaling."""
from __future__ import annotations

import json
import random
import statistics

import pytest

from sim.trace import TraceRecord
from sim.workload import bursty, mean_rate, parse_lengths, poisson, scale


def _draw(dist, n=4000, seed=1):
    rng = random.Random(seed)
    return [dist.sample(rng) for _ in range(n)]


def test_fixed_and_normal_specs():
    assert set(_draw(parse_lengths("128"), 50)) == {128}
    xs = _draw(parse_lengths("512:128"))
    assert abs(statistics.mean(xs) - 512) < 10 and abs(statistics.stdev(xs) - 128) < 8
    assert min(_draw(parse_lengths("4:50"))) >= 1          # clamped at one token
    assert set(_draw(parse_lengths("64:0"), 20)) == {64}


def test_histogram_file(tmp_path):
    f = tmp_path / "h.json"
    f.write_text(json.dumps({"edges": [1, 100, 1000], "counts": [3, 1]}))
    d = parse_lengths(str(f))
    xs = _draw(d)
    low = sum(x < 100 for x in xs) / len(xs)
    assert 0.72 < low < 0.78                                # 3:1 weights
    assert all(1 <= x < 1000 for x in xs)
    assert d.mean == pytest.approx((50.5 * 3 + 550 * 1) / 4)


def test_one_length_per_line_file(tmp_path):
    f = tmp_path / "lengths.txt"
    f.write_text("# observed\n100\n\n300\n")
    xs = _draw(parse_lengths(str(f)), 400)
    assert set(xs) == {100, 300} and 150 < sum(xs) / len(xs) < 250


@pytest.mark.parametrize("spec,needle", [
    ("", "empty"), ("0", ">= 1"), ("100:-3", "standard deviation"), ("nofile.json", "not N"),
])
def test_bad_specs_say_why(spec, needle):
    with pytest.raises(ValueError, match=needle):
        parse_lengths(spec)


@pytest.mark.parametrize("body,needle", [
    ({"edges": [1, 2], "counts": [1, 2]}, "one more"),
    ({"edges": [5, 2, 9], "counts": [1, 2]}, "increase"),
    ({"edges": [1, 2, 3], "counts": [0, 0]}, "positive total"),
    ({"edge": [1]}, "histogram is"),
])
def test_bad_histograms_say_why(tmp_path, body, needle):
    f = tmp_path / "h.json"
    f.write_text(json.dumps(body))
    with pytest.raises(ValueError, match=needle):
        parse_lengths(str(f))


def test_bad_line_in_a_lengths_file(tmp_path):
    f = tmp_path / "l.txt"
    f.write_text("10\nten\n")
    with pytest.raises(ValueError, match=r"l.txt:2"):
        parse_lengths(str(f))


def _gaps(trace):
    ts = [0.0] + [r.timestamp_ms / 1000 for r in trace]
    return [b - a for a, b in zip(ts, ts[1:])]


def test_poisson_rate_and_gaps():
    t = poisson(2.0, 2000.0, parse_lengths("64"), parse_lengths("16"), seed=3)
    assert 3800 < len(t) < 4200                             # 2/s x 2000 s, within ~3 sd
    g = _gaps(t)
    assert statistics.mean(g) == pytest.approx(0.5, rel=0.05)
    assert statistics.stdev(g) / statistics.mean(g) == pytest.approx(1.0, abs=0.06)
    assert all(r.input_length == 64 and r.output_length == 16 and r.hash_ids == () for r in t)
    assert t == poisson(2.0, 2000.0, parse_lengths("64"), parse_lengths("16"), seed=3)
    assert t != poisson(2.0, 2000.0, parse_lengths("64"), parse_lengths("16"), seed=4)
    assert all(a.timestamp_ms < b.timestamp_ms for a, b in zip(t, t[1:]))
    assert t[-1].timestamp_ms < 2000 * 1000


def test_bursty_keeps_the_rate_and_raises_the_variation():
    t = bursty(1.0, 4000.0, parse_lengths("64"), parse_lengths("16"), seed=5, cv=3.0)
    g = _gaps(t)
    assert statistics.mean(g) == pytest.approx(1.0, rel=0.15)
    assert statistics.stdev(g) / statistics.mean(g) == pytest.approx(3.0, rel=0.2)


def test_scale_and_mean_rate():
    t = [TraceRecord(1000.0 * i, 10, 5, (i,)) for i in range(1, 11)]
    assert mean_rate(t) == pytest.approx(1.0)
    s = scale(t, 2.0)
    assert mean_rate(s) == pytest.approx(2.0)
    assert [r.timestamp_ms for r in s] == [500.0 * i for i in range(1, 11)]
    assert [r.hash_ids for r in s] == [r.hash_ids for r in t]
    with pytest.raises(ValueError):
        scale(t, 0)
    with pytest.raises(ValueError):
        poisson(0, 10, parse_lengths("1"), parse_lengths("1"))
