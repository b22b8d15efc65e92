"""Several models behind one gateway (gateway/models.py), without workers: the models file,
lookup by the request's model, and one metrics exposition telling the models apart
(parsed by prometheus_client's own parser)."""
from __future__ import annotations

import json
from pathlib import Path

import grpc
import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from gateway.config import GatewayConfig
from gateway.models import Models, model_configs
from gateway.request import GatewayError
from pdserve.launcher import ModelPools
from pdserve.up import UpConfig


@pytest.fixture(scope="module")
def tiny():
    from engine.tiny_model import ensure_default_model
    return str(ensure_default_model())


def write(tmp_path, entries) -> str:
    p = tmp_path / "models.json"
    p.write_text(json.dumps(entries))
    return str(p)


def test_models_file_gives_each_model_its_pools_and_shares_the_rest(tmp_path, tiny):
    path = write(tmp_path, [
        {"name": "a", "model": tiny, "prefill": "127.0.0.1:1", "decode": "127.0.0.1:2"},
        {"name": "b", "model": tiny, "prefill_dns": "b-prefill:50061",
         "decode_dns": "b-decode:50071", "max_model_len": 64}])
    a, b = model_configs(GatewayConfig(models_file=path, request_timeout_s=7, api_key="k"))
    assert (a.served_model_name, a.model, a.prefill, a.decode, a.prefill_dns) == \
        ("a", tiny, "127.0.0.1:1", "127.0.0.1:2", "")
    assert (b.served_model_name, b.prefill_dns, b.decode_dns, b.prefill, b.max_model_len) == \
        ("b", "b-prefill:50061", "b-decode:50071", "", 64)
    assert a.request_timeout_s == b.request_timeout_s == 7 and a.api_key == b.api_key == "k"
    assert not a.models_file and not b.models_file


@pytest.mark.parametrize("entries, words", [
    ([], "non-empty JSON list"),
    ({"name": "a"}, "non-empty JSON list"),
    ([{"model": "m"}], "'name' and 'model'"),
    ([{"name": "a", "model": "m", "port": 1}], "only the keys"),
    ([{"name": "a", "model": "m", "prefill": "x:1", "prefill_dns": "y:1"}], "not both"),
])
def test_bad_models_file_is_a_clear_error(tmp_path, entries, words):
    with pytest.raises(ValueError, match=words):
        model_configs(GatewayConfig(models_file=write(tmp_path, entries)))


def test_models_file_excludes_the_single_model_options(tmp_path):
    with pytest.raises(ValueError, match="--models-file"):
        GatewayConfig(models_file=write(tmp_path, []), prefill="127.0.0.1:1")
    for single in ({"model": "m"}, {"served_model_name": "x"}):
        with pytest.raises(ValueError, match="--models-file names each model"):
            UpConfig(models_file="f", **single)


def test_up_models_file(tmp_path):
    assert ModelPools.read(write(tmp_path, [{"name": "a", "model": "/m/a", "decode": 2},
                                            {"name": "b", "model": "/m/b"}])) == [
        ModelPools("a", "/m/a", 1, 2), ModelPools("b", "/m/b", 1, 1)]
    for bad in ([{"name": "a", "model": "x"}, {"name": "a", "model": "y"}],
                [{"name": "a", "model": "x", "decode": 0}], [{"model": "x"}], "x"):
        with pytest.raises(ValueError, match="models file"):
            ModelPools.read(write(tmp_path, bad))
    # prefill 0: that model's decode workers compute its prompts (--disaggregation never|auto)
    assert ModelPools.read(write(tmp_path, [{"name": "a", "model": "x", "prefill": 0}])) == [
        ModelPools("a", "x", 0, 1)]


def gateways(tmp_path, tiny, *names):
    return Models.from_config(GatewayConfig(models_file=write(tmp_path, [
        {"name": n, "model": tiny, "prefill": "127.0.0.1:9", "decode": "127.0.0.1:9"}
        for n in names])))


def test_lookup_by_model(tmp_path, tiny):
    models = gateways(tmp_path, tiny, "a", "b")
    assert [g.model_name for g in models] == models.names == ["a", "b"]
    assert models.get("b") is models.by_name["b"] is not models.get("a")
    with pytest.raises(GatewayError) as e:
        models.get("c")
    assert e.value.code == grpc.StatusCode.NOT_FOUND and "'a', 'b'" in e.value.message
    with pytest.raises(GatewayError) as e:
        models.get("")
    assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT
    one = gateways(tmp_path, tiny, "a")
    assert one.get("") is one.get("a")          # one model: the model may be left out
    with pytest.raises(ValueError, match="twice"):
        gateways(tmp_path, tiny, "a", "a")


def test_one_exposition_labels_every_series_with_its_model(tmp_path, tiny):
    models = gateways(tmp_path, tiny, "a", "b")
    models.get("a").metrics.observe_finished(0.1, prompt_tokens=5, gen_tokens=3,
                                            finish_reason="stop", ttft_s=0.01)
    models.get("b").metrics.observe_finished(0.1, prompt_tokens=7, gen_tokens=2,
                                            finish_reason="stop", ttft_s=0.01)
    models.get("b").metrics.observe_error("NOT_FOUND")
    samples = {}
    for fam in text_string_to_metric_families(generate_latest(models.registry).decode()):
        for s in fam.samples:
            samples[(s.name, frozenset(s.labels.items()))] = s.value

    def value(name, **labels):
        return samples[(name, frozenset({"role": "gateway", **labels}.items()))]
    assert value("pdserve:prompt_tokens_total", model_name="a") == 5
    assert value("pdserve:prompt_tokens_total", model_name="b") == 7
    assert value("pdserve:request_errors_total", model_name="b", code="NOT_FOUND") == 1
    assert value("pdserve:time_to_first_token_seconds_count", model_name="a") == 1
    assert all(dict(k[1]).get("model_name") in ("a", "b") for k in samples)


@pytest.mark.parametrize("path, want", [
    ("/c/smollm2-135m-instruct/SmolLM2-135M-Instruct.Q4_1.gguf", "SmolLM2-135M-Instruct"),
    ("Meta-Llama-3-8B-Instruct.Q4_K_M.gguf", "Meta-Llama-3-8B-Instruct"),   # hub file names
    ("qwen2.5-0.5b-instruct-q8_0.gguf", "qwen2.5-0.5b-instruct"),
    ("gemma-2-2b-it-IQ4_XS.gguf", "gemma-2-2b-it"),
    ("Phi-3-mini-4k-instruct-fp16.gguf", "Phi-3-mini-4k-instruct"),
    ("model.gguf", "model"),
    ("/models/Qwen2.5-0.5B-Instruct", "Qwen2.5-0.5B-Instruct"),   # a directory: its name
])
def test_the_default_model_id_drops_gguf_and_the_weight_type(path, want):
    from gateway.config import default_model_id
    assert default_model_id(path) == want
    assert GatewayConfig(served_model_name="mine").model_name(Path(path)) == "mine"
