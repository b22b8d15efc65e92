"""The KV offload tiers in real processes (what `pdserve up --kv-offload-host-gb ...
--kv-offload-disk DIR` runs): 1 prefill worker with a 12-block device pool and both tiers, 1
decode worker, a gateway; the openai SDK as client. A prompt evicted from the prefill
worker's pool by four others comes back from its host tier (its /metrics: blocks revived),
with the same greedy completion as the first time; its disk tier holds no block while the host
tier has room (write-back), and all of them once the worker is retired (written at close)."""
from __future__ import annotations

import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from pdserve.launcher import free_port

pytestmark = pytest.mark.e2e

P = [3 + i % 50 for i in range(64)]
OTHERS = [[7 + (i * 13 + j) % 90 for j in range(60)] for i in range(4)]


@pytest.fixture(scope="module")
def system(start_system, tmp_path_factory):
    port, disk = free_port(), tmp_path_factory.mktemp("kv-disk")
    launcher = start_system(1, 1, http_port=free_port(), prefill_args=[
        "--metrics-port", str(port), "--num-blocks", "12", "--block-size", "16",
        "--kv-offload-host-gb", "0.01", "--kv-offload-disk", str(disk)],
        gateway_args=["--health-interval-s", "0.5"])
    launcher.prefill_metrics, launcher.kv_disk = port, disk
    return launcher


def tier_metric(system, name: str, tier: str) -> float:
    with urllib.request.urlopen(f"http://127.0.0.1:{system.prefill_metrics}/metrics", timeout=10) as r:
        text = r.read().decode()
    return sum(s.value for fam in text_string_to_metric_families(text) for s in fam.samples
               if s.name == "pdserve:" + name and s.labels.get("tier") == tier)


def test_an_evicted_prompt_comes_back_from_the_host_tier(system):
    from openai import OpenAI
    client = OpenAI(base_url=f"http://127.0.0.1:{system.http_port}/v1", api_key="none",
                    timeout=60, max_retries=0)
    model = client.models.list().data[0].id

    def complete(prompt):
        return client.completions.create(model=model, prompt=prompt, max_tokens=4,
                                         temperature=0.0, extra_body={"ignore_eos": True})
    first = complete(P)
    for other in OTHERS:
        complete(other)
    before = tier_metric(system, "kv_tier_hits_total", "host")
    again = complete(P)
    assert again.choices[0].text == first.choices[0].text
    assert tier_metric(system, "kv_tier_hits_total", "host") - before >= 3
    assert tier_metric(system, "kv_tier_bytes_total", "host") > 0
    # host -> disk is write-back: while the host tier holds them no block is on disk ...
    files = lambda: len(list(system.kv_disk.glob("slot-0/*.kvb")))   # noqa: E731
    assert files() == 0 and tier_metric(system, "kv_tier_blocks", "disk") == 0
    # ... and a worker that stops (scale-down: SIGTERM, drain, close) writes them down
    system.retire(system.workers("prefill")[0], timeout_s=60)
    assert files() >= 4 + 4 * 3
