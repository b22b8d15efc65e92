"""bench/prefix_tiers.py without servers: its traces (bench/make_traces.py's prefix_chat and
prefix_longdoc, and the committed files), the working set it sizes the KV pool by (against
the engine's own block hashes of the prompts pdserve bench would send), the flags it passes,
and the table with its ratios."""
from __future__ import annotations

import random
from collections import defaultdict
from pathlib import Path

import pytest

from bench import make_traces, prefix_tiers as pt
from engine.block_hash import prefix_block_hashes
from pdserve.bench_prompts import VOCAB, PromptBuilder
from sim.trace import BLOCK_TOKENS, TraceRecord, read_trace

TRACES = Path(make_traces.__file__).parent / "traces"


def _sessions(recs):
    by = defaultdict(list)
    for r in recs:
        by[r.hash_ids[1] // 1000].append(r)
    return by


def test_chat_turns_resend_the_whole_history_after_the_shared_system_prompt():
    recs = make_traces.prefix_chat(random.Random(5))
    assert [r.timestamp_ms for r in recs] == sorted(r.timestamp_ms for r in recs)
    assert all(r.hash_ids[0] == make_traces.SYSTEM_ID for r in recs)
    assert all(16 <= r.output_length <= 32 for r in recs)
    sessions = _sessions(recs)
    assert len(sessions) == 24 and all(len(turns) == 3 for turns in sessions.values())
    for turns in sessions.values():
        assert BLOCK_TOKENS + 40 <= turns[0].input_length <= BLOCK_TOKENS + 80
        for prev, nxt in zip(turns, turns[1:]):
            # the next prompt: the last one, its reply and 40-80 new tokens; same blocks first
            grew = nxt.input_length - prev.input_length - prev.output_length
            assert 40 <= grew <= 80
            assert nxt.hash_ids[:len(prev.hash_ids)] == prev.hash_ids
            assert 5000 <= nxt.timestamp_ms - prev.timestamp_ms <= 8000


def test_longdoc_questions_share_their_document_and_nothing_else():
    recs = make_traces.prefix_longdoc(random.Random(5))
    assert len(recs) == 30 and all(16 <= r.output_length <= 32 for r in recs)
    for r in recs:
        doc, own = r.hash_ids[:2], r.hash_ids[2]
        assert doc[1] == doc[0] + 1 and 2 * BLOCK_TOKENS + 30 <= r.input_length <= 2 * BLOCK_TOKENS + 60
        assert own == 10_000_000 + recs.index(r)
    docs = [r.hash_ids[0] for r in recs]
    assert len(set(docs)) < len(docs) / 3                   # each document asked several times


def test_committed_traces_are_the_generators_output():
    for name, make in make_traces.TRACES:
        want = make(random.Random(f"29:{name}"))
        assert read_trace(TRACES / f"{name}.jsonl") == want, name


def _engine_blocks(recs, block_size=16) -> int:
    """The reference: the engine's chained block hashes of the prompts pdserve bench builds
    (one token per word, as its builder assumes without a server: same ids, same words)."""
    builder, index = PromptBuilder(None, seed=31), {w: i for i, w in enumerate(VOCAB)}
    seen = set()
    for i, r in enumerate(recs):
        ids = [index[w] for w in builder.words(r.hash_ids, r.input_length, i)]
        assert len(ids) == r.input_length
        seen.update(prefix_block_hashes(ids, block_size))
    return len(seen)


def test_working_set_is_the_distinct_blocks_the_engine_would_hash():
    for name in ("prefix_chat", "prefix_longdoc"):
        recs = read_trace(TRACES / f"{name}.jsonl")
        assert pt.working_set_blocks(recs) == _engine_blocks(recs), name
    by_hand = [TraceRecord(0, 40, 8, (7,)), TraceRecord(1, 600, 8, (7, 9)),
               TraceRecord(2, 40, 8, (8,)), TraceRecord(3, 33, 8, ())]
    assert pt.working_set_blocks(by_hand) == 37 + 2 + 2 == _engine_blocks(by_hand)


def test_prefill_pool_is_a_quarter_of_the_working_set_but_holds_two_long_requests():
    recs = [TraceRecord(i, 100, 12, (1000 + i,)) for i in range(40)]      # 6 blocks each
    assert pt.working_set_blocks(recs) == 240
    assert pt.pool_blocks(recs) == (60, 16 * 7)            # 112 tokens: 7 blocks
    assert pt.pool_blocks(recs[:4]) == (2 * 7, 16 * 7)


def test_flags_only_where_up_lists_them():
    help_text = "  --kv-offload-host-gb KV_OFFLOAD_HOST_GB\n  [--peer-fetch PEER_FETCH]\n"
    assert pt.system_flags("a", help_text, "/d") == ([], [])
    assert pt.system_flags("b", help_text, "/d") == (
        ["--kv-offload-host-gb", "0", "--peer-fetch", "off"], [])
    flags, absent = pt.system_flags("c", help_text, "/d")
    assert flags == ["--kv-offload-host-gb", "1", "--peer-fetch", "on"]
    assert absent == ["--kv-offload-disk", "--kv-offload-disk-gb"]
    # a longer flag does not stand for a shorter one
    assert pt.system_flags("c", "--kv-offload-disk-gb X", "/d")[1][0] == "--kv-offload-host-gb"
    assert "--kv-offload-disk" in pt.system_flags("c", "--kv-offload-disk-gb X", "/d")[1]


def test_computed_tokens_sum_the_workers_of_a_gateway_scrape():
    text = "\n".join([
        "# TYPE pdserve:prompt_tokens_computed_total counter",
        'pdserve:prompt_tokens_computed_total{role="prefill",worker="prefill-0"} 100.0',
        'pdserve:prompt_tokens_computed_total{role="prefill",worker="prefill-1"} 20.0',
        'pdserve:prompt_tokens_computed_total{role="decode",worker="decode-0"} 3.0',
        "# TYPE pdserve:prompt_tokens_total counter",
        'pdserve:prompt_tokens_total{model="m"} 999.0', ""])
    assert pt.computed_tokens(text) == {"prefill": 120.0, "decode": 3.0}


def test_where_counts_sum_each_series_by_its_labels():
    text = "\n".join([
        "# TYPE pdserve:peer_fetch_total counter",
        'pdserve:peer_fetch_total{result="ok",role="prefill",worker="prefill-0"} 2.0',
        'pdserve:peer_fetch_total{result="ok",role="prefill",worker="prefill-1"} 1.0',
        'pdserve:peer_fetch_total{result="fallback",role="prefill",worker="prefill-1"} 4.0',
        "# TYPE pdserve:kv_tier_hits_total counter",
        'pdserve:kv_tier_hits_total{role="prefill",tier="host",worker="prefill-0"} 64.0',
        "# TYPE pdserve:route_decisions_total counter",
        'pdserve:route_decisions_total{pool="prefill",reason="prefix",role="gateway"} 5.0',
        'pdserve:route_decisions_total{pool="decode",reason="prefix",role="gateway"} 7.0', ""])
    got = pt.where_counts(text)
    assert (got["fetch ok"], got["fetch fallback"], got["revived host"], got["revived disk"],
            got["picks prefix"], got["cold"]) == (3.0, 4.0, 64.0, 0.0, 5.0, 0.0)


def _rec(ttft, text, status="ok", out=10):
    return {"ttft_s": ttft, "itl_s": 0.01, "e2e_s": ttft + 0.1, "output_tokens": out,
            "status": status, "text": text}


def _run(records, computed, window=10.0):
    return {"records": records, "window_s": window, "computed": computed}


def test_rows_ratios_and_the_table():
    ref = [_rec(1.0, "x"), _rec(2.0, "y"), _rec(3.0, "z")]
    runs = {"a": [_run(ref, {"prefill": 900, "decode": 100}),
                  _run([_rec(1.0, "x"), _rec(2.0, "y"), _rec(3.0, "Z")],
                       {"prefill": 1000, "decode": 0})],
            "b": [_run([_rec(0.5, "x"), _rec(1.0, "y"), _rec(1.0, "z", "error", 0)],
                       {"prefill": 700, "decode": 0})],
            "c": [_run([_rec(0.5, "x"), _rec(0.6, "?"), _rec(0.7, "z")],
                       {"prefill": 400, "decode": 0})]}
    rows = {s: pt.aggregate(r, ref) for s, r in runs.items()}
    assert rows["a"]["computed"] == 1000 and rows["a"]["per_round"] == [1000, 1000]
    assert rows["a"]["mismatches"] == 1 and rows["a"]["prefill_share"] == pytest.approx(0.95)
    assert rows["b"]["failed"] == 1 and rows["b"]["mismatches"] == 0
    assert rows["c"]["mismatches"] == 1 and rows["c"]["tok_s"] == pytest.approx(3.0)
    # TTFT p90 over the pooled rounds: a 1,1,2,2,3,3 s -> 3.0 s; c 0.5,0.6,0.7 -> 0.68 s
    assert rows["a"]["ttft_p90_ms"] == pytest.approx(3000.0)
    assert rows["c"]["ttft_p90_ms"] == pytest.approx(680.0)
    out = pt.table("chat", rows, "a", "3 requests")
    assert "| (a) affinity routing (a9f9160) | 6 | 1000 | 1000 / 1000 | 95% |" in out
    assert "| prompt tokens computed | 0.40 | <= 0.5 | yes |" in out
    assert "| TTFT p90 | 0.23 | <= 0.6 | yes |" in out
    rows["c"]["computed"] = 600.0
    assert "| prompt tokens computed | 0.60 | <= 0.5 | no |" in pt.table("chat", rows, "a")
    with pytest.raises(ValueError):
        pt.mismatches(ref, ref[:2])
    rows["A"] = dict(rows["a"], computed=800.0, ttft_p90_ms=1360.0)     # (a') beside (a)
    out = pt.table("chat", rows, "a")
    assert "| (c) / (a') | ratio | target | met |" in out
    assert "| greedy mismatches vs (a) |" in out
    assert "| greedy mismatches vs (a') |" in pt.table("chat", rows, "A")
    assert "| prompt tokens computed | 0.75 | <= 0.5 | no |" in out
    assert "| TTFT p90 | 0.50 | <= 0.6 | yes |" in out


def test_a_prime_is_the_affinity_rule_on_this_tree():
    help_text = "--kv-offload-host-gb X --peer-fetch X --prefix-routing X"
    assert pt.system_flags("A", help_text, "/d") == (
        ["--kv-offload-host-gb", "0", "--peer-fetch", "off", "--prefix-routing", "affinity"], [])
    patch = pt.AFFINITY_PATCH.read_text()
    assert "gateway/routing.py" in patch and '"affinity"' in patch


def test_the_load_generator_keeps_each_requests_streamed_text():
    import asyncio
    import json

    import httpx

    from pdserve.loadgen import Job, Target, send
    chunks = [{"choices": [{"text": "Hello"}]}, {"choices": [{"text": ""}]},
              {"choices": [{"text": " world"}]},
              {"choices": [], "usage": {"completion_tokens": 3, "prompt_tokens": 4}}]
    body = "".join(f"data: {json.dumps(c)}\n\n" for c in chunks) + "data: [DONE]\n\n"

    def handler(request):
        return httpx.Response(200, text=body, headers={"content-type": "text/event-stream"})

    async def go():
        async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as http:
            return await send(http, Target("http://x", "m"), Job("p", 3))
    r = asyncio.run(go())
    assert r["status"] == "ok" and r["text"] == "Hello world" and r["output_tokens"] == 3


def test_phase_table_gives_each_systems_median_p90_and_mean_per_phase():
    def ph(p90, mean):
        return {"p90_ms": p90, "mean_ms": mean, "p50_ms": 0.0, "share": 0.0, "count": 1}
    runs = {"a": [{"phases": {}}, {"phases": {}}],                      # (a): no waterfall
            "A": [{"phases": {"prefill_compute": ph(900, 500), "routing": ph(0.2, 0.1)}},
                  {"phases": {"prefill_compute": ph(1100, 700), "routing": ph(0.3, 0.1)}}],
            "c": [{"phases": {"prefill_compute": ph(400, 200), "prefill_queue": ph(50, 30)}},
                  {"phases": {"prefill_compute": ph(600, 300), "prefill_queue": ph(70, 40)}}]}
    lines = pt.phase_table(runs).strip().splitlines()
    assert lines[2] == "| system | prefill_queue | prefill_compute |"      # routing: < 0.5 ms
    assert lines[4] == f"| {pt.LABELS['A']} |  | 1000 (600) |"
    assert lines[5] == f"| {pt.LABELS['c']} | 60 (35) | 500 (250) |"
    assert len(lines) == 6                                                # no row for (a)
    assert pt.phase_table({"a": [{"phases": {}}]}) == ""


def test_a_variant_is_its_systems_flags_and_its_own_with_ratios_of_its_own(monkeypatch):
    monkeypatch.setattr(pt, "VARIANTS", {})
    monkeypatch.setattr(pt, "LABELS", dict(pt.LABELS))
    help_text = "--kv-offload-host-gb --kv-offload-disk --kv-offload-disk-gb --peer-fetch"
    args = pt.parse_args(["--systems", "A", "c", "--variant", "c512=c --max-num-batched-tokens 512"])
    assert args.systems == ["A", "c", "c512"]
    assert pt.LABELS["c512"] == "(c, c512) --max-num-batched-tokens 512"
    flags, absent = pt.system_flags("c512", help_text, "D")
    assert flags == pt.system_flags("c", help_text, "D")[0] + ["--max-num-batched-tokens", "512"]
    assert absent == []
    for bad in ("c=c --x 1", "n=z --x 1", "n=c", "=c --x 1", "c512=c --y 2"):
        with pytest.raises(SystemExit):
            pt.parse_args(["--systems", "A", "--variant", bad])
    ref = [_rec(1.0, "x"), _rec(2.0, "y")]
    rows = {s: pt.aggregate([_run(ref, {"prefill": n, "decode": 0})], ref)
            for s, n in (("A", 1000), ("c", 600), ("c512", 400))}
    out = pt.table("chat", rows, "A")
    assert "| (c) / (a') | ratio | target | met |" in out
    assert "| (c512) / (a') | ratio | target | met |" in out
    assert "| prompt tokens computed | 0.40 | <= 0.5 | yes |" in out


def test_new_blocks_add_up_to_the_working_set_and_split_ttft_p90():
    by_hand = [TraceRecord(0, 40, 8, (7,)), TraceRecord(1, 600, 8, (7, 9)),
               TraceRecord(2, 40, 8, (8,)), TraceRecord(3, 33, 8, ())]
    # 40 tokens of 7: 2 blocks; 600 of (7, 9): 37, the 2 of 7's first 32 known; 40 of 8: 2;
    # 33 tokens of no id: its own 2
    assert pt.new_blocks(by_hand) == [2, 35, 2, 2]
    for name in ("prefix_chat", "prefix_longdoc"):
        recs = read_trace(TRACES / f"{name}.jsonl")
        assert sum(pt.new_blocks(recs)) == pt.working_set_blocks(recs), name
    docs = pt.new_blocks(read_trace(TRACES / "prefix_longdoc.jsonl"))
    assert sum(n * pt.BLOCK_SIZE >= pt.FRESH_TOKENS for n in docs) == 6     # 6 documents
    ref = [_rec(3.0, "x"), _rec(1.0, "y"), _rec(0.5, "z")]
    row = pt.aggregate([_run(ref, {"prefill": 1, "decode": 0})] * 2, ref, [True, False, False])
    assert row["ttft_p90_split"]["fresh"] == (2, pytest.approx(3000.0))
    assert row["ttft_p90_split"]["rest"] == (4, pytest.approx(1000.0))  # 0.5, 0.5, 1, 1
    out = pt.table("t", {"A": row}, "A")
    assert out.splitlines()[4].endswith("| 3000 (2) | 1000 (4) |")
    assert pt.aggregate([_run(ref, {"prefill": 1, "decode": 0})], ref)["ttft_p90_split"] is None
