"""The OpenAI REST shim end to end: real gateway + workers, the official `openai` SDK.

System A (1 prefill + 1 decode, --api-key): every parameter, streaming and not, sync and
async clients, structured output, tool calls, logprobs, errors, disconnect.
System B (1 + 1, a decode worker with 8 KV blocks): 429 while its blocks are held, then its
workers are killed for 503.
"""
from __future__ import annotations

import asyncio
import json

import grpc
import httpx
import jsonschema
import openai
import pytest

from pdserve.launcher import free_port
from protos.pdserve.v1 import common_pb2, decode_pb2_grpc, generation_pb2, generation_pb2_grpc, prefill_pb2_grpc
from tests.helpers import assert_disconnect_frees, wait_until

pytestmark = pytest.mark.e2e

KEY = "sk-test-key"
PROMPT = [{"role": "user", "content": "The quick brown fox jumps over the lazy dog."}]
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 10},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "color": {"enum": ["red", "green", "blue"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 5}, "maxItems": 2},
    },
    "required": ["name", "age", "color", "tags"],
    "additionalProperties": False,
}
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "weather in a city",
    "parameters": {"type": "object", "properties": {
        "city": {"enum": ["Paris", "Tokyo", "Lima"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7}},
        "required": ["city", "days"], "additionalProperties": False}}}
CLOCK = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {
        "zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"], "additionalProperties": False}}}


@pytest.fixture(scope="module")
def sys_a(start_system):
    port = free_port()
    launcher = start_system(1, 1, http_port=port,
                            gateway_args=["--api-key", KEY, "--health-interval-s", "0.5"])
    launcher.http_base = f"http://127.0.0.1:{port}"
    return launcher


@pytest.fixture(scope="module")
def client(sys_a):
    with openai.OpenAI(base_url=sys_a.http_base + "/v1", api_key=KEY, max_retries=0,
                       timeout=60) as c:
        yield c


@pytest.fixture(scope="module")
def model(client):
    return client.models.list().data[0].id


def chat(client, model, **kw):
    kw.setdefault("messages", PROMPT)
    kw.setdefault("max_tokens", 12)
    return client.chat.completions.create(model=model, **kw)


def stream_chat(client, model, **kw):
    chunks = list(chat(client, model, stream=True, **kw))
    texts, finish, usage, roles = {}, {}, None, {}
    for ch in chunks:
        if ch.usage is not None:
            usage = ch.usage
        for c in ch.choices:
            if c.delta.role:
                roles[c.index] = c.delta.role
            texts[c.index] = texts.get(c.index, "") + (c.delta.content or "")
            if c.finish_reason:
                finish[c.index] = c.finish_reason
    return chunks, texts, finish, usage, roles


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


# ----------------------------------------------------------------------------- basics

def test_models_and_health(sys_a, client, model):
    assert model == client.models.retrieve(model).id
    r = httpx.get(sys_a.http_base + "/health", timeout=10)
    assert r.status_code == 200
    spec = httpx.get(sys_a.http_base + "/openapi.json", timeout=10).json()
    for path in ("/v1/chat/completions", "/v1/completions", "/v1/models", "/v1/models/{model_id}", "/health"):
        assert path in spec["paths"], path
    assert "ChatCompletionRequest" in spec["components"]["schemas"]


def test_chat_stream_and_non_stream_agree_greedy(client, model):
    full = chat(client, model, temperature=0, max_tokens=10, logprobs=True, top_logprobs=3)
    c = full.choices[0]
    assert c.finish_reason == "length" and full.usage.completion_tokens == 10
    assert full.usage.prompt_tokens > 0 and full.usage.prompt_tokens_details.cached_tokens >= 0
    assert len(c.logprobs.content) == 10 and all(len(t.top_logprobs) == 3 for t in c.logprobs.content)
    chunks, texts, finish, usage, roles = stream_chat(
        client, model, temperature=0, max_tokens=10, logprobs=True, top_logprobs=3,
        stream_options={"include_usage": True})
    assert roles == {0: "assistant"} and chunks[0].choices[0].delta.role == "assistant"
    assert texts[0] == c.message.content and finish == {0: "length"}
    assert usage.completion_tokens == 10 and chunks[-1].choices == []
    streamed = [t for ch in chunks for cc in ch.choices if cc.logprobs for t in cc.logprobs.content]
    assert [t.token for t in streamed] == [t.token for t in c.logprobs.content]
    for a, b in zip(streamed, c.logprobs.content):
        assert a.logprob == pytest.approx(b.logprob, abs=1e-4)
        assert [x.token for x in a.top_logprobs] == [x.token for x in b.top_logprobs]


def test_greedy_text_equals_grpc_api(sys_a, client, model):
    out = chat(client, model, temperature=0, max_tokens=16)
    stub = generation_pb2_grpc.GenerationStub(grpc.insecure_channel(sys_a.grpc_address))
    req = generation_pb2.GenerateRequest(
        chat=generation_pb2.ChatMessages(messages=[generation_pb2.ChatMessage(**PROMPT[0])],
                                         add_generation_prompt=True),
        sampling=common_pb2.SamplingParams(temperature=0, max_tokens=16),
        stream_options=generation_pb2.StreamOptions(stream=False))
    text = "".join(m.text for m in stub.Generate(req, timeout=60,  # --api-key covers gRPC too
                                                 metadata=[("authorization", f"Bearer {KEY}")]))
    assert out.choices[0].message.content == text


def test_sampling_parameters_accepted_stream_and_not(client, model):
    extra = dict(top_k=5, min_p=0.05, repetition_penalty=1.2, min_tokens=3, ignore_eos=True)
    kw = dict(temperature=0.8, top_p=0.9, seed=7, presence_penalty=0.5, frequency_penalty=0.3,
              logit_bias={"5": 2.0}, stop=["zz", "qq"], user="u1", max_completion_tokens=8,
              max_tokens=None, extra_body=extra)
    a = chat(client, model, **kw)
    b = chat(client, model, **kw)
    assert a.choices[0].message.content == b.choices[0].message.content     # seeded
    _, texts, finish, _, _ = stream_chat(client, model, **kw)
    assert texts[0] == a.choices[0].message.content
    assert finish[0] in ("length", "stop") and a.usage.completion_tokens >= 3


def test_stop_string_cuts_text(client, model):
    ref = chat(client, model, temperature=0, max_tokens=12).choices[0].message.content
    stop = ref[4:7]
    out = chat(client, model, temperature=0, max_tokens=12, stop=stop)
    assert out.choices[0].finish_reason == "stop" and out.choices[0].message.content == ref[:ref.index(stop)]
    _, texts, finish, _, _ = stream_chat(client, model, temperature=0, max_tokens=12, stop=[stop])
    assert texts[0] == ref[:ref.index(stop)] and finish[0] == "stop"


def test_n3_streaming(client, model):
    chunks, texts, finish, usage, roles = stream_chat(
        client, model, n=3, temperature=1.0, seed=1, max_tokens=6,
        stream_options={"include_usage": True})
    assert set(texts) == {0, 1, 2} and roles == {0: "assistant", 1: "assistant", 2: "assistant"}
    assert finish == {0: "length", 1: "length", 2: "length"}
    assert usage.completion_tokens == 18
    full = chat(client, model, n=3, temperature=1.0, seed=1, max_tokens=6)
    assert [c.message.content for c in full.choices] == [texts[i] for i in range(3)]


def test_async_client_stream(sys_a, model):
    async def main():
        async with openai.AsyncOpenAI(base_url=sys_a.http_base + "/v1", api_key=KEY,
                                      max_retries=0, timeout=60) as ac:
            full = await ac.chat.completions.create(model=model, messages=PROMPT, temperature=0,
                                                    max_tokens=8)
            text = ""
            async for ch in await ac.chat.completions.create(
                    model=model, messages=PROMPT, temperature=0, max_tokens=8, stream=True):
                for c in ch.choices:
                    text += c.delta.content or ""
            comp = await ac.completions.create(model=model, prompt="Hello there", max_tokens=5,
                                               temperature=0)
            return full, text, comp
    full, text, comp = asyncio.run(main())
    assert text == full.choices[0].message.content
    assert comp.usage.completion_tokens == 5


# ----------------------------------------------------------------------------- completions

def test_completions_stream_and_logprobs(client, model):
    a = client.completions.create(model=model, prompt=["Hello there", "Good morning"],
                                  max_tokens=6, temperature=0, logprobs=2, n=2)
    assert [c.index for c in a.choices] == [0, 1, 2, 3]
    assert a.choices[0].text == a.choices[1].text                    # greedy, same prompt
    assert len(a.choices[0].logprobs.tokens) == 6 and len(a.choices[0].logprobs.top_logprobs[0]) == 2
    texts = {}
    for ch in client.completions.create(model=model, prompt=["Hello there", "Good morning"],
                                        max_tokens=6, temperature=0, n=2, stream=True):
        for c in ch.choices:
            texts[c.index] = texts.get(c.index, "") + c.text
    assert [texts[i] for i in range(4)] == [c.text for c in a.choices]


def test_completions_echo_prompt_logprobs_for_loglikelihood(client, model):
    """lm-eval's loglikelihood request: echo + logprobs + max_tokens=0."""
    r = client.completions.create(model=model, prompt="Hello there, friend", max_tokens=0,
                                  echo=True, logprobs=1, temperature=0)
    c = r.choices[0]
    assert c.text == "Hello there, friend"
    lp = c.logprobs
    assert lp.token_logprobs[0] is None and all(x <= 0 for x in lp.token_logprobs[1:])
    assert len(lp.tokens) == r.usage.prompt_tokens and r.usage.completion_tokens == 0
    # echo with generation: prompt logprobs then the generated tokens' logprobs
    r2 = client.completions.create(model=model, prompt="Hello there, friend", max_tokens=3,
                                   echo=True, logprobs=1, temperature=0)
    assert r2.choices[0].text.startswith("Hello there, friend")
    echoed = r2.choices[0].logprobs.token_logprobs[:len(lp.tokens)]
    assert echoed[0] is None and echoed[1:] == pytest.approx(lp.token_logprobs[1:], abs=1e-4)
    assert len(r2.choices[0].logprobs.tokens) == len(lp.tokens) + 3


# ----------------------------------------------------------------------------- structured, tools

def test_json_schema_response_format(client, model):
    rf = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA}}
    for temperature in (0.0, 1.0):
        out = chat(client, model, temperature=temperature, seed=3, max_tokens=200, response_format=rf)
        assert out.choices[0].finish_reason == "stop"
        jsonschema.validate(json.loads(out.choices[0].message.content), SCHEMA)
    _, texts, finish, _, _ = stream_chat(client, model, temperature=0, max_tokens=200, response_format=rf)
    jsonschema.validate(json.loads(texts[0]), SCHEMA)


def test_forced_tool_call_stream_and_not(client, model):
    choice = {"type": "function", "function": {"name": "get_weather"}}
    out = chat(client, model, tools=[WEATHER, CLOCK], tool_choice=choice, temperature=0, max_tokens=100)
    c = out.choices[0]
    assert c.finish_reason == "tool_calls" and c.message.content is None
    call = c.message.tool_calls[0]
    assert call.id and call.type == "function" and call.function.name == "get_weather"
    args = json.loads(call.function.arguments)
    jsonschema.validate(args, WEATHER["function"]["parameters"])
    chunks = list(chat(client, model, tools=[WEATHER, CLOCK], tool_choice=choice, temperature=0,
                       max_tokens=100, stream=True))
    name, arguments, ids, finish = "", "", set(), None
    for ch in chunks:
        for cc in ch.choices:
            for tc in cc.delta.tool_calls or []:
                assert tc.index == 0
                ids |= {tc.id} if tc.id else set()
                name += tc.function.name or "" if tc.function else ""
                if tc.function and tc.function.arguments:
                    assert name == "get_weather"             # the name comes first
                    arguments += tc.function.arguments
            finish = cc.finish_reason or finish
    assert name == "get_weather" and finish == "tool_calls" and len(ids) == 1
    assert arguments == call.function.arguments   # (splitting: tests/unit/test_tool_stream.py)


def test_required_tool_choice(client, model):
    """`required` forces a call to one of the tools; with parallel_tool_calls=false, exactly one
    (a bounded grammar, so even the random tiny model must finish it)."""
    for stream in (False, True):
        out = chat(client, model, tools=[WEATHER, CLOCK], tool_choice="required", temperature=0,
                   max_tokens=150, parallel_tool_calls=False, stream=stream)
        if stream:
            calls, finish = {}, None
            for ch in out:
                for cc in ch.choices:
                    for tc in cc.delta.tool_calls or []:
                        c = calls.setdefault(tc.index, {"name": "", "arguments": ""})
                        c["name"] += tc.function.name or ""
                        c["arguments"] += tc.function.arguments or ""
                    finish = cc.finish_reason or finish
            calls = [(c["name"], c["arguments"]) for c in calls.values()]
        else:
            finish = out.choices[0].finish_reason
            calls = [(c.function.name, c.function.arguments) for c in out.choices[0].message.tool_calls]
        assert finish == "tool_calls" and len(calls) == 1
        name, arguments = calls[0]
        tool = {"get_weather": WEATHER, "get_time": CLOCK}[name]
        jsonschema.validate(json.loads(arguments), tool["function"]["parameters"])


def _call_schema(tool):
    f = tool["function"]
    return {"type": "object", "properties": {"name": {"const": f["name"]}, "arguments": f["parameters"]},
            "required": ["name", "arguments"], "additionalProperties": False}


def test_auto_tool_calls_stream_incrementally(client, model):
    """tool_choice auto, streamed: each call's id and name first, then its arguments in pieces
    that join to exactly the unstreamed call's arguments; distinct indexes; "tool_calls".
    (auto leaves the output free: a response_format of the call format's schema, two calls,
    makes the random tiny model write calls. How many pieces depends on how many tokens the
    decode worker coalesces per message; the splitting itself: tests/unit/test_tool_stream.py.)"""
    rf = {"type": "json_schema", "json_schema": {"name": "calls", "schema": {
        "type": "array", "minItems": 2, "maxItems": 2,
        "items": {"anyOf": [_call_schema(WEATHER), _call_schema(CLOCK)]}}}}
    kw = dict(tools=[WEATHER, CLOCK], tool_choice="auto", response_format=rf, temperature=0,
              max_tokens=300)
    out = chat(client, model, **kw).choices[0]
    assert out.finish_reason == "tool_calls" and out.message.content is None
    want = [(c.function.name, c.function.arguments) for c in out.message.tool_calls]
    calls, finish, content = {}, None, ""
    for ch in chat(client, model, stream=True, **kw):
        for cc in ch.choices:
            content += cc.delta.content or ""
            for tc in cc.delta.tool_calls or []:
                c = calls.setdefault(tc.index, {"id": tc.id, "name": tc.function.name,
                                                "pieces": []})
                assert c["name"], "the first delta of a call names it"
                if tc.function.arguments:
                    c["pieces"].append(tc.function.arguments)
            finish = cc.finish_reason or finish
    assert finish == "tool_calls" and content == "" and sorted(calls) == [0, 1]
    assert len({c["id"] for c in calls.values()}) == 2 and all(c["id"] for c in calls.values())
    assert [(c["name"], "".join(c["pieces"])) for c in calls.values()] == want
    for name, arguments in want:
        jsonschema.validate(json.loads(arguments), {"get_weather": WEATHER, "get_time": CLOCK}[
            name]["function"]["parameters"])


def test_auto_plain_text_streams_as_content(client, model):
    """tool_choice auto whose output is not a call: streamed as content while it is generated
    (several chunks, no tool_calls), the same text as unstreamed. 400 tokens: 20 of the tiny
    model's took ~6 ms, and could reach the client as one chunk."""
    kw = dict(tools=[WEATHER, CLOCK], tool_choice="auto", temperature=0, max_tokens=400)
    out = chat(client, model, **kw).choices[0]
    assert out.message.tool_calls is None and out.message.content
    assert not out.message.content.lstrip().startswith(("{", "[", "<")), out.message.content
    chunks, texts, finish, _, _ = stream_chat(client, model, **kw)
    pieces = [c.delta.content for ch in chunks for c in ch.choices if c.delta.content]
    assert not any(c.delta.tool_calls for ch in chunks for c in ch.choices)
    assert texts[0] == out.message.content and finish[0] == out.finish_reason
    assert len(pieces) > 1


# ----------------------------------------------------------------------------- errors

def _err(r: httpx.Response, status: int) -> dict:
    assert r.status_code == status, r.text
    body = r.json()["error"]
    assert set(body) == {"message", "type", "param", "code"} and body["message"]
    return body


def test_error_statuses(sys_a, model):
    url = sys_a.http_base
    h = {"Authorization": f"Bearer {KEY}"}
    ok = {"model": model, "messages": PROMPT, "max_tokens": 2}
    _err(httpx.post(url + "/v1/chat/completions", json=ok, timeout=30), 401)
    assert _err(httpx.post(url + "/v1/chat/completions", json=ok, timeout=30,
                           headers={"Authorization": "Bearer wrong"}), 401)["type"] == "authentication_error"
    assert _err(httpx.post(url + "/v1/chat/completions", json={**ok, "model": "nope"}, headers=h,
                           timeout=30), 404)["code"] == "model_not_found"
    _err(httpx.get(url + "/v1/models/nope", headers=h, timeout=30), 404)
    for bad in ({**ok, "temperature": 9}, {**ok, "messages": []}, {**ok, "n": 0},
                {"messages": PROMPT}, {**ok, "top_logprobs": 99, "logprobs": True},
                {**ok, "logit_bias": {"x": 1}}, {**ok, "tool_choice": "required"},
                {**ok, "response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
                {**ok, "response_format": {"type": "json_schema",
                                           "json_schema": {"name": "x", "schema": {"type": "nope"}}}},
                {**ok, "messages": [{"role": "user", "content": "x " * 5000}]},
                {**ok, "max_tokens": 10 ** 6}):
        _err(httpx.post(url + "/v1/chat/completions", json=bad, headers=h, timeout=30), 400)
    _err(httpx.post(url + "/v1/chat/completions", content=b"{not json", headers=h, timeout=30), 400)
    _err(httpx.post(url + "/v1/completions", json={"model": model, "prompt": "x", "max_tokens": 0},
                    headers=h, timeout=30), 400)
    _err(httpx.post(url + "/v1/completions", json={"model": model, "prompt": [10 ** 7]},
                    headers=h, timeout=30), 400)
    assert httpx.get(url + "/v1/models", headers=h, timeout=30).status_code == 200


def test_disconnect_frees_blocks_on_both_workers(sys_a, model):
    body = {"model": model, "messages": PROMPT, "max_tokens": 2000, "ignore_eos": True,
            "stream": True}
    assert_disconnect_frees(sys_a.http_base, body, lambda: held_blocks(sys_a), 2.0,
                            headers={"Authorization": f"Bearer {KEY}"})


# ----------------------------------------------------------------------------- 429 / 503

def test_resource_exhausted_429_then_unavailable_503(start_system, model_dir):
    port = free_port()
    # --max-waiting-reservations 0: the decode worker refuses a reservation it has no room
    # for at once (by default it waits for room: decode_worker/reservations.py);
    # --kernel-backend torch: its steps layer by layer on the torch references, so that the
    # held stream's 40 tokens outlast the requests below (in one C call a step of the tiny
    # model is ~0.3 ms: the stream was over before they came)
    sys_b = start_system(1, 1, http_port=port,
                         decode_args=["--num-blocks", "8", "--max-waiting-reservations", "0",
                                      "--kernel-backend", "torch"],
                         gateway_args=["--health-interval-s", "0.3"])
    base = f"http://127.0.0.1:{port}"
    name = httpx.get(base + "/v1/models", timeout=10).json()["data"][0]["id"]
    long_prompt = "The quick brown fox jumps over the lazy dog. " * 4     # ~ 5 blocks
    with httpx.Client(timeout=30) as c:
        hold = {"model": name, "prompt": long_prompt, "max_tokens": 40, "ignore_eos": True,
                "stream": True, "temperature": 0}
        with c.stream("POST", base + "/v1/completions", json=hold) as r:
            assert r.status_code == 200
            lines = r.iter_lines()
            next(lines)
            other = "Good morning! How are you today? I am fine. " * 4     # no shared prefix
            refused = c.post(base + "/v1/completions",
                             json={"model": name, "prompt": other, "max_tokens": 4})
            with grpc.insecure_channel(sys_b.grpc_address) as ch:    # the same hint on gRPC
                call = generation_pb2_grpc.GenerationStub(ch).Generate(generation_pb2.GenerateRequest(
                    text=other, sampling=common_pb2.SamplingParams(max_tokens=4)), timeout=30)
                with pytest.raises(grpc.RpcError) as e:
                    list(call)
                assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
                assert 1 <= int(dict(e.value.trailing_metadata())["retry-after"]) <= 60
        body = _err(refused, 429)
        assert body["type"] == "rate_limit_error"
        assert 1 <= int(refused.headers["retry-after"]) <= 60     # the measured drain hint
        for w in sys_b.workers("prefill") + sys_b.workers("decode"):
            w.popen.kill()
            w.popen.wait(10)
        wait_until(lambda: ((r := c.get(base + "/health")).status_code == 503, r.status_code),
                   10.0, "/health 503 after the workers died")
        body = _err(c.post(base + "/v1/completions", json={"model": name, "prompt": "hi",
                                                             "max_tokens": 2}), 503)
        assert body["type"] == "service_unavailable"
