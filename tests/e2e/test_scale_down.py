"""Scale-down loses nothing, over real processes (Launcher, KV over UCX on loopback): a
worker retired with `Launcher.retire` (SIGTERM, drain, never restarted) under load.

- Decode: 20 long greedy streams over 2 decode workers; one is retired with a drain shorter
  than the streams. Every stream completes with the engine's greedy tokens (none cut); the
  streams it still held at its hand-off (its own log line) are exactly the ones the gateway
  migrated; it exits by itself (code 0) and is not restarted; every KV block is back.
- Prefill: a burst of long prompts over 2 prefill workers; the one with queued prompts is
  retired with a 60 s drain: it hands them back at once (retried on the other, counted), its
  started ones finish, it exits within seconds; every request completes greedy-identical.
"""
from __future__ import annotations

import re
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from protos.pdserve.v1 import common_pb2
from tests.e2e.test_faults import (_busiest_prefill, _long_prompt_burst, fallbacks, greedy,
                                   pools_full, stream)
from tests.e2e.test_gateway import collect, gen_stub, prompts, request, stats
from tests.helpers import supervising, wait_until

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

DECODE_DRAIN_S, DECODE_MIGRATE_S = 4.0, 2.0
PREFILL_DRAIN_S = 60.0


@pytest.fixture(scope="module")
def llm(model_dir):
    from engine import LLM
    return LLM(model_dir)


@pytest.fixture(scope="module")
def supervised(start_system):
    """2 prefill + 2 decode workers and a gateway, supervised as `pdserve up` does."""
    from pdserve.launcher import free_port
    launcher = start_system(
        2, 2, gateway_args=["--health-interval-s", "0.5"], restart_backoff_s=0.5,
        http_port=free_port(),
        decode_args=["--drain-timeout-s", str(DECODE_DRAIN_S), "--drain-migrate-s",
                     str(DECODE_MIGRATE_S), "--num-blocks", "4096"],
        prefill_args=["--drain-timeout-s", str(PREFILL_DRAIN_S)])
    with supervising(launcher):
        yield launcher


def _retire(launcher, child) -> tuple[threading.Thread, dict]:
    """launcher.retire(child) in a thread (it blocks for the drain); -> (thread, result)."""
    out = {}

    def run():
        t0 = time.monotonic()
        launcher.retire(child)
        out["took"] = time.monotonic() - t0
    th = threading.Thread(target=run, name="retire", daemon=True)
    th.start()
    return th, out


def _log(child) -> str:
    return Path(child.log.name).read_text(errors="replace")


def test_retired_decode_worker_hands_its_streams_off(supervised, llm):
    n_streams, n_tokens = 20, 1500
    ps = prompts(llm, n_streams)
    want = greedy(llm, ps, n_tokens)
    stub = gen_stub(supervised.grpc_address)
    started = [threading.Event() for _ in ps]
    with ThreadPoolExecutor(n_streams) as pool:
        futs = [pool.submit(stream, stub, ps[i], n_tokens, started[i], 300) for i in range(n_streams)]
        for e in started:
            assert e.wait(120), "a stream did not start"
        running = stats(supervised, "decode")
        victim_addr = max(running, key=lambda a: running[a].num_running)
        assert running[victim_addr].num_running, "no stream on a decode worker"
        victim = next(c for c in supervised.workers("decode") if c.address == victim_addr)
        migrated = fallbacks(supervised, "migrate")
        th, out = _retire(supervised, victim)
        results = [f.result(timeout=300) for f in futs]
        th.join(DECODE_DRAIN_S + 30)
    for i, ((got, last), ref) in enumerate(zip(results, want)):
        assert got == ref, f"stream {i} was cut or diverged from the engine's greedy output"
        assert last.finish_reason == common_pb2.FINISH_REASON_LENGTH
    log = _log(victim)
    handed = [int(n) for n in re.findall(r"handing (\d+) open stream\(s\) to the gateway", log)]
    assert handed, f"the drained worker handed nothing off:\n{log[-3000:]}"
    assert fallbacks(supervised, "migrate") - migrated == sum(handed)
    assert "drain timeout" not in log, "calls were still cancelled at the drain's end"
    assert victim.popen.returncode == 0 and "took" in out
    assert victim not in supervised.children and victim.restarts == 0
    time.sleep(1.0)                         # a few supervision passes: no restart
    assert victim.popen.poll() == 0 and victim not in supervised.children
    pools_full(supervised, timeout_s=15.0)  # the surviving workers: every block back


def test_retired_prefill_worker_hands_its_queue_back(supervised, llm):
    ps, want, n_tokens = _long_prompt_burst(llm, seed=30)
    stub = gen_stub(supervised.grpc_address)
    retried = fallbacks(supervised, "retry")
    with ThreadPoolExecutor(len(ps)) as pool:
        futs = [pool.submit(collect, stub, request(ids, n_tokens, ignore_eos=True), 180)
                for ids in ps]
        victim = _busiest_prefill(supervised)
        th, out = _retire(supervised, victim)
        results = [f.result(timeout=180) for f in futs]
        th.join(PREFILL_DRAIN_S + 30)
    for i, ((got, last), ref) in enumerate(zip(results, want)):
        assert got == ref, f"request {i} diverged from the engine's greedy output"
        assert last.finish_reason == common_pb2.FINISH_REASON_LENGTH
    assert fallbacks(supervised, "retry") - retried >= 1, "no prompt was handed back"
    assert "prompt(s) back to the gateway" in _log(victim)
    assert victim.popen.returncode == 0
    # handed back at once: it did not wait out its 60 s drain on a queue
    assert out["took"] < PREFILL_DRAIN_S / 2, out
    assert victim not in supervised.children
    wait_until(lambda: (len(stats(supervised, "prefill")) == 1, None), 10, "one prefill left")
    pools_full(supervised, timeout_s=15.0)


QUESTIONS = ["Write a long story about a lighthouse keeper.", "Explain how bread is baked.",
             "Describe the water cycle in detail.", "List many facts about the planet Mars."]


@pytest.mark.timeout(1800)
def test_real_model_streams_survive_a_decode_scale_down(tmp_path):
    """The real default model (SmolLM2-135M), 1 prefill + 2 decode workers, streams through
    the openai SDK: retiring the decode worker holding the most streams, every stream still
    completes (finish "length", all its tokens), its handed-off streams migrated, and only
    those may differ from the undisturbed run: re-prefilling prompt + tokens so far is not
    bit-identical to decoding them one by one, and this model's greedy choice flips at a
    near-tie now and then (seen offline too, with no migration: the engine's own LLM,
    re-prefilling a greedy continuation at 15 split points, diverged at 5 of them)."""
    import openai

    from pdserve.launcher import Launcher, free_port
    launcher = Launcher("", 1, 2, log_dir=tmp_path, http_port=free_port(),
                        gateway_args=["--health-interval-s", "0.5"],
                        decode_args=["--drain-timeout-s", "6", "--drain-migrate-s", "3"])
    launcher.start(900)
    try:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{launcher.http_port}/v1",
                               api_key="none", max_retries=0, timeout=600)
        model = client.models.list().data[0].id

        def one(q, started=None):
            text, finish, n = "", None, 0
            for chunk in client.chat.completions.create(
                    model=model, messages=[{"role": "user", "content": q}], temperature=0,
                    max_tokens=300, stream=True, stream_options={"include_usage": True},
                    extra_body={"ignore_eos": True}):
                for c in chunk.choices:
                    text += c.delta.content or ""
                    finish = c.finish_reason or finish
                n = chunk.usage.completion_tokens if chunk.usage else n
                if started is not None and len(text) > 8:
                    started.set()
            return text, finish, n
        with ThreadPoolExecutor(len(QUESTIONS)) as pool:
            want = list(pool.map(one, QUESTIONS))
        started = [threading.Event() for _ in QUESTIONS]
        migrated = fallbacks(launcher, "migrate")
        with ThreadPoolExecutor(len(QUESTIONS)) as pool:
            futs = [pool.submit(one, q, e) for q, e in zip(QUESTIONS, started)]
            for e in started:
                assert e.wait(300), "a stream did not start"
            running = stats(launcher, "decode")
            victim_addr = max(running, key=lambda a: running[a].num_running)
            victim = next(c for c in launcher.workers("decode") if c.address == victim_addr)
            th, out = _retire(launcher, victim)
            got = [f.result(timeout=900) for f in futs]
            th.join(60)
        assert all(g[1:] == ("length", 300) for g in got + want), (got, want)
        handed = [int(n) for n in re.findall(r"handing (\d+) open stream\(s\) to the gateway",
                                             _log(victim))]
        assert handed, "the drained worker handed nothing off"
        assert fallbacks(launcher, "migrate") - migrated == sum(handed)
        differ = sum(g[0] != w[0] for g, w in zip(got, want))
        assert differ <= sum(handed), "a stream that did not migrate differs"
        assert victim.popen.returncode == 0
        pools_full(launcher, timeout_s=30.0)
        print(f"real model: {sum(handed)} stream(s) handed off and migrated, {differ} "
              f"differing from the undisturbed run; retire took {out.get('took', 0):.1f}s")
    finally:
        launcher.stop()
