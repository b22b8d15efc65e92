"""The embedded tiny model: loads in transformers, is deterministic, has spread logits."""
from __future__ import annotations

import json
import os
import threading

import pytest
import torch
from safetensors.torch import load_file

from engine import tiny_model
from engine.tiny_model import make_tiny_model


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("tiny") / "m")


@pytest.fixture(scope="module")
def hf_model(model_dir):
    transformers = pytest.importorskip("transformers")
    assert os.environ.get("HF_HUB_OFFLINE") == "1"
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir).eval()
    return model, transformers.AutoTokenizer.from_pretrained(model_dir)


def test_files_and_names(model_dir):
    names = sorted(p.name for p in model_dir.iterdir())
    assert names == sorted([".pdserve-tiny.json", "chat_template.jinja", "config.json",
                            "generation_config.json", "model.safetensors", "tokenizer.json",
                            "tokenizer_config.json"])
    config = json.loads((model_dir / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and config["head_dim"] == 32
    weights = load_file(model_dir / "model.safetensors")
    expected = {"model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"}
    for i in range(config["num_hidden_layers"]):
        expected |= {f"model.layers.{i}.{n}.weight" for n in (
            "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
            "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj",
            "input_layernorm", "post_attention_layernorm")}
    assert set(weights) == expected
    assert all(w.dtype == torch.float32 for w in weights.values())
    assert weights["model.layers.0.self_attn.k_proj.weight"].shape == (64, 128)
    assert weights["lm_head.weight"].shape == (config["vocab_size"], 128)
    tok_config = json.loads((model_dir / "tokenizer_config.json").read_text())
    assert tok_config["chat_template"] == (model_dir / "chat_template.jinja").read_text()


def test_loads_and_generates_in_transformers(hf_model):
    model, tok = hf_model
    assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == (1, 2, 0)
    inputs = tok("The quick brown fox", return_tensors="pt")
    assert inputs["input_ids"][0, 0].item() == 1
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=8, do_sample=False, min_new_tokens=8)
    assert out.shape[1] == inputs["input_ids"].shape[1] + 8
    assert isinstance(tok.decode(out[0]), str)


def test_logits_are_spread(hf_model):
    model, tok = hf_model
    ids = tok("Every morning the baker opens her shop", return_tensors="pt")["input_ids"]
    with torch.no_grad():
        logits = model(ids).logits[0]
    std = logits.std(dim=-1)
    assert (std > 1).all(), std
    # The next-token choice is not a coin flip: the top token is clearly ahead on average.
    top2 = logits.topk(2, dim=-1).values
    assert (top2[:, 0] - top2[:, 1]).mean() > 0.5


def test_deterministic_bytes(tmp_path, model_dir):
    other = make_tiny_model(tmp_path / "again")
    for name in ("model.safetensors", "tokenizer.json", "config.json", "tokenizer_config.json"):
        assert (other / name).read_bytes() == (model_dir / name).read_bytes(), name
    seed1 = make_tiny_model(tmp_path / "seed1", seed=1)
    assert (seed1 / "model.safetensors").read_bytes() != (model_dir / "model.safetensors").read_bytes()


def test_idempotent_and_rebuilds_on_new_args(tmp_path):
    small = dict(hidden_size=32, intermediate_size=64, num_layers=1, num_heads=2, num_kv_heads=1,
                 vocab_size=300)
    d = make_tiny_model(tmp_path / "m", **small)
    mtime = (d / "model.safetensors").stat().st_mtime_ns
    assert make_tiny_model(d, **small) == d
    assert (d / "model.safetensors").stat().st_mtime_ns == mtime  # untouched
    make_tiny_model(d, **{**small, "num_layers": 2})
    assert json.loads((d / "config.json").read_text())["num_hidden_layers"] == 2
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temp leftovers


def test_concurrent_callers(tmp_path):
    small = dict(hidden_size=32, intermediate_size=64, num_layers=1, num_heads=2, num_kv_heads=1,
                 vocab_size=300)
    errors = []

    def build():
        try:
            make_tiny_model(tmp_path / "m", **small)
        except Exception as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=build) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert load_file(tmp_path / "m" / "model.safetensors")


def test_default_model_dir(monkeypatch, tmp_path):
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    assert tiny_model.default_model_dir() == tmp_path / ".cache" / "pdserve" / "tiny-llama"
    monkeypatch.setattr(tiny_model, "make_tiny_model", lambda d: d)
    assert tiny_model.ensure_default_model() == tiny_model.default_model_dir()


def test_refuses_to_replace_foreign_directory(tmp_path):
    (tmp_path / "precious.txt").write_text("keep me")
    with pytest.raises(ValueError, match="not a tiny model"):
        make_tiny_model(tmp_path)
    assert (tmp_path / "precious.txt").read_text() == "keep me"


def test_rejects_bad_shapes(tmp_path):
    with pytest.raises(ValueError):
        make_tiny_model(tmp_path / "bad", hidden_size=30, num_heads=4)
