"""GGUF files of the MoE and MLA architectures (engine/gguf_arch.py, engine/gguf_moe.py):
DeepSeek-V3 (`deepseek2`), Qwen2-MoE / Qwen3-MoE, Mixtral (`llama` with experts). The files
are written by tests/gguf_moe_files.py the way llama.cpp's converter writes them (stacked
experts, DeepSeek's kv_b_proj split into attn_k_b / attn_v_b, MLA read as MQA in the
metadata), from random transformers models. transformers 5.24 cannot read these GGUF
architectures itself, so the reference is transformers on the Hugging Face directory, with
the weights the file holds (dequantized) where the file is quantized: greedy tokens identical
for 16 tokens, logprobs within 1e-3."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from torch import nn

from engine import LLM, SamplingParams
from engine.config import ModelConfig
from engine.gguf import open_gguf
from engine.quant.linear import QuantEmbedding, QuantLinear
from tests.gguf_files import tiny_hf_dir
from tests.gguf_moe_files import reference_dir, write_moe_gguf
from tests.hf_models import hf_greedy
from tests.hf_models_mla import YARN

PROMPTS = ["The quick brown fox", "Prefill computes the prompt; decode", "a b c d e f g"]
NEW = 16
# llama.cpp's qwen2moe has no dense FFN tensors: every layer routed
MODELS = {"deepseek_v3": {}, "deepseek-yarn": dict(rope_parameters=YARN),
          "qwen2_moe": dict(mlp_only_layers=[]), "qwen3_moe": {}, "mixtral": {},
          # what a Gemma 3 file can say: llama.cpp's layer pattern (every 6th global) and
          # query scale (head_dim)
          "gemma3_text": dict(num_hidden_layers=6, layer_types=None, query_pre_attn_scalar=16)}


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """(model, qtype, writer options) -> (GGUF file, HF directory of what it holds)."""
    cache, hf = {}, {}

    def get(model, qtype="F32", **kw):
        key = (model, qtype, tuple(sorted(kw.items())))
        if key not in cache:
            if model not in hf:
                kind = "deepseek_v3" if model.startswith("deepseek") else model
                hf[model] = tiny_hf_dir(kind, tmp_path_factory.mktemp(model), **MODELS[model])
            d = tmp_path_factory.mktemp(f"{model}-{qtype}")
            stored = write_moe_gguf(hf[model], d / "m.gguf", qtype, **kw)
            ref = hf[model] if qtype == "F32" else reference_dir(hf[model], stored, d / "ref")
            cache[key] = (d / "m.gguf", ref)
        return cache[key]
    get.hf = hf
    return get


def _greedy_matches(path, ref_dir, **llm):
    engine = LLM(path, num_blocks=64, block_size=8, **llm)
    prompts = [engine.tokenizer.encode(p) for p in PROMPTS]
    outs = engine.generate(prompts, SamplingParams(temperature=0.0, max_tokens=NEW,
                                                   ignore_eos=True, logprobs=0))
    for i, (o, (toks, lps)) in enumerate(zip(outs, hf_greedy(ref_dir, prompts, NEW))):
        assert o.token_ids == toks, f"prompt {i}: tokens differ"
        assert max(abs(a - b) for a, b in zip(o.logprobs, lps)) < 1e-3, f"prompt {i}: logprobs"
    return engine.engine.model


@pytest.mark.parametrize("model,qtype", [
    ("deepseek_v3", "F32"), ("deepseek_v3", "F16"), ("deepseek_v3", "Q8_0"),
    ("deepseek-yarn", "F32"), ("qwen2_moe", "F32"), ("qwen3_moe", "Q8_0"), ("mixtral", "Q8_0"),
    ("gemma3_text", "F32"), ("gemma3_text", "Q8_0")])
def test_greedy_from_gguf_equals_transformers(files, model, qtype):
    path, ref = files(model, qtype)
    m = _greedy_matches(path, ref)
    if qtype == "Q8_0":        # the file's Q8_0 linears stay quantized (experts: float)
        held = [p for p, *_ in m.quantizable_linears() if isinstance(m.get_submodule(p), QuantLinear)]
        assert "layers.1.self_attn.o_proj" in held and "lm_head" not in held
        if m.config.tie_word_embeddings:   # Gemma: the Q8_0 table, the head reading its codes
            assert isinstance(m.embed_tokens, QuantEmbedding)
        else:
            assert isinstance(m.lm_head, QuantLinear)
        if model == "deepseek_v3":
            assert {"layers.0.mlp.gate_up_proj", "layers.1.self_attn.q_a_proj",
                    "layers.1.mlp.shared_expert.down_proj"} <= set(held)
            assert type(m.layers[1].self_attn.kv_b_proj) is nn.Linear   # absorbed at decode


def test_deepseek_config_from_metadata_equals_config_json(files):
    """Every ModelConfig field read off the GGUF metadata equals the one read off
    config.json: MLA ranks, the MoE routing (groups, scaling, the correction bias, the dense
    first layer), YaRN with mscale; only where it lives and its name differ."""
    for model in ("deepseek_v3", "deepseek-yarn"):
        path, _ = files(model)
        a, b = ModelConfig.from_dir(path), ModelConfig.from_dir(files.hf[model])
        skip = {"model_dir", "name", "rms_norm_eps", "rope_scaling", "eos_token_ids"}
        for f in dataclasses.fields(ModelConfig):
            if f.name not in skip:
                assert getattr(a, f.name) == getattr(b, f.name), f.name
        assert a.rms_norm_eps == pytest.approx(b.rms_norm_eps)     # stored as float32
        if model == "deepseek-yarn":
            for k in ("factor", "original_max_position_embeddings", "beta_fast", "beta_slow",
                      "mscale", "mscale_all_dim"):
                assert a.rope_scaling[k] == pytest.approx(b.rope_scaling[k]), k


def test_tensors_read_back_as_the_checkpoint(files):
    """Every Hugging Face tensor comes back under its name and shape: stacked experts as
    per-expert views whose Q8_0 blocks are byte for byte the quantization of that expert's
    weight, kv_b_proj rebuilt from attn_k_b (F16: its rows do not split into 32-blocks) and
    attn_v_b, and a file with the older single attn_kv_b reads the same."""
    import gguf
    from safetensors.numpy import load_file
    path, _ = files("deepseek_v3", "Q8_0")
    ref = load_file(str(files.hf["deepseek_v3"] / "model.safetensors"))
    raw = {t.name: t for t in open_gguf(path).raw_tensors()}
    assert set(raw) == set(ref)
    for name, t in raw.items():
        assert t.shape == ref[name].shape, name
    e = raw["model.layers.2.mlp.experts.5.down_proj.weight"]
    assert e.type_name == "Q8_0"
    assert np.array_equal(e.data, gguf.quants.quantize(ref[e.name], gguf.GGMLQuantizationType.Q8_0))
    names = {t.name for t in open_gguf(path).tensor_table}
    assert "blk.1.attn_k_b.weight" in names and "blk.1.ffn_gate_exps.weight" in names
    kv = "model.layers.1.self_attn.kv_b_proj.weight"
    assert np.abs(raw[kv].dequantize() - ref[kv]).max() < 1e-2
    old, _ = files("deepseek_v3", "F32", split_kv_b=False)
    assert "blk.1.attn_kv_b.weight" in {t.name for t in open_gguf(old).tensor_table}
    for name, got in open_gguf(old).tensors():
        assert np.array_equal(got, ref[name]), name


def test_deepseek_v2_routing_is_refused_naming_it(files):
    """A deepseek2 file without expert_gating_func is softmax-routed (DeepSeek-V2, as
    llama.cpp reads it): refused, naming the file and the routing."""
    path, _ = files("deepseek_v3", "F32", gating=None)
    assert open_gguf(path).hf_config()["scoring_func"] == "softmax"
    with pytest.raises(ValueError, match=r"m\.gguf.*scoring_func sigmoid"):
        LLM(path, num_blocks=8)


def test_quantized_file_dequantized_on_request(files):
    """quantization 'none': the Q8_0 file computes exactly what transformers computes with
    the dequantized weights, with no quantized layer."""
    path, ref = files("qwen3_moe", "Q8_0")
    m = _greedy_matches(path, ref, quantization="none")
    assert not any(isinstance(x, QuantLinear) for x in m.modules())
    assert isinstance(m.layers[0].self_attn.qkv_proj.weight, torch.Tensor)


def test_gemma3_file_reads_as_transformers_reads_it(files):
    """transformers' own GGUF reader (which knows gemma3) takes the test's file to the
    original weights too (norms stored + 1), as the engine's reader does: the converter's
    conventions are llama.cpp's, not only this reader's."""
    import transformers as T
    path, _ = files("gemma3_text")
    theirs = T.AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name,
                                                    dtype=torch.float32).state_dict()
    ours = dict(open_gguf(path).tensors())
    assert set(ours) == set(theirs) - {"lm_head.weight"}          # tied
    for name, w in ours.items():
        torch.testing.assert_close(torch.from_numpy(w), theirs[name], atol=1e-6, rtol=0)
