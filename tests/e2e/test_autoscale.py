"""`pdserve up --autoscale` live, tiny model: a load step up makes it add the pool its plan
names (GET /plan's target, within a bounded time), a step down retires one again; no
request fails through both, every stream completes, and every answer is greedy-identical
to the same prompts on an unscaled 1P1D system.

The decode workers hold at most 2 sequences each (--max-num-seqs 2), so 6 closed-loop
clients queue behind one decode worker whatever the machine's speed: the simulated plan
(on a profile of tiny-model-like costs, corrected live by the workers' measured steps)
then prefers a second decode worker (1P2D) under the 50 ms TTFT SLO; one client every
1.5 s needs only 1P1D again, which the autoscaler returns to after its down hold.
--disaggregation always keeps the shapes disaggregated (P >= 1); the colocated shapes are
bench/adaptive.py's.
"""
from __future__ import annotations

import json
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest

from pdserve.launcher import free_port
from sim.profile import SCHEMA, Profile
from tests.e2e.test_up import Up

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.timeout(900)]

PROMPTS = [f"Tell me about the number {i} and the colour of the sea" for i in range(12)]
MAX_TOKENS = 24
ENGINE = ["--max-num-seqs", "2", "--block-size", "16"]
PHASE_S = 180.0                  # the most a scaling phase may take (a worker loads in ~20 s)


def tiny_profile(path) -> str:
    """Costs near the tiny model's on one core (the workers' measured steps correct them)."""
    pre = lambda n, c: 0.003 + 5e-5 * n + 1e-8 * n * (c + n / 2)      # noqa: E731
    dec = lambda b, ctx: 0.002 + 2e-4 * b + 1e-7 * ctx                # noqa: E731
    prof = Profile(
        schema=SCHEMA, pdserve_version="test", created_unix=0.0,
        machine={"cpu": "test", "logical_cores": 2, "affinity": [0, 1]},
        model={"id": "tiny"}, options={"threads": 1},
        prefill=[{"chunk_tokens": n, "cached_tokens": c, "seconds": pre(n, c)}
                 for c in (0, 256) for n in (16, 64, 256)],
        decode=[{"batch": b, "context_tokens": b * x, "seconds": dec(b, b * x)}
                for b in (1, 2, 4) for x in (64, 512)],
        handover=[{"prompt_tokens": n, "seconds": 0.001} for n in (16, 256)],
        gateway_s=0.001, kv={"block_size": 16, "num_blocks": 4096}, threads=1)
    prof.save(path)
    return str(path)


def plan_state(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=10) as r:
        return json.loads(r.read())


class Load:
    """Closed-loop clients (the openai SDK, streaming, greedy) recording every answer."""

    def __init__(self, base_url: str):
        from openai import OpenAI
        self.client = OpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=300)
        self.results: list[tuple[str, str, str, int]] = []   # prompt, text, finish, tokens
        self.errors: list[str] = []
        self._lock = threading.Lock()
        self._n = 0
        self.refused = 0                         # 429s retried

    def one(self, prompt: str) -> None:
        """One request; a 429 (a decode worker's batch is full: backpressure, before any
        token) is retried after its Retry-After, up to 60 times, and counted."""
        from openai import RateLimitError
        for _ in range(60):
            try:
                return self._one(prompt)
            except RateLimitError as e:
                with self._lock:
                    self.refused += 1
                time.sleep(min(2.0, float(e.response.headers.get("retry-after") or 0.5)))
        with self._lock:
            self.errors.append(f"refused 60 times: {prompt!r}")

    def _one(self, prompt: str) -> None:
        from openai import RateLimitError
        try:
            stream = self.client.completions.create(
                model="tiny", prompt=prompt, max_tokens=MAX_TOKENS, temperature=0, stream=True,
                stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
            text, finish, tokens = "", None, 0
            for chunk in stream:
                if chunk.choices:
                    text += chunk.choices[0].text or ""
                    finish = chunk.choices[0].finish_reason or finish
                if chunk.usage:
                    tokens = chunk.usage.completion_tokens
            with self._lock:
                self.results.append((prompt, text, finish, tokens))
        except RateLimitError:
            raise
        except Exception as e:                   # noqa: BLE001 (every failure is counted)
            with self._lock:
                self.errors.append(f"{type(e).__name__}: {e}")

    def clients(self, n: int, stop: threading.Event, pause_s: float = 0.0) -> list[threading.Thread]:
        def loop():
            while not stop.is_set():
                with self._lock:
                    prompt = PROMPTS[self._n % len(PROMPTS)]
                    self._n += 1
                self.one(prompt)
                stop.wait(pause_s)
        threads = [threading.Thread(target=loop, daemon=True) for _ in range(n)]
        for t in threads:
            t.start()
        return threads


def wait_plan(url: str, pred, what: str) -> dict:
    deadline = time.monotonic() + PHASE_S
    while time.monotonic() < deadline:
        state = plan_state(url)
        if pred(state):
            return state
        time.sleep(0.5)
    pytest.fail(f"{what} not within {PHASE_S:g} s: {json.dumps(state)[:3000]}")


def run_phase(load: Load, clients: int, pause_s: float, url: str, pred, what: str) -> dict:
    stop = threading.Event()
    threads = load.clients(clients, stop, pause_s)
    try:
        state = wait_plan(url, pred, what)
        time.sleep(4)                            # requests on the new shape too
    finally:
        stop.set()
        for t in threads:
            t.join(300)
    return state


def test_autoscale_steps_up_and_down_losing_nothing(model_dir, start_system, tmp_path):
    http = free_port()
    up = Up(["--model", model_dir, "--grpc-port", "0", "--http-port", str(http),
             "--served-model-name", "tiny", "--autoscale", "--slo-ttft-ms", "50",
             "--slo-itl-ms", "100", "--max-workers", "3", "--autoscale-interval-s", "2",
             "--profile", tiny_profile(tmp_path / "profile.json"), "--drain-timeout-s", "30",
             "--max-queue-delay-factor", "0", "--disaggregation", "always", *ENGINE])
    try:
        up.wait_line(r"^pdserve ready: ", 300)
        plan_url = up.wait_line(r"^pdserve autoscale: plan=(\S+)", 30).group(1)
        load = Load(f"http://127.0.0.1:{http}/v1")
        is_up = lambda s: s["current"] == s["target"] == {"prefill": 1, "decode": 2}  # noqa: E731
        state = run_phase(load, 6, 0.0, plan_url, is_up, "scale up to 1P2D")
        assert state["history"][-1]["decode"] == 2, state["history"]
        assert any("scale up to 1P2D" in r for r in state["history"][-1]["reasons"])
        up.wait_line(r"autoscale: 1P1D -> 1P2D", 10)
        n_high = len(load.results)
        is_down = lambda s: s["current"] == s["target"] == {"prefill": 1, "decode": 1}  # noqa: E731
        state = run_phase(load, 1, 1.5, plan_url, is_down, "scale down to 1P1D")
        assert any("scale down to 1P1D" in r for r in state["history"][-1]["reasons"])
        up.wait_line(r"retiring decode 1", 10)
    finally:
        up.stop()
    assert not load.errors, load.errors[:5]
    assert n_high >= 6 and len(load.results) > n_high
    assert all(f == "length" and t == MAX_TOKENS for _, _, f, t in load.results)
    fixed = start_system(1, 1, engine=_engine(), http_port=free_port(),   # unscaled reference
                         gateway_args=["--served-model-name", "tiny"])
    ref = Load(f"http://127.0.0.1:{fixed.http_port}/v1")
    with ThreadPoolExecutor(4) as pool:
        list(pool.map(ref.one, PROMPTS))
    assert not ref.errors
    expected = {p: text for p, text, _, _ in ref.results}
    wrong = [(p, text, expected[p]) for p, text, _, _ in load.results if text != expected[p]]
    assert not wrong, wrong[:3]


def _engine():
    from engine.config import EngineOptions
    return EngineOptions.of(max_num_seqs=2, block_size=16)
