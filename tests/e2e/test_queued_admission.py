"""More concurrent streams than the decode worker's batch (--max-num-seqs) are queued, not
refused (issue 34: a closed loop of 64 clients admitted): on the disaggregated path (a
Decode call waits for a free slot before it reserves KV: decode_worker/reservations.py) and
on the local one (the engine's own waiting queue). Every stream completes with the tokens the
same prompt gets alone (greedy), none is refused (429), and every KV block is back after.
The tiny model, 1 prefill + 1 decode + gateway, max_num_seqs 2, STREAMS streams at once.
"""
from __future__ import annotations

import asyncio

import httpx
import pytest

from engine.config import EngineOptions
from pdserve import loadgen
from pdserve.launcher import free_port
from tests.e2e.test_openai import held_blocks
from tests.helpers import wait_until

pytestmark = pytest.mark.e2e

BATCH = 2
STREAMS = 10
MAX_TOKENS = 12
LONG_TOKENS = 3000          # the tiny model's context: 4096
TIMEOUT_S = 120.0


@pytest.fixture(scope="module", params=["always", "never"])
def system(request, start_system):
    port = free_port()
    launcher = start_system(1, 1, http_port=port, engine=EngineOptions.of(max_num_seqs=BATCH),
                            gateway_args=["--disaggregation", request.param])
    launcher.http_base = f"http://127.0.0.1:{port}"
    return launcher


def _prompt(i: int) -> str:
    return f"Stream {i} asks: the quick brown fox jumps over the lazy dog"


async def _run(base: str, model: str, prompts: list[str], concurrency: int) -> list[dict]:
    target = loadgen.Target(base, model, timeout_s=TIMEOUT_S, keep_gaps=True)
    records, _ = await loadgen.closed_loop(
        target, iter(loadgen.Job(p, MAX_TOKENS) for p in prompts), concurrency=concurrency,
        duration_s=float("inf"), deadline_s=TIMEOUT_S, max_requests=None,
        progress=loadgen.Progress(None, enabled=False))
    return records


async def _texts(base: str, model: str, prompts: list[str]) -> list[str]:
    async with httpx.AsyncClient(timeout=TIMEOUT_S) as http:
        async def one(p):
            r = await http.post(base + "/v1/completions", json={
                "model": model, "prompt": p, "max_tokens": MAX_TOKENS, "temperature": 0,
                "ignore_eos": True})
            assert r.status_code == 200, r.text
            return r.json()["choices"][0]["text"]
        return list(await asyncio.gather(*(one(p) for p in prompts)))


def test_streams_over_the_batch_size_are_queued_not_refused(system):
    base = system.http_base
    model = httpx.get(base + "/v1/models", timeout=10).json()["data"][0]["id"]
    prompts = [_prompt(i) for i in range(STREAMS)]
    alone = [asyncio.run(_texts(base, model, [p]))[0] for p in prompts]       # one at a time
    records = asyncio.run(_run(base, model, prompts, STREAMS))
    bad = [r for r in records if r["status"] != "ok"]
    assert not bad, f"{len(bad)} of {STREAMS} not served: {[r['error'] for r in bad][:3]}"
    assert all(r["output_tokens"] == MAX_TOKENS for r in records)
    together = asyncio.run(_texts(base, model, prompts))                      # all at once
    assert together == alone
    wait_until(lambda: (not (b := held_blocks(system)), b), 10.0, "every block free after the load")


def test_clients_leaving_while_queued_free_every_block(system):
    """STREAMS long streams, BATCH of them running and the rest queued; every client leaves
    once the first tokens came (at once: a stream of LONG_TOKENS lasts longer than that on any
    machine this runs on, ~0.3 ms a token of the tiny model here): nothing stays reserved,
    queued or running."""
    base = system.http_base
    model = httpx.get(base + "/v1/models", timeout=10).json()["data"][0]["id"]

    async def main():
        first = asyncio.Event()
        async with httpx.AsyncClient(timeout=TIMEOUT_S) as http:
            async def one(i):
                body = {"model": model, "prompt": _prompt(100 + i), "max_tokens": LONG_TOKENS,
                        "temperature": 0, "ignore_eos": True, "stream": True}
                async with http.stream("POST", base + "/v1/completions", json=body) as r:
                    assert r.status_code == 200
                    async for line in r.aiter_lines():
                        if line.startswith("data: {"):
                            first.set()
            tasks = [asyncio.create_task(one(i)) for i in range(STREAMS)]
            await asyncio.wait_for(first.wait(), TIMEOUT_S)
            for t in tasks:
                t.cancel()
            return await asyncio.gather(*tasks, return_exceptions=True)
    results = asyncio.run(main())
    assert all(isinstance(r, asyncio.CancelledError) for r in results), results
    wait_until(lambda: (not (b := held_blocks(system)), b), 10.0, "every block free after leaving")
