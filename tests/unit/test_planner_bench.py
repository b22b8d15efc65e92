"""bench/planner.py's arithmetic (no system started): a cell's requests, the error figures,
the ranking verdict."""
from __future__ import annotations

import argparse

import pytest

from bench import planner
from sim.profile import example
from sim.trace import TraceRecord


def test_parse_config():
    assert planner.parse_config("1P2D") == (1, 2) and planner.parse_config("12p3d") == (12, 3)
    for bad in ("1P", "P2D", "1X2D", "1P2"):
        with pytest.raises(argparse.ArgumentTypeError):
            planner.parse_config(bad)


def test_cell_trace_rescales_from_the_first_arrival_and_cuts_the_window():
    trace = [TraceRecord(10_000.0 + 1000.0 * i, 100 + i, 8, (i,)) for i in range(100)]
    cell = planner.cell_trace(trace, rate=2.0, window_s=10.0)
    assert cell[0].timestamp_ms == 0.0
    assert [r.timestamp_ms for r in cell[:3]] == pytest.approx([0.0, 505.0, 1010.0], rel=0.02)
    assert all(r.timestamp_ms < 10_000 for r in cell) and len(cell) == 20
    assert [r.input_length for r in cell] == list(range(100, 120))      # the same requests
    assert cell[5].hash_ids == (5,)


def test_slos_from_the_profile():
    prof = example()
    trace = [TraceRecord(0.0, n, 32) for n in (100, 200, 300, 400, 500, 600, 700, 800, 900, 1000)]
    args = argparse.Namespace(slo_ttft_ms=0.0, slo_itl_ms=0.0)
    ttft, itl = planner.slos(prof, trace, args)
    chunked = prof.prefill_s(512, 0) + prof.prefill_s(388, 512)   # the profile's 512-token chunks
    assert ttft == pytest.approx(3000 * chunked, abs=1)
    assert itl == pytest.approx(3000 * prof.decode_s(4, 4 * 566), abs=0.1)
    assert planner.slos(prof, trace, argparse.Namespace(slo_ttft_ms=5.0, slo_itl_ms=6.0)) == (5, 6)


def _cell(cfg, trace, pred, meas):
    keys = planner.FIGURES
    return {"config": cfg, "trace": trace, "factor": 1.0, "rate": 0.5, "requests": [1, 2],
            "predicted": dict(zip(keys, pred)), "measured": dict(zip(keys, meas))}


def test_report_errors_and_ranking():
    cells = [_cell((1, 1), "chat", (110, 220, 55, 11, 0.2), (100, 200, 50, 10, 0.2)),
             _cell((1, 2), "chat", (100, 200, 50, 10, 0.45), (100, 200, 50, 10, 0.24))]
    r = planner.report(cells)
    assert r["figures"] == 10
    assert r["median_abs_error"] == pytest.approx(0.05)       # four 10%, five 0%, one 87.5%
    assert r["worst"][1] == pytest.approx(0.875) and "1P2D" in r["worst"][0]
    assert r["planner_first"] == (1, 2) and r["measured_best"] == (1, 1)   # measured 0.08 vs 0.1 per worker
    assert r["first_within_5pct"] is False
    assert planner.error(None, 3) is None and planner.error(0, 0) == 0.0
    assert planner.error(1, 0) is None
