"""`pdserve profile` end to end: --quick on the tiny model (a real process, the JSON checked
against the schema and against the engine's own KV sizing), and --from-url against a running
tiny system (its workers' live step counters refit the prefill/decode points)."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import threading
import urllib.request
from pathlib import Path

import pytest

from pdserve.launcher import free_port
from sim.profile import SCHEMA, Profile

ROOT = Path(__file__).resolve().parents[2]
RUN_S = 300          # one profile run on the tiny model: seconds of work, bounded generously


def _pdserve(*argv, timeout=RUN_S) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-m", "pdserve.cli", *argv], capture_output=True,
                          text=True, timeout=timeout, env=env, cwd=ROOT)


@pytest.fixture(scope="module")
def quick_profile(model_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("profile") / "quick.json"
    r = _pdserve("profile", "--model", model_dir, "--quick", "--repeat", "3", "--threads", "1",
                 "--block-size", "8", "--num-blocks", "512", "--out", str(out))
    assert r.returncode == 0, r.stderr[-3000:]
    return out, r


def test_quick_profile_json(quick_profile, model_dir):
    out, r = quick_profile
    d = json.loads(out.read_text())
    assert d["schema"] == SCHEMA
    for key in ("pdserve_version", "created_unix", "machine", "model", "options", "prefill",
                "decode", "handover", "gateway_s", "kv", "threads"):
        assert key in d, key
    assert d["machine"]["logical_cores"] >= 1 and d["machine"]["affinity"]
    assert d["machine"]["threads"] == {"prefill": 1, "decode": 1} and d["threads"] == 1
    assert d["model"]["layers"] == 4 and d["model"]["architecture"]
    assert d["options"]["block_size"] == 8 and d["kv"] == {"block_size": 8, "num_blocks": 512}
    assert all(p["seconds"] > 0 for t in ("prefill", "decode", "handover") for p in d[t])
    assert d["gateway_s"] > 0
    # the grid --quick promises: chunks 16..64, a cached prefix, batches 1..4
    assert {p["chunk_tokens"] for p in d["prefill"]} == {16, 32, 64}
    assert {p["cached_tokens"] for p in d["prefill"]} == {0, 32}   # the cache supplied the prefix
    assert {p["batch"] for p in d["decode"]} == {1, 2, 4}
    # monotone-ish: 4x the tokens in a step costs less than 6x the time (a fixed cost is
    # amortised; bounded loosely: the machine is shared), and no step is 50x another
    pre = {(p["chunk_tokens"], p["cached_tokens"]): p["seconds"] for p in d["prefill"]}
    assert pre[(64, 0)] < 6 * pre[(16, 0)]
    dec = {(p["batch"], p["context_tokens"] // p["batch"]): p["seconds"] for p in d["decode"]}
    assert max(dec.values()) < 50 * min(dec.values())
    assert re.search(r"\] (\d+)/\1 ", r.stderr)                  # the counted bar, on stderr
    prof = Profile.load(out)
    assert prof.prefill_s(64) > 0 and prof.decode_s(4, 256) > 0 and prof.handover_s(128) > 0


def test_kv_capacity_is_the_engines_sizing(model_dir, tmp_path):
    """Without --num-blocks the profile's block count is engine.memory's for those options."""
    from engine import memory
    from engine.config import EngineConfig, EngineOptions
    out = tmp_path / "p.json"
    r = _pdserve("profile", "--model", model_dir, "--quick", "--threads", "1",
                 "--kv-cache-memory-gb", "0.01", "--out", str(out))
    assert r.returncode == 0, r.stderr[-3000:]
    want = memory.kv_cache_blocks(EngineConfig.build(model_dir, EngineOptions.of(kv_cache_memory_gb=0.01)))
    assert json.loads(out.read_text())["kv"]["num_blocks"] == want


def test_help_explains_every_input():
    r = _pdserve("profile", "--help", timeout=60)
    assert r.returncode == 0
    for flag in ("--model", "--out", "--quick", "--threads", "--from-url", "--base", "--window-s",
                 "--max-num-seqs", "--max-num-batched-tokens", "--block-size"):
        assert flag in r.stdout


def _complete(base: str, model: str, words: int, max_tokens: int) -> None:
    body = json.dumps({"model": model, "prompt": " ".join(["hello world"] * words),
                       "max_tokens": max_tokens, "ignore_eos": True}).encode()
    req = urllib.request.Request(base + "/v1/completions", body, {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as r:
        assert r.status == 200


@pytest.fixture(scope="module")
def tiny_system(start_system):
    port = free_port()
    launcher = start_system(1, 1, http_port=port)
    base = f"http://127.0.0.1:{port}"
    with urllib.request.urlopen(base + "/v1/models", timeout=30) as r:
        model = json.loads(r.read())["data"][0]["id"]
    return base, model


def test_from_url_refits_from_live_steps(tiny_system, quick_profile, tmp_path):
    base, model = tiny_system
    for words in (4, 30, 80):
        _complete(base, model, words, 12)
    out = tmp_path / "live.json"
    r = _pdserve("profile", "--from-url", base, "--window-s", "0", "--min-steps", "1",
                 "--base", str(quick_profile[0]), "--out", str(out))
    assert r.returncode == 0, r.stderr[-3000:]
    live, old = Profile.load(out), Profile.load(quick_profile[0])
    lp = [p for p in live.prefill if p.get("source") == "live"]
    ld = [p for p in live.decode if p.get("source") == "live"]
    assert lp and ld
    assert all(p["seconds"] > 0 and p["steps"] >= 1 for p in lp + ld)
    assert any(p["batch"] == 1 for p in ld)             # one request at a time: batch 1
    assert live.handover == old.handover and live.gateway_s == old.gateway_s
    assert live.kv == old.kv and live.options["live"]["steps"]["decode"] >= 11 * 3


def test_from_url_window_sees_only_the_window(tiny_system, tmp_path):
    """Two scrapes --window-s apart: only the steps of the traffic sent meanwhile count."""
    base, model = tiny_system
    stop, sent = threading.Event(), []

    def traffic():
        while not stop.is_set() and len(sent) < 200:
            _complete(base, model, 10, 6)
            sent.append(1)
    t = threading.Thread(target=traffic, daemon=True)
    out = tmp_path / "window.json"
    try:
        t.start()
        r = _pdserve("profile", "--from-url", base, "--window-s", "3", "--min-steps", "1",
                     "--out", str(out))
    finally:
        stop.set()
        t.join(120)
    assert r.returncode == 0, r.stderr[-3000:]
    prof = Profile.load(out)
    steps = prof.options["live"]["steps"]
    # each completion is >= 5 decode steps; far fewer than everything since start-up
    assert 0 < steps["decode"] <= 6 * len(sent) + 12
    assert prof.handover == [] and prof.kv["num_blocks"] > 0      # no --base: gauges only
