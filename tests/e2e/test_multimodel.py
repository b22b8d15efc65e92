"""Two models behind one gateway, started by `pdserve up --models-file` as real processes.

The two tiny models differ in vocabulary (512 and 1024 tokens, so their tokenizers differ),
weights and context length. Each request must be served by its own model's pools (worker
Stats count the transfers), greedily equal to that model's offline `engine.LLM`; `/v1/models`
lists both with the context length their workers serve; an unknown model is the openai SDK's
NotFoundError (gRPC NOT_FOUND). At the end every KV block is back and every process stops.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import grpc
import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from engine.sampling_params import SamplingParams
from protos.pdserve.v1 import (common_pb2, decode_pb2_grpc, generation_pb2, generation_pb2_grpc,
                               prefill_pb2_grpc)
from tests.helpers import up_metadata, up_token_file, wait_until

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

SHAPE = dict(hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4, num_kv_heads=2)
MODELS = {"alpha": dict(SHAPE, seed=1, vocab_size=512, max_position_embeddings=384),
          "beta": dict(SHAPE, seed=2, vocab_size=1024, max_position_embeddings=640)}
TEXTS = ["The river runs quietly through the valley, past old mills and a stone bridge.",
         "A server receives a request, reads the prompt, and returns tokens to the client.",
         "Every morning the baker opens her shop at six, and the street smells of bread.",
         "Scientists measure the temperature of the ocean to understand the climate."]
MESSAGES = [{"role": "user", "content": "Tell me about the weather in the mountains."}]
STUB = {"prefill": prefill_pb2_grpc.PrefillWorkerStub, "decode": decode_pb2_grpc.DecodeWorkerStub}


def _children(pid: int) -> list[int]:
    with open(f"/proc/{pid}/task/{pid}/children") as f:
        return [int(x) for x in f.read().split()]


@pytest.fixture(scope="module")
def system(tmp_path_factory):
    from engine.tiny_model import make_tiny_model
    from pdserve.launcher import free_port

    d = tmp_path_factory.mktemp("multimodel")
    dirs = {name: str(make_tiny_model(d / name, **kw)) for name, kw in MODELS.items()}
    models_file = d / "models.json"
    models_file.write_text(json.dumps([{"name": n, "model": p, "prefill": 1, "decode": 1}
                                       for n, p in dirs.items()]))
    port, http_port = free_port(), free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "pdserve.cli", "up", "--models-file", str(models_file),
         "--grpc-port", str(port), "--http-port", str(http_port),
         "--disaggregation", "always"],     # these tests count each model's KV transfers
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env=dict(os.environ, OMP_NUM_THREADS="1"))
    lines: list[str] = []
    threading.Thread(target=lambda: lines.extend(iter(proc.stdout.readline, "")),
                     daemon=True).start()
    try:
        deadline = time.monotonic() + 300      # five processes on a shared machine
        while not any(l.startswith("pdserve ready") for l in lines):
            assert proc.poll() is None, "pdserve up exited:\n" + "".join(lines[-50:])
            assert time.monotonic() < deadline, "no ready line:\n" + "".join(lines[-50:])
            time.sleep(0.1)
        pools = {}
        for l in lines:     # "pdserve model NAME: prefill=A,B decode=C model=DIR"
            if l.startswith("pdserve model "):
                name, rest = l[len("pdserve model "):].split(": ", 1)
                kv = dict(x.split("=", 1) for x in rest.split())
                pools[name] = {r: kv[r].split(",") for r in ("prefill", "decode")}
        assert sorted(pools) == sorted(MODELS), lines
        yield SimpleNamespace(proc=proc, lines=lines, dirs=dirs, pools=pools,
                              grpc=f"127.0.0.1:{port}", http=f"http://127.0.0.1:{http_port}")
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()         # its children get SIGTERM from the kernel (PDEATHSIG)
                proc.wait(10)


@pytest.fixture(scope="module")
def llms(system):
    from engine import LLM
    return {name: LLM(d) for name, d in system.dirs.items()}


@pytest.fixture(scope="module")
def client(system):
    with openai.OpenAI(base_url=system.http + "/v1", api_key="none", max_retries=0,
                       timeout=120) as c:
        yield c


def stats(system, model):
    """{(role, address): Stats} of one model's workers."""
    out, metadata = {}, up_metadata(system.proc.pid)
    for role, addrs in system.pools[model].items():
        for a in addrs:
            with grpc.insecure_channel(a) as ch:
                out[(role, a)] = STUB[role](ch).Stats(common_pb2.StatsRequest(), timeout=10,
                                                      metadata=metadata)
    return out


def transfers(system, model):
    return {k: s.transfers.transfers_done for k, s in stats(system, model).items()}


def generate(system, model, ids, max_tokens):
    req = generation_pb2.GenerateRequest(
        model=model, token_ids=common_pb2.TokenIds(ids=ids),
        sampling=common_pb2.SamplingParams(max_tokens=max_tokens, temperature=0.0,
                                           ignore_eos=True),
        stream_options=generation_pb2.StreamOptions(stream=True))
    with grpc.insecure_channel(system.grpc) as ch:
        stub = generation_pb2_grpc.GenerationStub(ch)
        return [t for msg in stub.Generate(req, timeout=120) for t in msg.token_ids]


def test_models_lists_both_with_the_context_length_their_workers_serve(system, client):
    listed = {m.id: m.model_extra["max_model_len"] for m in client.models.list().data}
    assert listed == {n: kw["max_position_embeddings"] for n, kw in MODELS.items()}
    for name in MODELS:
        assert {s.max_model_len for s in stats(system, name).values()} == {listed[name]}
        assert client.models.retrieve(name).id == name
    with grpc.insecure_channel(system.grpc) as ch:
        r = generation_pb2_grpc.GenerationStub(ch).ListModels(
            generation_pb2.ListModelsRequest(), timeout=10)
    assert {m.id: m.max_model_len for m in r.models} == listed


def test_each_model_is_served_by_its_own_pools_greedy_as_its_engine(system, llms):
    """Interleaved gRPC requests to both models: tokens equal each model's LLM; each
    model's workers moved exactly its own requests' KV."""
    work = []
    for name, llm in llms.items():
        for i, text in enumerate(TEXTS):
            work.append((name, llm.tokenizer.encode(text), 4 + 3 * i))
    want = {}
    for name, llm in llms.items():
        mine = [(ids, n) for m, ids, n in work if m == name]
        outs = llm.generate([ids for ids, _ in mine], [
            SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for _, n in mine])
        want.update({(name, i): o.token_ids for i, o in enumerate(outs)})
    before = {name: transfers(system, name) for name in MODELS}
    with ThreadPoolExecutor(len(work)) as pool:
        got = list(pool.map(lambda w: generate(system, *w), work))
    seen = {name: 0 for name in MODELS}
    for (name, ids, _), tokens in zip(work, got):
        assert tokens == want[(name, seen[name])], f"{name} request {seen[name]}"
        seen[name] += 1
    for name in MODELS:
        after = transfers(system, name)
        assert {k: after[k] - before[name][k] for k in after} == \
            {k: len(TEXTS) for k in after}, name
    assert llms["alpha"].tokenizer.encode(TEXTS[0]) != llms["beta"].tokenizer.encode(TEXTS[0])


def test_openai_sdk_chat_and_completions_per_model(system, llms, client):
    """Each model's chat template and tokenizer (transformers' own, as the reference), and
    its weights: the SDK's text equals the model's LLM on the same ids."""
    import transformers
    for name, llm in llms.items():
        tok = transformers.AutoTokenizer.from_pretrained(system.dirs[name])
        ids = tok.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=True)
        ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
        ref = llm.generate([ids], SamplingParams(temperature=0.0, max_tokens=10,
                                                 ignore_eos=True))[0]
        chat = client.chat.completions.create(model=name, messages=MESSAGES, max_tokens=10,
                                              temperature=0.0, extra_body={"ignore_eos": True})
        assert chat.model == name and chat.usage.prompt_tokens == len(ids)
        assert chat.choices[0].message.content == llm.tokenizer.decode(ref.token_ids)
        prompt = llm.tokenizer.encode(TEXTS[1])
        ref = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=6,
                                                    ignore_eos=True))[0]
        comp = client.completions.create(model=name, prompt=prompt, max_tokens=6,
                                         temperature=0.0, extra_body={"ignore_eos": True})
        assert comp.choices[0].text == llm.tokenizer.decode(ref.token_ids)


def test_each_model_checks_its_own_vocabulary(system, client):
    """Token 700 exists in beta (1024) but not in alpha (512)."""
    assert len(generate(system, "beta", [5, 700, 9], 3)) == 3
    with pytest.raises(grpc.RpcError) as e:
        generate(system, "alpha", [5, 700, 9], 3)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model="alpha", prompt=[5, 700, 9], max_tokens=3)


def test_unknown_model_is_not_found(system, client):
    for call in (lambda: client.chat.completions.create(model="gamma", messages=MESSAGES),
                 lambda: client.completions.create(model="gamma", prompt="hi"),
                 lambda: client.models.retrieve("gamma")):
        with pytest.raises(openai.NotFoundError) as e:
            call()
        assert e.value.code == "model_not_found" and "'alpha', 'beta'" in e.value.message
    for model, code in (("gamma", grpc.StatusCode.NOT_FOUND),
                        ("", grpc.StatusCode.INVALID_ARGUMENT)):     # two models: name one
        with pytest.raises(grpc.RpcError) as e:
            generate(system, model, [5, 6, 7], 2)
        assert e.value.code() == code
    with grpc.insecure_channel(system.grpc) as ch, pytest.raises(grpc.RpcError) as e:
        generation_pb2_grpc.GenerationStub(ch).Tokenize(
            generation_pb2.TokenizeRequest(model="gamma", text="hi"), timeout=10)
    assert e.value.code() == grpc.StatusCode.NOT_FOUND


def test_gateway_metrics_are_per_model(system):
    text = httpx.get(system.http + "/metrics", timeout=10).text
    ok = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name == "pdserve:request_success_total":
                ok[s.labels["model_name"]] = ok.get(s.labels["model_name"], 0) + s.value
    assert set(ok) == set(MODELS) and all(v >= len(TEXTS) for v in ok.values()), ok


def test_a_pool_listing_another_models_worker_never_routes_to_it(system, llms, caplog):
    """A gateway for beta whose pools also list alpha's workers: the workers' Stats name
    the model they serve (the KV compat key's), so alpha's stay out of routing, logged, in
    the gateway's metrics and in the error a pool of alpha's workers alone gives; beta's
    serve beta's requests greedily as its LLM, and alpha's workers move no KV."""
    import asyncio
    from prometheus_client import generate_latest
    from gateway.config import GatewayConfig
    from gateway.core import Gateway
    from gateway.request import GatewayError, GenerateInput

    def pools(*models):
        return {r: ",".join(a for m in models for a in system.pools[m][r])
                for r in ("prefill", "decode")}

    prompts = [llms["beta"].tokenizer.encode(t) for t in TEXTS]
    params = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
    want = [o.token_ids for o in llms["beta"].generate(prompts, params)]

    async def run(**pools):
        gw = Gateway(GatewayConfig(model=system.dirs["beta"], request_timeout_s=60,
                                   disaggregation="always",
                                   internal_token_file=up_token_file(system.proc.pid), **pools))
        await gw.start()
        try:
            states = {p.kind: p.states() for p in (gw.prefill, gw.decode)}
            scrape = {(s.labels["pool"], s.labels["state"]): s.value
                      for f in text_string_to_metric_families(
                          generate_latest(gw.metrics.registry).decode())
                      for s in f.samples if s.name == "pdserve:gateway_workers"}
            outs = []
            for i, ids in enumerate(prompts):
                try:
                    outs.append([t async for ev in gw.generate(
                        GenerateInput(f"wrong-model-{i}", ids, params)) for t in ev.token_ids])
                except GatewayError as e:
                    outs.append(e)
            return states, scrape, outs
        finally:
            await gw.stop()

    before = {m: transfers(system, m) for m in MODELS}
    with caplog.at_level("ERROR", logger="gateway.registry"):
        states, scrape, outs = asyncio.run(run(**pools("alpha", "beta")))
    assert states == {r: {"healthy": 1, "wrong_model": 1, "unhealthy": 0}
                      for r in ("prefill", "decode")}
    assert scrape[("prefill", "wrong_model")] == scrape[("decode", "wrong_model")] == 1
    assert outs == want
    assert transfers(system, "alpha") == before["alpha"]
    after = transfers(system, "beta")
    assert {k: after[k] - before["beta"][k] for k in after} == {k: len(TEXTS) for k in after}
    for r in ("prefill", "decode"):
        (a,) = system.pools["alpha"][r]
        assert any(a in m and "serves model 'alpha'" in m and "'beta'" in m
                   for m in caplog.messages), (r, caplog.messages)
    # alpha's workers alone: no request, and the error says why
    states, _, outs = asyncio.run(run(**pools("alpha")))
    assert states["decode"] == {"healthy": 0, "wrong_model": 1, "unhealthy": 0}
    assert all(isinstance(e, GatewayError) and e.code == grpc.StatusCode.UNAVAILABLE
               and "serves model 'alpha', not 'beta'" in e.message for e in outs), outs


def test_every_block_returns_and_every_process_stops(system):
    def idle():
        busy = {k: (s.free_kv_blocks, s.total_kv_blocks, s.num_running, s.num_waiting)
                for name in MODELS for k, s in stats(system, name).items()
                if s.free_kv_blocks != s.total_kv_blocks or s.num_running or s.num_waiting}
        return not busy, busy
    wait_until(idle, 30, "every worker's KV pool full and idle")
    children = _children(system.proc.pid)
    assert len(children) == 5, children          # 2 x (prefill + decode) + gateway
    system.proc.send_signal(signal.SIGTERM)
    assert system.proc.wait(60) == 0
    for pid in children:
        assert not os.path.exists(f"/proc/{pid}"), f"child {pid} still running"
