"""YaRN rope scaling (engine/kernels/rope.py, engine/config.py's _rope) against transformers:
the frequencies and attention factor of `ROPE_INIT_FUNCTIONS["yarn"]` and the cos/sin each
model's own rotary module computes, for GPT-OSS's, DeepSeek-V3's and Qwen3's settings."""
import json

import pytest
import torch

from engine.config import ModelConfig
from engine.rope_config import rope as _rope
from engine.kernels.rope import build_cos_sin_cache, yarn_parameters

# (transformers config class, its rotary module, config.json fields, rotary dim)
CASES = {
    "gpt_oss": ("GptOssConfig", "gpt_oss.modeling_gpt_oss.GptOssRotaryEmbedding", dict(
        head_dim=64, rope_parameters=dict(rope_type="yarn", rope_theta=150000.0, factor=32.0,
                                          beta_fast=32.0, beta_slow=1.0, truncate=False,
                                          original_max_position_embeddings=4096)), 64),
    "deepseek_v3": ("DeepseekV3Config", "deepseek_v3.modeling_deepseek_v3.DeepseekV3RotaryEmbedding", dict(
        qk_rope_head_dim=64, max_position_embeddings=163840,
        rope_parameters=dict(rope_type="yarn", rope_theta=10000.0, factor=40.0, mscale=1.0,
                             mscale_all_dim=1.0, beta_fast=32, beta_slow=1,
                             original_max_position_embeddings=4096)), 64),
    # mscale != mscale_all_dim: an attention factor below 1 (DeepSeek-V2-Lite's kind)
    "deepseek_mscale": ("DeepseekV3Config", "deepseek_v3.modeling_deepseek_v3.DeepseekV3RotaryEmbedding", dict(
        qk_rope_head_dim=32, max_position_embeddings=163840,
        rope_parameters=dict(rope_type="yarn", rope_theta=10000.0, factor=40.0, mscale=0.707,
                             mscale_all_dim=1.0, original_max_position_embeddings=4096)), 32),
    # truncate left at its default (True), the betas at theirs
    "qwen3": ("Qwen3Config", "qwen3.modeling_qwen3.Qwen3RotaryEmbedding", dict(
        head_dim=128, max_position_embeddings=131072,
        rope_parameters=dict(rope_type="yarn", rope_theta=1e6, factor=4.0,
                             original_max_position_embeddings=32768)), 128),
    # an explicit attention factor; the pre-yarn length outside rope_parameters wins
    "explicit": ("Qwen3Config", "qwen3.modeling_qwen3.Qwen3RotaryEmbedding", dict(
        head_dim=16, max_position_embeddings=4096, original_max_position_embeddings=512,
        rope_parameters=dict(rope_type="yarn", rope_theta=10000.0, factor=8.0,
                             attention_factor=1.25, beta_fast=16, beta_slow=2)), 16),
    # old-style `rope_scaling`, no original length: max_position_embeddings stands in
    "old_style": ("Qwen3Config", "qwen3.modeling_qwen3.Qwen3RotaryEmbedding", dict(
        head_dim=32, max_position_embeddings=2048, rope_theta=500000.0,
        rope_scaling=dict(type="yarn", factor=2.0)), 32),
}


def _hf(name):
    import importlib

    import transformers as T
    cls_name, rotary, fields, dim = CASES[name]
    module, _, cls = rotary.rpartition(".")
    rotary_cls = getattr(importlib.import_module(f"transformers.models.{module}"), cls)
    return getattr(T, cls_name)(**json.loads(json.dumps(fields))), rotary_cls, fields, dim


@pytest.mark.parametrize("name", sorted(CASES))
def test_yarn_parameters_equal_transformers(name):
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    hf, _, fields, dim = _hf(name)
    want_inv, want_af = ROPE_INIT_FUNCTIONS["yarn"](hf)
    theta, scaling = _rope(json.loads(json.dumps(fields)), "config.json")
    inv, af = yarn_parameters(dim, theta, scaling)
    assert inv.dtype == torch.float32 and torch.equal(inv, want_inv)
    assert af == pytest.approx(want_af, rel=1e-15)


@pytest.mark.parametrize("name", sorted(CASES))
def test_cos_sin_table_equals_transformers_rotary(name):
    """The table the kernels read is the model's own rotary output, attention factor
    included, at positions inside and beyond the original context."""
    hf, rotary_cls, fields, dim = _hf(name)
    theta, scaling = _rope(json.loads(json.dumps(fields)), "config.json")
    positions = torch.tensor([0, 1, 7, 100, 511, 4095, 4096, 9000, 40000])
    table = build_cos_sin_cache(dim, int(positions.max()) + 1, theta, scaling)
    cos, sin = rotary_cls(hf)(torch.zeros(1, dtype=torch.float32), positions[None])
    half = dim // 2
    rows = table[positions]
    torch.testing.assert_close(rows[:, :half], cos[0, :, :half], rtol=0, atol=0)
    torch.testing.assert_close(rows[:, half:], sin[0, :, :half], rtol=0, atol=0)
    assert scaling["rope_type" if "rope_type" in scaling else "type"] == "yarn"


def test_attention_factor_scales_the_table():
    """Not a no-op: the same frequencies with attention_factor 2 give exactly twice the table."""
    base = dict(rope_type="yarn", factor=8.0, original_max_position_embeddings=64)
    one = build_cos_sin_cache(16, 200, 10000.0, dict(base, attention_factor=1.0))
    two = build_cos_sin_cache(16, 200, 10000.0, dict(base, attention_factor=2.0))
    assert torch.equal(two, 2 * one)
    plain = build_cos_sin_cache(16, 200, 10000.0)
    assert not torch.allclose(one, plain)       # the frequencies are rescaled


def _config_dir(tmp_path, rope_parameters):
    cfg = dict(architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=32, hidden_size=16,
               intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
               max_position_embeddings=256, rope_parameters=rope_parameters)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    return tmp_path


def test_model_config_reads_yarn(tmp_path):
    c = ModelConfig.from_dir(_config_dir(tmp_path, dict(rope_type="yarn", rope_theta=5000.0,
                                                        original_max_position_embeddings=64)))
    assert c.rope_theta == 5000.0
    assert c.rope_scaling["factor"] == 4.0      # no factor: 256 / 64, as transformers does
    assert c.rope_scaling["original_max_position_embeddings"] == 64


@pytest.mark.parametrize("bad", [dict(factor=-2.0), dict(factor="x"),
                                 dict(original_max_position_embeddings=0)])
def test_bad_yarn_fields_name_file_and_field(tmp_path, bad):
    rope = {**dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=64), **bad}
    d = _config_dir(tmp_path, rope)
    field = next(iter(bad))
    with pytest.raises(ValueError, match=rf"{field}.*config\.json"):
        ModelConfig.from_dir(d)
