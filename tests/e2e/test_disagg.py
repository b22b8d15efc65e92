"""Conditional disaggregation with real processes and the openai SDK as the client.

- `pdserve up --prefill 0 --disaggregation never` (a Launcher with no prefill worker): the
  decode worker computes every prompt; streaming and not, its greedy tokens equal the
  disaggregated 1P1D path's (--disaggregation always), on the tiny model and on SmolLM2;
  pdserve:prefills_total counts them local; a client that disconnects mid-stream leaves
  no KV block held.
- auto on 1P1D: a short prompt stays local, a long one sent while the decode worker streams
  goes to the prefill worker (UCX); prefills_total counts one of each.
"""
from __future__ import annotations

import re

import grpc
import httpx
import openai
import pytest

from pdserve.launcher import free_port
from protos.pdserve.v1 import common_pb2, decode_pb2_grpc, prefill_pb2_grpc
from tests.helpers import assert_disconnect_frees, wait_until

from tests.e2e.conftest import _start

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900)]

PROMPTS = [[{"role": "user", "content": "The quick brown fox jumps over the lazy dog."}],
           [{"role": "user", "content": "Name three colours of the rainbow, one per line, "
                                        "and say which is warmest and why."}]]
N = 24


def _system(model, tmp_path_factory, name, num_prefill, mode, *extra):
    port = free_port()
    launcher = _start(model, tmp_path_factory.mktemp(name), num_prefill, 1, http_port=port,
                      gateway_args=["--disaggregation", mode, "--health-interval-s", "0.5", *extra])
    launcher.http_base = f"http://127.0.0.1:{port}"
    return launcher


@pytest.fixture(scope="module")
def tiny_pair(model_dir, tmp_path_factory):
    systems = []
    try:
        systems.append(_system(model_dir, tmp_path_factory, "always", 1, "always"))
        systems.append(_system(model_dir, tmp_path_factory, "never", 0, "never"))
        yield systems
    finally:
        for s in systems:
            s.stop()


@pytest.fixture(scope="module")
def smollm2_pair(tmp_path_factory):
    from pdserve.default_model import resolve_default_model
    model = str(resolve_default_model())
    systems = []
    try:
        systems.append(_system(model, tmp_path_factory, "smol-always", 1, "always"))
        systems.append(_system(model, tmp_path_factory, "smol-never", 0, "never"))
        yield systems
    finally:
        for s in systems:
            s.stop()


def _client(system):
    return openai.OpenAI(base_url=system.http_base + "/v1", api_key="unused", max_retries=0,
                         timeout=300)


def _answers(system) -> list[tuple[str, int, str]]:
    """(text, completion tokens, stream's text) of each prompt, greedy, stream and not."""
    out = []
    with _client(system) as c:
        model = c.models.list().data[0].id
        for messages in PROMPTS:
            kw = dict(model=model, messages=messages, max_tokens=N, temperature=0.0,
                      extra_body={"ignore_eos": True})
            r = c.chat.completions.create(**kw)
            chunks = list(c.chat.completions.create(**kw, stream=True,
                                                    stream_options={"include_usage": True}))
            text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
            assert [ch.usage.completion_tokens for ch in chunks if ch.usage] == [N]
            out.append((r.choices[0].message.content, r.usage.completion_tokens, text))
    return out


def _prefills(system) -> dict[str, float]:
    text = httpx.get(system.http_base + "/metrics", timeout=30).text
    out = {}
    for labels, v in re.findall(r'^pdserve:prefills_total\{([^}]*)\} (\S+)$', text, re.M):
        kind = re.search(r'kind="(\w+)"', labels).group(1)
        out[kind] = out.get(kind, 0.0) + float(v)
    return out


def held_blocks(launcher):
    busy = {}
    for role, stub_cls in (("prefill", prefill_pb2_grpc.PrefillWorkerStub),
                           ("decode", decode_pb2_grpc.DecodeWorkerStub)):
        for c in launcher.workers(role):
            with grpc.insecure_channel(c.address) as ch:
                s = stub_cls(ch).Stats(common_pb2.StatsRequest(), timeout=5)
            if s.free_kv_blocks != s.total_kv_blocks or s.num_running or s.num_waiting:
                busy[c.address] = (s.free_kv_blocks, s.total_kv_blocks, s.num_running, s.num_waiting)
    return busy


def _same_tokens_both_ways(pair):
    always, never = pair
    assert not never.workers("prefill")
    before = _prefills(never)
    got_never, got_always = _answers(never), _answers(always)
    assert got_never == got_always
    for text, n, stream_text in got_never:
        assert n == N and text == stream_text and text
    after = _prefills(never)
    assert after["local"] - before.get("local", 0) == 2 * len(PROMPTS)
    assert after["disaggregated"] == 0
    assert _prefills(always)["local"] == 0
    wait_until(lambda: (not (b := held_blocks(never)) and not held_blocks(always), b), 10.0,
               "blocks held after the requests")


def test_never_without_prefill_workers_equals_the_disaggregated_path(tiny_pair):
    _same_tokens_both_ways(tiny_pair)


def test_never_on_smollm2_equals_the_disaggregated_path(smollm2_pair):
    _same_tokens_both_ways(smollm2_pair)
    with _client(smollm2_pair[1]) as c:       # and it says something sensible
        r = c.chat.completions.create(model=c.models.list().data[0].id, temperature=0.0,
                                      max_tokens=16, messages=[{"role": "user", "content":
                                                                "What is the capital of France?"}])
    assert "Paris" in r.choices[0].message.content


def test_a_disconnected_local_stream_frees_every_block(tiny_pair):
    never = tiny_pair[1]
    body = {"model": "x", "messages": PROMPTS[0], "max_tokens": 2000, "ignore_eos": True,
            "stream": True}
    body["model"] = httpx.get(never.http_base + "/v1/models", timeout=60).json()["data"][0]["id"]
    assert_disconnect_frees(never.http_base, body, lambda: held_blocks(never), 5.0)


def test_auto_keeps_a_short_prompt_local_and_disaggregates_a_long_one(model_dir, tmp_path_factory):
    auto = _system(model_dir, tmp_path_factory, "auto", 1, "auto",
                   "--disagg-max-local-tokens", "32", "--disagg-max-stall-ms", "1")
    try:
        with _client(auto) as c:
            model = c.models.list().data[0].id
            short = c.chat.completions.create(model=model, messages=[{"role": "user", "content": "Hi"}],
                                              max_tokens=400, temperature=0.0, stream=True,
                                              extra_body={"ignore_eos": True})
            first = next(iter(short))                     # streaming on the decode worker
            assert _prefills(auto) == {"disaggregated": 0, "local": 1}
            long_ = c.chat.completions.create(model=model, messages=[{"role": "user", "content":
                                              "Tell me about the fox. " * 20}], max_tokens=8,
                                              temperature=0.0)
            assert long_.usage.prompt_tokens > 32 and long_.usage.completion_tokens == 8
            assert _prefills(auto) == {"disaggregated": 1, "local": 1}
            rest = list(short)
            assert first and rest[-1].choices[0].finish_reason == "length"
        wait_until(lambda: (not (b := held_blocks(auto)), b), 10.0, "blocks held")
    finally:
        auto.stop()
