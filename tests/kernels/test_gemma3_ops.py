"""Gemma 3's ops: the GeGLU gate (gelu_tanh_and_mul: the reference against transformers'
gelu_pytorch_tanh, the Triton kernel against the reference) and linear rope scaling (the
rotary table against transformers' inverse frequencies)."""
import pytest
import torch

from engine.kernels import reference
from engine.kernels.activation import gelu_tanh_and_mul
from engine.kernels.rope import build_cos_sin_cache
from kernel_testlib import DEVICE, assert_close, fresh_generator, poisoned, randn


def test_reference_is_transformers_gelu_pytorch_tanh():
    from transformers.activations import ACT2FN
    gen, seed = fresh_generator()
    x = randn(gen, 7, 2 * 96, scale=3.0)
    want = ACT2FN["gelu_pytorch_tanh"](x[:, :96]) * x[:, 96:]
    assert torch.equal(reference.gelu_tanh_and_mul(x), want), f"seed={seed}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_gelu_tanh_and_mul(dtype):
    gen, seed = fresh_generator()
    x = randn(gen, 5, 2 * 1500, dtype=dtype, scale=3.0)   # 1500: two column blocks, masked
    out = gelu_tanh_and_mul(x.to(DEVICE), out=poisoned(x[..., :1500]).to(DEVICE))
    assert_close(out, reference.gelu_tanh_and_mul(x.float()).to(dtype), dtype, seed, "gelu_tanh_and_mul")


def test_linear_rope_is_transformers():
    import transformers as T
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    cfg = T.Gemma3TextConfig(head_dim=32, num_hidden_layers=2, rope_parameters={
        "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
        "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}})
    inv_freq, _ = ROPE_INIT_FUNCTIONS["linear"](cfg, "cpu", layer_type="full_attention")
    pos = torch.arange(300).float()
    freqs = pos[:, None] * inv_freq[None, :]
    want = torch.cat((freqs.cos(), freqs.sin()), -1)
    got = build_cos_sin_cache(32, 300, 1e6, {"rope_type": "linear", "factor": 8.0})
    assert torch.equal(got, want)
    assert not torch.equal(got, build_cos_sin_cache(32, 300, 1e6))
