"""Load against `pdserve up`'s processes (1 prefill + 1 decode + gateway, the tiny model),
through the OpenAI REST port, from one asyncio client process:

- CLIENTS concurrent streaming clients: every stream completes (finish_reason, usage,
  [DONE]) with zero errors; a 429 (it must carry Retry-After) is retried after it, as a
  well-behaved client does; the gateway's RSS stays bounded.
- DISCONNECTS clients leaving at random points (before the response, mid-stream): every KV
  block is back in both pools within 2 s of the last one leaving (Stats).

Bounded: the decode worker takes up to 1,024 requests at once (--max-num-seqs), so the
1,000 streams are all in flight together; a stream has a deadline (STREAM_TIMEOUT_S), the
whole run LOAD_TIMEOUT_S.
"""
from __future__ import annotations

import asyncio
import json
import random
import time

import httpx
import pytest

from engine.config import EngineOptions
from pdserve.launcher import free_port
from tests.e2e.test_openai import held_blocks
from tests.helpers import wait_until

pytestmark = pytest.mark.e2e

CLIENTS = 1000
DISCONNECTS = 200
MAX_TOKENS = 8
STREAM_TIMEOUT_S = 120.0
LOAD_TIMEOUT_S = 300.0
RSS_GROWTH_MB = 256        # peak gateway RSS during the burst over its RSS before (~35-90 MB seen)


@pytest.fixture(scope="module")
def system(start_system):
    port = free_port()
    # A 1 s probe timeout is a health verdict a decode worker busy with 1,000 streams on a
    # shared 2-core box can miss (one missed probe marks it failed: 503s, see
    # gateway/registry.py); this test is about the streams, so its probes get 5 s.
    launcher = start_system(1, 1, http_port=port, engine=EngineOptions.of(max_num_seqs=1024),
                            gateway_args=["--health-interval-s", "0.5", "--probe-timeout-s", "5"])
    launcher.http_base = f"http://127.0.0.1:{port}"
    return launcher


def _rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:")) / 1024


def _body(i: int, max_tokens: int) -> dict:
    return {"model": "", "prompt": f"Request {i}: the quick brown fox jumps over the lazy dog",
            "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}


async def _stream(http: httpx.AsyncClient, url: str, body: dict, stats: dict) -> None:
    """One client: the whole stream, retrying after each 429's Retry-After."""
    while True:
        async with http.stream("POST", url, json=body) as r:
            if r.status_code == 429:
                await r.aread()
                assert r.headers.get("retry-after", "").isdigit(), r.headers
                stats["429"] += 1
                await asyncio.sleep(int(r.headers["retry-after"]) * random.uniform(0.5, 1.0))
                continue
            assert r.status_code == 200, (r.status_code, await r.aread())
            finish = usage = done = None
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    done = True
                    continue
                chunk = json.loads(line[6:])
                assert "error" not in chunk, chunk
                for c in chunk["choices"]:
                    finish = c.get("finish_reason") or finish
                usage = chunk.get("usage") or usage
            assert done and finish == "length" and usage["completion_tokens"] == MAX_TOKENS, \
                (done, finish, usage)
            stats["ok"] += 1
            return


def test_1000_concurrent_streams_all_complete_and_gateway_rss_is_bounded(system, model_dir):
    gateway = next(c for c in system.children if c.role == "gateway")
    url = system.http_base + "/v1/completions"
    model = httpx.get(system.http_base + "/v1/models", timeout=10).json()["data"][0]["id"]

    async def main():
        limits = httpx.Limits(max_connections=CLIENTS + 10, max_keepalive_connections=CLIENTS + 10)
        # The warm-up has its own pool: a kept-alive connection that the server closes
        # (idle timeout) while the burst's 1,000 tasks start would be one stream's ReadError.
        async with httpx.AsyncClient(timeout=STREAM_TIMEOUT_S) as warm:
            await _stream(warm, url, {**_body(-1, MAX_TOKENS), "model": model}, {"ok": 0, "429": 0})
        async with httpx.AsyncClient(timeout=STREAM_TIMEOUT_S, limits=limits) as http:
            rss0, peak = _rss_mb(gateway.pid), 0.0
            stats = {"ok": 0, "429": 0}
            tasks = [asyncio.create_task(_stream(http, url, {**_body(i, MAX_TOKENS), "model": model},
                                                 stats)) for i in range(CLIENTS)]
            t0 = time.monotonic()
            while not all(t.done() for t in tasks):
                peak = max(peak, _rss_mb(gateway.pid))
                await asyncio.wait(tasks, timeout=0.2)
            errors = [t.exception() for t in tasks if t.exception() is not None]
            return stats, errors, rss0, peak, _rss_mb(gateway.pid), time.monotonic() - t0
    stats, errors, rss0, peak, rss1, wall = asyncio.run(asyncio.wait_for(main(), LOAD_TIMEOUT_S))
    print(f"{CLIENTS} streams in {wall:.1f}s, {stats['429']} 429s retried; gateway RSS "
          f"{rss0:.0f} MB before, peak {peak:.0f} MB, {rss1:.0f} MB after")
    assert not errors, f"{len(errors)} of {CLIENTS} streams failed, e.g. {errors[:3]}"
    assert stats["ok"] == CLIENTS
    assert peak - rss0 < RSS_GROWTH_MB, (rss0, peak)
    wait_until(lambda: (not (b := held_blocks(system)), b), 5.0, "every block free after the load")


def test_200_random_disconnects_free_every_block_within_2s(system):
    """Each client leaves at a random point: before any response (0-300 ms after sending),
    or after a random number of chunks (0-40) of a 400-token stream."""
    url = system.http_base + "/v1/completions"
    model = httpx.get(system.http_base + "/v1/models", timeout=10).json()["data"][0]["id"]
    rng = random.Random(12)

    async def leave(http: httpx.AsyncClient, i: int) -> str:
        body = {**_body(i, 400), "model": model}
        if rng.random() < 0.3:                      # gone before the first byte
            try:
                await asyncio.wait_for(http.post(url, json=body), rng.uniform(0.0, 0.3))
                return "finished"
            except TimeoutError:
                return "before"
        after = rng.randrange(0, 40)
        while True:          # a burst of 200 may be refused in part (the prefill slowdown bound)
            async with http.stream("POST", url, json=body) as r:
                if r.status_code == 429:             # refused before any work: try again
                    await r.aread()
                    await asyncio.sleep(int(r.headers["retry-after"]) * random.uniform(0.5, 1.0))
                    continue
                assert r.status_code == 200, r.status_code
                n = 0
                async for line in r.aiter_lines():
                    if line.startswith("data: "):
                        n += 1
                        if n > after:
                            return "mid-stream"      # leaving the block closes the connection
            return "finished"

    async def main():
        limits = httpx.Limits(max_connections=DISCONNECTS + 10)
        async with httpx.AsyncClient(timeout=STREAM_TIMEOUT_S, limits=limits) as http:
            return await asyncio.gather(*(leave(http, i) for i in range(DISCONNECTS)))
    how = asyncio.run(asyncio.wait_for(main(), LOAD_TIMEOUT_S))
    t0 = time.monotonic()
    wait_until(lambda: (not (b := held_blocks(system)), b), 2.0,
               "every KV block free after the disconnects")
    print(f"disconnects: {sorted((k, how.count(k)) for k in set(how))}, blocks free after "
          f"{time.monotonic() - t0:.2f}s")
    assert how.count("before") >= 20 and how.count("mid-stream") >= 100, how
