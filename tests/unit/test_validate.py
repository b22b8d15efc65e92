"""Every bad public input gets a clear 400 (REST, OpenAI's error shape) and INVALID_ARGUMENT
(gRPC) from gateway/validate.py's one check, before any worker is asked: a gateway whose
workers never answer serves these tests (a request that passed validation gets 503). Also: the
keep-alive connection still works after a 400, a 10 MB prompt is refused without holding the
loop, a body over the limit is 413."""
from __future__ import annotations

import asyncio
import json
import threading
import time

import grpc
import httpx
import pytest

from gateway.config import GatewayConfig
from gateway.core import Gateway
from gateway.grpc_server import _grpc_server
from gateway.models import Models
from gateway.openai import start_http
from gateway.validate import MAX_BODY_BYTES
from protos.pdserve.v1 import common_pb2, generation_pb2, generation_pb2_grpc


class Front:
    """A gateway whose workers never answer, its REST and gRPC fronts on a loop of their own."""

    def __init__(self, model_dir):
        self.loop = asyncio.new_event_loop()
        threading.Thread(target=self.loop.run_forever, daemon=True).start()
        self.run(self._start(model_dir))

    def run(self, coro, timeout=30):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    async def _start(self, model_dir):
        self.gw = Gateway(GatewayConfig(model=model_dir, grpc_port=0, prefill="127.0.0.1:9",
                                        decode="127.0.0.1:9"))   # nothing listens there
        await self.gw.start()
        self.http = await start_http(Models([self.gw]), "127.0.0.1", 0)
        self.server, _ = _grpc_server(Models([self.gw]))
        self.grpc_port = self.server.add_insecure_port("127.0.0.1:0")
        await self.server.start()

    async def _stop(self):
        await self.server.stop(0)
        await self.http.stop()
        await self.gw.stop()

    def close(self):
        self.run(self._stop())
        self.loop.call_soon_threadsafe(self.loop.stop)


@pytest.fixture(scope="module")
def front():
    from engine.tiny_model import ensure_default_model
    f = Front(str(ensure_default_model()))
    f.base = f"http://127.0.0.1:{f.http.port}"
    f.model = f.gw.model_name
    f.vocab = f.gw.vocab_size
    yield f
    f.close()


def post(front, path, body, client=None, raw: bytes | None = None):
    c = client or httpx
    kw = {"content": raw, "headers": {"content-type": "application/json"}} if raw is not None else {"json": body}
    return c.post(front.base + path, timeout=60, **kw)


def completion(front, **kw):
    return {"model": front.model, "prompt": "Hello", "max_tokens": 4, **kw}


def chat(front, **kw):
    return {"model": front.model, "messages": [{"role": "user", "content": "Hi"}], **kw}


CASES = [  # (name, endpoint, body changes, param, words in the message)
    ("n too large", "/v1/completions", {"n": 129}, "n", "less than or equal to 128"),
    ("n x prompts", "/v1/completions", {"n": 100, "prompt": ["a", "b", "c"]}, "n", "n x prompts"),
    ("17 stop strings", "/v1/completions", {"stop": [f"s{i}" for i in range(17)]}, "stop", "at most 16"),
    ("stop over 1 kB", "/v1/completions", {"stop": ["x" * 1025]}, "stop", "at most 1024 bytes"),
    ("top_k over int32", "/v1/completions", {"top_k": 2**31}, "top_k", "top_k must be in"),
    ("seed 2^63", "/v1/completions", {"seed": 2**63}, "seed", "seed must be in"),
    ("seed 2^70", "/v1/chat/completions", {"seed": 2**70}, "seed", "seed must be in"),
    ("seed + n overflows", "/v1/completions", {"seed": 2**63 - 1, "n": 2}, "seed", "seed must be in"),
    ("logit_bias key outside vocab", "/v1/completions", {"logit_bias": {"99999999": 1}},
     "logit_bias", "outside the vocabulary"),
    ("logit_bias key 2^63", "/v1/chat/completions", {"logit_bias": {str(2**63): 1}},
     "logit_bias", "outside the vocabulary"),
    ("stop_token_ids 2^40", "/v1/completions", {"stop_token_ids": [2**40]}, "stop_token_ids",
     "outside the vocabulary"),
    ("prompt ids 2^40", "/v1/completions", {"prompt": [1, 2, 2**40]}, "prompt", "outside the vocabulary"),
    ("max_tokens 2^63", "/v1/completions", {"max_tokens": 2**63}, "max_tokens", "maximum context length"),
    ("min_tokens over the context", "/v1/chat/completions", {"min_tokens": 10**6}, "min_tokens",
     "does not fit"),
]


@pytest.mark.parametrize("name,path,change,param,words", CASES, ids=[c[0] for c in CASES])
def test_rest_400(front, name, path, change, param, words):
    body = (completion if path == "/v1/completions" else chat)(front, **change)
    r = post(front, path, body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["param"] == param, err
    assert words in err["message"], err


@pytest.mark.parametrize("value", ["NaN", "Infinity", "-Infinity"])
def test_rest_non_finite_numbers(front, value):
    for field in ("temperature", "top_p", "presence_penalty", "repetition_penalty"):
        raw = json.dumps(completion(front))[:-1] + f', "{field}": {value}}}'
        r = post(front, "/v1/completions", None, raw=raw.encode())
        assert r.status_code == 400, (field, r.text)
        assert r.json()["error"]["param"] == field
    raw = json.dumps(completion(front))[:-1] + f', "logit_bias": {{"5": {value}}}}}'
    assert post(front, "/v1/completions", None, raw=raw.encode()).status_code == 400


def test_rest_lone_surrogate(front):
    for path, body in (("/v1/completions", completion(front, prompt="ab\ud800cd")),
                       ("/v1/chat/completions", chat(front, messages=[{"role": "user", "content": "\ud800"}])),
                       ("/v1/completions", completion(front, stop=["\ud800"]))):
        raw = json.dumps(body).encode()            # ensure_ascii: the escape "\ud800" as sent
        assert b"\\ud800" in raw
        r = post(front, path, None, raw=raw)
        assert r.status_code == 400, r.text
        assert "lone surrogate" in r.json()["error"]["message"]


def test_keep_alive_connection_survives_a_400(front):
    with httpx.Client(http1=True) as c:
        for _ in range(5):
            assert post(front, "/v1/completions", completion(front, seed=2**70), c).status_code == 400
            r = c.get(front.base + "/v1/models", timeout=10)
            assert r.status_code == 200 and r.json()["data"][0]["id"] == front.model
        # a valid request reaches routing: no worker -> 503, and the connection still works
        assert post(front, "/v1/completions", completion(front), c).status_code == 503
        assert c.get(front.base + "/v1/models", timeout=10).status_code == 200


def test_body_limit(front):
    big = b'{"model": "m", "prompt": "' + b"a" * (MAX_BODY_BYTES + 1) + b'"}'
    r = post(front, "/v1/completions", None, raw=big)
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"


def test_ten_mb_prompt_is_refused_quickly_and_others_are_served(front):
    result = {}

    def big():
        t = time.monotonic()
        result["r"] = post(front, "/v1/completions", completion(front, prompt="hello world " * 900_000))
        result["s"] = time.monotonic() - t
    th = threading.Thread(target=big)
    th.start()
    lat = []
    while th.is_alive():
        t = time.monotonic()
        assert httpx.get(front.base + "/v1/models", timeout=30).status_code == 200
        lat.append(time.monotonic() - t)
    th.join()
    r = result["r"]
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded", r.text
    assert max(lat, default=0) < 5.0, lat


# -- gRPC -------------------------------------------------------------------------------------

def _grpc_case(sampling=None, ids=(1, 2, 3), text=None):
    s = common_pb2.SamplingParams(max_tokens=4, **(sampling or {}))
    if text is not None:
        return generation_pb2.GenerateRequest(text=text, sampling=s)
    return generation_pb2.GenerateRequest(token_ids=common_pb2.TokenIds(ids=list(ids)), sampling=s)


GRPC_CASES = [
    ("NaN temperature", {"temperature": float("nan")}, "temperature"),
    ("Inf repetition_penalty", {"repetition_penalty": float("inf")}, "repetition_penalty"),
    ("n 2000", {"n": 2000}, "n must be in"),
    ("17 stops", {"stop": [f"s{i}" for i in range(17)]}, "at most 16"),
    ("seed + n overflows", {"seed": 2**63 - 1, "n": 2}, "seed must be in"),
    ("negative top_k", {"top_k": -5}, "top_k"),
    ("logit_bias outside vocab", {"logit_bias": {2**31 - 1: 1.0}}, "outside the vocabulary"),
    ("logit_bias NaN", {"logit_bias": {5: float("nan")}}, "logit_bias"),
    ("stop_token_ids negative", {"stop_token_ids": [-1]}, "outside the vocabulary"),
    ("min_tokens over the context", {"min_tokens": 2**31 - 1, "max_tokens_unlimited": True},
     "does not fit"),
]


@pytest.mark.parametrize("name,sampling,words", GRPC_CASES, ids=[c[0] for c in GRPC_CASES])
def test_grpc_invalid_argument(front, name, sampling, words):
    with grpc.insecure_channel(f"127.0.0.1:{front.grpc_port}") as ch:
        stub = generation_pb2_grpc.GenerationStub(ch)
        req = _grpc_case(sampling)
        if "max_tokens_unlimited" in sampling:
            req.sampling.ClearField("max_tokens")
        with pytest.raises(grpc.RpcError) as e:
            list(stub.Generate(req, timeout=30))
    assert e.value.code() is grpc.StatusCode.INVALID_ARGUMENT, e.value
    assert words in e.value.details()


def test_grpc_prompt_ids(front):
    with grpc.insecure_channel(f"127.0.0.1:{front.grpc_port}") as ch:
        stub = generation_pb2_grpc.GenerationStub(ch)
        for ids in ([1, 2, 2**31 - 1], [1, -3]):
            with pytest.raises(grpc.RpcError) as e:
                list(stub.Generate(_grpc_case(ids=ids), timeout=30))
            assert e.value.code() is grpc.StatusCode.INVALID_ARGUMENT


# -- the same input on both fronts ----------------------------------------------------------

def _grpc_chat(role="user", **sampling):
    chat = generation_pb2.ChatMessages(
        messages=[generation_pb2.ChatMessage(role=role, content="Hi")], add_generation_prompt=True)
    return generation_pb2.GenerateRequest(chat=chat, sampling=common_pb2.SamplingParams(
        **{"max_tokens": 4, **sampling}))


def _structured(**kind):
    return {"structured": common_pb2.StructuredOutput(**kind)}


BOTH_FRONTS = [  # (name, REST chat body changes, gRPC request, words in both messages)
    ("temperature 2.5", {"temperature": 2.5}, _grpc_chat(temperature=2.5), "2"),
    ("bogus role", {"messages": [{"role": "wizard", "content": "Hi"}]}, _grpc_chat("wizard"),
     "assistant"),
    ("max_tokens past the context", {"max_tokens": 10**6}, _grpc_chat(max_tokens=10**6),
     "context length"),
    ("invalid JSON schema", {"response_format": {"type": "json_schema", "json_schema": {
        "name": "s", "schema": {"type": "strin"}}}},
     _grpc_chat(**_structured(json_schema='{"type": "strin"}')), "strin"),
]


@pytest.mark.parametrize("name,rest,req,words", BOTH_FRONTS, ids=[c[0] for c in BOTH_FRONTS])
def test_both_fronts_refuse_alike(front, name, rest, req, words):
    """What REST refuses with a 400, gRPC refuses with INVALID_ARGUMENT (not UNKNOWN, and not
    accepted): before any worker is asked (these workers never answer: a request that got
    through would be 503 / UNAVAILABLE)."""
    r = post(front, "/v1/chat/completions", chat(front, **rest))
    assert r.status_code == 400, r.text
    assert words in r.json()["error"]["message"], r.text
    with grpc.insecure_channel(f"127.0.0.1:{front.grpc_port}") as ch:
        with pytest.raises(grpc.RpcError) as e:
            list(generation_pb2_grpc.GenerationStub(ch).Generate(req, timeout=30))
    assert e.value.code() is grpc.StatusCode.INVALID_ARGUMENT, e.value
    assert words in e.value.details()


@pytest.mark.parametrize("kind,words", [
    ({"json_schema": '{"type": '}, "not valid JSON"),                 # was UNKNOWN
    ({"grammar": "start: <|nosuchtoken|>"}, "unknown special token"),  # was a worker's error
])
def test_grpc_structured_output_checked_against_the_tokenizer(front, kind, words):
    """A spec only the model's tokenizer can reject (a special token it lacks) is refused by
    the gateway, which compiles it as a worker would."""
    with grpc.insecure_channel(f"127.0.0.1:{front.grpc_port}") as ch:
        with pytest.raises(grpc.RpcError) as e:
            list(generation_pb2_grpc.GenerationStub(ch).Generate(
                _grpc_chat(**_structured(**kind)), timeout=60))
    assert e.value.code() is grpc.StatusCode.INVALID_ARGUMENT, e.value
    assert words in e.value.details()


def test_chat_template_kwargs(front):
    """chat_template_kwargs may set add_generation_prompt (it wins, as in vLLM; was a 500) but
    not the request's own fields; the keep-alive connection serves on either way."""
    from gateway.prompt import chat_prompt_ids
    msgs = [{"role": "user", "content": "Hi"}]
    tok = front.gw.tokenizer
    with_prompt = front.run(chat_prompt_ids(tok, msgs, True))
    without = front.run(chat_prompt_ids(tok, msgs, True, template_kwargs={"add_generation_prompt": False}))
    assert with_prompt != without and with_prompt[:len(without)] == without
    with httpx.Client(http1=True) as c:
        r = post(front, "/v1/chat/completions",
                 chat(front, chat_template_kwargs={"add_generation_prompt": False}), c)
        assert r.status_code == 503, r.text          # valid: it reached routing
        for bad in ({"messages": []}, {"tools": []}, {"chat_template": "{{ 1 }}"}):
            r = post(front, "/v1/chat/completions", chat(front, chat_template_kwargs=bad), c)
            assert r.status_code == 400 and "chat_template_kwargs" in r.json()["error"]["message"], r.text
        assert c.get(front.base + "/v1/models", timeout=10).status_code == 200
