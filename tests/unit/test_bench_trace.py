"""sim/trace.py (the Mooncake trace format) and sim/stats.py (the percentile and summary shared
by `pdserve bench` and the simulator), against numpy's percentile and hand-counted summaries."""
from __future__ import annotations

import json
import math
import random

import numpy as np
import pytest

from sim.stats import SUMMARY_KEYS, mean_itl_s, pct, summarize
from sim.trace import BLOCK_TOKENS, TraceRecord, read_trace, write_trace


def test_trace_round_trip(tmp_path):
    recs = [TraceRecord(0.0, 700, 16, (1, 2)), TraceRecord(1250.5, 10, 256),
            TraceRecord(3000.0, 1024, 32, (1, 2))]
    p = tmp_path / "t.jsonl"
    write_trace(p, recs)
    assert read_trace(p) == recs
    first = json.loads(p.read_text().splitlines()[0])
    assert first == {"timestamp": 0, "input_length": 700, "output_length": 16, "hash_ids": [1, 2]}


def test_reads_a_mooncake_line_and_skips_blank_lines(tmp_path):
    p = tmp_path / "m.jsonl"
    p.write_text('{"timestamp": 27482, "input_length": 6955, "output_length": 52, '
                 '"hash_ids": [46, 47, 48, 49, 50, 51, 52, 53, 54, 55, 56, 57, 58, 59]}\n\n')
    (r,) = read_trace(p)
    assert (r.timestamp_ms, r.input_length, r.output_length) == (27482.0, 6955, 52)
    assert r.hash_ids == tuple(range(46, 60))
    assert math.ceil(6955 / BLOCK_TOKENS) == 14


@pytest.mark.parametrize("line, fault", [
    ("not json", "not JSON"),
    ("[1, 2]", "JSON object"),
    ('{"input_length": 5, "output_length": 1}', "'timestamp'"),
    ('{"timestamp": -1, "input_length": 5, "output_length": 1}', "'timestamp'"),
    ('{"timestamp": 0, "input_length": 0, "output_length": 1}', "'input_length' must be >= 1"),
    ('{"timestamp": 0, "input_length": 5.5, "output_length": 1}', "'input_length' must be an int"),
    ('{"timestamp": 0, "input_length": 5}', "'output_length'"),
    ('{"timestamp": 0, "input_length": 5, "output_length": 1, "hash_ids": "ab"}', "'hash_ids'"),
    ('{"timestamp": 0, "input_length": 5, "output_length": 1, "hash_ids": [1, 2]}', "at most one"),
])
def test_a_bad_line_names_file_line_and_fault(tmp_path, line, fault):
    p = tmp_path / "bad.jsonl"
    p.write_text('{"timestamp": 0, "input_length": 5, "output_length": 1}\n' + line + "\n")
    with pytest.raises(ValueError) as e:
        read_trace(p)
    assert f"{p}:2:" in str(e.value) and fault in str(e.value)


def test_pct_matches_numpy():
    rng = random.Random(7)
    for n in (1, 2, 3, 10, 101, 1000):
        xs = [rng.expovariate(1.0) for _ in range(n)]
        for q in (0, 1, 10, 25, 50, 90, 99, 99.9, 100):
            assert pct(xs, q) == pytest.approx(float(np.percentile(xs, q)), rel=1e-12, abs=1e-15)
    assert math.isnan(pct([], 50))
    with pytest.raises(ValueError):
        pct([1.0], 101)


def _rec(ttft, e2e, n, status="ok", **kw):
    return {"ttft_s": ttft, "e2e_s": e2e, "output_tokens": n, "status": status,
            "itl_s": mean_itl_s(ttft, e2e, n), **kw}


def test_summarize_counts_and_slos():
    recs = [_rec(0.1, 1.1, 11), _rec(0.3, 0.8, 6), _rec(0.2, 0.2, 1),
            _rec(0, 0, 0, "rejected"), _rec(0, 0, 0, "error")]
    s = summarize(recs, 10.0, slo_ttft_ms=250, slo_itl_ms=100)
    assert tuple(s) == SUMMARY_KEYS
    assert (s["requests"], s["completed"], s["errors"], s["rejected_429"]) == (5, 3, 1, 1)
    assert s["ttft_p50_ms"] == pytest.approx(200.0)
    assert s["ttft_p90_ms"] == pytest.approx(np.percentile([100, 200, 300], 90))
    assert s["itl_p50_ms"] == pytest.approx(100.0)        # the 1-token request has no ITL
    assert s["throughput_tok_s"] == pytest.approx(1.8)
    # good: #1 (ttft 100, itl 100), #3 (ttft 200, no itl); #2 misses on TTFT (300 ms)
    assert s["goodput_rps"] == pytest.approx(0.2) and s["slo_attainment"] == pytest.approx(0.4)
    assert s["tokens_from_usage"] is True
    loose = summarize(recs, 10.0)
    assert loose["goodput_rps"] == pytest.approx(0.3)
    assert summarize(recs + [_rec(0.1, 0.5, 3, tokens_from_usage=False)], 10)["tokens_from_usage"] is False


def test_summarize_with_nothing_completed_has_no_percentiles():
    s = summarize([_rec(0, 0, 0, "error")], 1.0)
    assert s["ttft_p50_ms"] is None and s["completed"] == 0 and s["goodput_rps"] == 0
    with pytest.raises(ValueError):
        summarize([{"status": "weird"}], 1.0)


def _words_count(text: str) -> int:
    """A stand-in tokenizer: words of over 4 letters are two tokens, the rest one."""
    return sum(2 if len(w) > 4 else 1 for w in text.split())


def test_prompt_builder_hits_lengths_and_shares_prefixes():
    from pdserve.bench_prompts import PromptBuilder
    b = PromptBuilder(_words_count, seed=3)
    assert b.calibrate() and b.exact
    for n in (1, 2, 100, 511, 512, 513, 2000):
        assert _words_count(b.build((5, 6, 7, 8), n, unique=n)) == n
    a, c = b.build((5, 6), 900, 1), b.build((5, 6, 7), 1200, 2)
    assert c.startswith(a)
    assert b.build((5, 6), 900, 1) == a                      # deterministic
    assert not b.build((9,), 900, 1).startswith(a[:50])      # another id, other text


def test_prompt_builder_corrects_a_non_additive_count_and_marks_approximate():
    from pdserve.bench_prompts import PromptBuilder
    merged = lambda t: _words_count(t) - len(t.split()) // 100   # noqa: E731 -- merges
    b = PromptBuilder(merged, seed=0)
    assert b.calibrate()
    assert merged(b.build((), 700, 1)) == 700 and b.always_check
    assert merged(b.build((), 1500, 2)) == 1500
    none = PromptBuilder(lambda t: None)
    assert not none.calibrate() and not none.exact
    assert len(none.build((1,), 300, 0).split()) == 300      # one word a token, approximately
