"""`pdserve plan`: the search space and its order, threads as `pdserve up` gives them, the
ranking rule, the simulator's verdict on two workloads whose answer is known from first
principles (decode-bound traffic wants more decode workers; short prompts with a loose TTFT
want one colocated worker), the JSON shape, the PNG, and the command end to end."""
from __future__ import annotations

import json
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from pdserve import plan
from pdserve.cli import build_parser
from pdserve.plan_cli import verdict, workload_from
from pdserve.up import UpConfig
from sim.profile import example
from sim.trace import TraceRecord, write_trace
from sim.workload import Workload, parse_lengths

ROOT = Path(__file__).resolve().parents[2]


def test_the_search_space_in_order():
    assert plan.shapes(3) == [(0, 1), (0, 2), (0, 3), (1, 1), (1, 2), (2, 1)]
    assert len(plan.shapes(4)) == 10 and all(p + d <= 4 for p, d in plan.shapes(4))
    cands = plan.candidates(2, 2, max_num_seqs=(128, 8), max_num_batched_tokens=(2048,))
    assert [(c.prefill, c.decode, c.settings["max_num_seqs"]) for c in cands] == [
        (0, 1, 128), (0, 1, 8), (0, 2, 128), (0, 2, 8), (1, 1, 128), (1, 1, 8)]


@pytest.mark.parametrize("p,d,cores", [(1, 1, 2), (1, 2, 2), (2, 1, 2), (2, 2, 2), (1, 1, 8),
                                       (3, 2, 16)])
def test_threads_are_what_pdserve_up_gives(p, d, cores):
    assert plan.threads_for(p, d, cores) == UpConfig(prefill=p, decode=d).threads(cores=cores)


def test_colocated_workers_split_every_core():
    assert plan.threads_for(0, 1, 4) == (0, 4) and plan.threads_for(0, 3, 2) == (0, 1)


def _cand(p, d, goodput, attainment, ttft_p90=100.0):
    c = plan.Candidate(p, d, {"max_num_seqs": 128, "max_num_batched_tokens": 2048},
                       {"prefill": 1, "decode": 1})
    c.summary = {"goodput_rps": goodput, "slo_attainment": attainment, "ttft_p90_ms": ttft_p90}
    return c


def test_rank_meeting_first_by_goodput_per_worker_then_fewer_workers():
    a = _cand(1, 1, 1.0, 0.95)          # 0.5 per worker
    b = _cand(1, 3, 2.4, 0.99)          # 0.6 per worker: best
    c = _cand(2, 2, 2.0, 0.97)          # 0.5 per worker, more workers than a
    d = _cand(0, 1, 0.9, 0.5)           # 0.9 per worker but misses the target
    e = _cand(0, 2, 0.1, 0.8)           # misses, closer than d
    ranked = plan.rank([d, c, a, e, b], 0.9)
    assert ranked == [b, a, c, e, d]


class _Recorder:
    """A simulator that records its calls and answers a summary from the system's shape."""

    def __init__(self):
        self.calls = []

    def __call__(self, profile, system, trace, *, seed=0):
        self.calls.append((system, len(trace), seed))
        good = system.decode / (system.prefill + system.decode)
        return _Result({"goodput_rps": good + seed, "slo_attainment": 1.0, "ttft_p90_ms": None,
                        "tokens_from_usage": True})


class _Result:
    def __init__(self, s):
        self.s = s

    def summary(self, slo_ttft_ms=None, slo_itl_ms=None):
        return dict(self.s)


def test_search_simulates_every_candidate_per_seed_as_up_would_run_it():
    sim = _Recorder()
    w = Workload(rate=1.0, input=parse_lengths("100"), output=parse_lengths("10"),
                 duration_s=20)
    ranked = plan.search(example(), w, max_workers=2, cores=2, slo=(1000, 50), seeds=2,
                         max_num_seqs=(16,), max_num_batched_tokens=(256,), simulate=sim)
    assert len(sim.calls) == 3 * 2
    assert [s for _, _, s in sim.calls] == [0, 1] * 3
    for system, _, _ in sim.calls:
        assert (system.max_num_seqs, system.max_num_batched_tokens, system.cores) == (16, 256, 2)
        assert system.slo_ttft_s == 0 and system.slo_itl_s == 0     # up runs no admission
        if system.prefill:
            assert (system.prefill_threads, system.decode_threads) == \
                UpConfig(prefill=system.prefill, decode=system.decode).threads(cores=2)
    by_shape = {(c.prefill, c.decode): c for c in ranked}
    assert by_shape[(1, 1)].summary["goodput_rps"] == pytest.approx(0.5 + 0.5)   # mean of seeds
    assert by_shape[(1, 1)].summary["ttft_p90_ms"] is None
    assert [(c.prefill, c.decode) for c in ranked] == [(0, 1), (0, 2), (1, 1)]


def test_decode_bound_traffic_wants_more_decode_workers():
    """Short prompts, long outputs (256 tokens at 1 req/s), a 60 ms ITL on 2 cores: `up`
    gives one decode worker of 1P1D one thread, so it cannot keep up (its batch, and so its
    ITL, grows); 1P2D decodes on both cores and meets the SLO."""
    w = Workload(rate=1.0, input=parse_lengths("32"), output=parse_lengths("256:32"),
                 duration_s=60)
    ranked = plan.search(example(), w, max_workers=3, cores=2, slo=(5000, 60), seeds=1,
                         max_num_seqs=(128,), max_num_batched_tokens=(2048,))
    by_shape = {(c.prefill, c.decode): c for c in ranked}
    one, two = by_shape[(1, 1)], by_shape[(1, 2)]
    assert two.summary["itl_p50_ms"] < 0.6 * one.summary["itl_p50_ms"]
    assert two.meets(0.9) and not one.meets(0.9)
    assert two.summary["goodput_rps"] > 3 * one.summary["goodput_rps"]
    split = [(c.prefill, c.decode) for c in ranked if c.prefill]
    assert split[0] == (1, 2) and split.index((1, 2)) < split.index((1, 1))


def test_short_prompts_and_a_loose_ttft_want_colocated():
    w = Workload(rate=0.5, input=parse_lengths("32"), output=parse_lengths("16"),
                 duration_s=60)
    ranked = plan.search(example(), w, max_workers=3, cores=2, slo=(20000, 500), seeds=1,
                         max_num_seqs=(128,), max_num_batched_tokens=(2048,))
    assert (ranked[0].prefill, ranked[0].decode) == (0, 1)
    assert any("colocated serving wins" in line for line in verdict(ranked, 0.9))


def _args(*extra):
    return build_parser().parse_args(["plan", "--profile", "p.json", *extra])


def test_workload_options():
    w = workload_from(_args("--rate", "2", "--input-tokens", "512:64", "--output-tokens", "32",
                            "--duration", "30"))
    assert (w.rate, w.duration_s, w.input.kind, w.output.kind) == (2.0, 30.0, "normal", "fixed")
    for bad in (("--rate", "2"), ("--input-tokens", "5"), ()):
        with pytest.raises(ValueError, match="--trace FILE, or --rate"):
            workload_from(_args(*bad))
    with pytest.raises(SystemExit):
        _args("--max-num-seqs", "0")


def test_trace_workload_and_rate_scaling(tmp_path):
    t = tmp_path / "t.jsonl"
    write_trace(t, [TraceRecord(500.0 * i, 64, 8) for i in range(1, 21)])
    w = workload_from(_args("--trace", str(t), "--rate-scale", "2"))
    assert w.mean_rate == pytest.approx(4.0)
    assert w.at_rate(1.0).mean_rate == pytest.approx(1.0)
    assert w.records()[0].timestamp_ms == 250.0
    with pytest.raises(ValueError, match="not both"):
        workload_from(_args("--trace", str(t), "--rate", "1"))


def _png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR"
    return struct.unpack(">II", data[16:24])


def test_cli_json_shape_and_plot(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    example().save(tmp_path / "p.json")
    png = tmp_path / "plan.png"
    from pdserve.cli import main
    assert main(["plan", "--profile", str(tmp_path / "p.json"), "--slo-ttft-ms", "20000",
                 "--slo-itl-ms", "200", "--max-workers", "2", "--rate", "0.3",
                 "--input-tokens", "128:32", "--output-tokens", "16", "--duration", "40",
                 "--seeds", "1", "--max-num-seqs", "32", "--max-num-batched-tokens", "512",
                 "--rates", "0.2,0.4", "--plot", str(png), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    best = out["best"]
    assert {"prefill", "decode", "settings", "predicted"} <= set(best)
    assert {"ttft_p50_ms", "ttft_p90_ms", "itl_p50_ms", "goodput_rps"} <= set(best["predicted"])
    assert best["settings"] == {"max_num_seqs": 32, "max_num_batched_tokens": 512}
    assert len(out["candidates"]) == 3 and out["candidates"][0] == best
    assert len(out["sweep"]) == 3 * 2 and {r["rate"] for r in out["sweep"]} == {0.2, 0.4}
    w, h = _png_size(png)
    assert w > 400 and h > 300


def test_the_command_end_to_end_on_a_trace(tmp_path):
    example().save(tmp_path / "p.json")
    write_trace(tmp_path / "t.jsonl", [TraceRecord(2000.0 * i, 200 + 50 * (i % 4), 24)
                                       for i in range(30)])
    r = subprocess.run([sys.executable, "-m", "pdserve", "plan", "--profile",
                        str(tmp_path / "p.json"), "--trace", str(tmp_path / "t.jsonl"),
                        "--slo-ttft-ms", "30000", "--slo-itl-ms", "300", "--max-workers", "3",
                        "--seeds", "1", "--max-num-seqs", "64"],
                       cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert "| rank | P | D |" in r.stdout and "best:" in r.stdout
    assert r.stderr.count("] ") == 6 * 2            # a progress line per candidate
    h = subprocess.run([sys.executable, "-m", "pdserve", "plan", "--help"], cwd=ROOT,
                       capture_output=True, text=True, timeout=60)
    assert "one length per line" in h.stdout and "--max-workers" in h.stdout
