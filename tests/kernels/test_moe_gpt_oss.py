"""GPT-OSS's experts: fused_moe with biases and the clamped SwiGLU (Triton, under
TRITON_INTERPRET=1 on CPU) against the torch reference; the reference's activation against
transformers' GptOssExperts._apply_gate; gpt_oss_swiglu (Triton) against the reference."""
import pytest
import torch

from engine.kernels import reference
from engine.kernels.activation import gpt_oss_swiglu
from engine.kernels.moe import fused_moe
from kernel_testlib import assert_close, fresh_generator, on_device, randn

E, H, I = 8, 32, 48
SWIGLU = (1.702, 7.0)


def weights(gen, dtype):
    # scaled up so that a good share of the pre-activations pass the clamp at 7
    return (randn(gen, E, 2 * I, H, dtype=dtype, scale=4 * H ** -0.5),
            randn(gen, E, 2 * I, dtype=dtype, scale=2.0),
            randn(gen, E, H, I, dtype=dtype, scale=I ** -0.5),
            randn(gen, E, H, dtype=dtype))


def routing(gen, tokens, k):
    logits = randn(gen, tokens, E)
    top, ids = logits.topk(k, -1)
    return top.softmax(-1), ids


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens,k", [(1, 2), (3, 2), (17, 4), (64, 2)])
def test_fused_moe_biases_and_clamped_swiglu(dtype, tokens, k):
    gen, seed = fresh_generator()
    x = randn(gen, tokens, H, dtype=dtype, scale=2.0)
    w13, b13, w2, b2 = weights(gen, dtype)
    topw, ids = routing(gen, tokens, k)
    got = fused_moe(*on_device(x, w13, w2, topw, ids), w13_bias=on_device(b13)[0],
                    w2_bias=on_device(b2)[0], swiglu=SWIGLU)
    assert got.dtype == dtype and got.shape == x.shape
    want = reference.fused_moe(x.float(), w13.float(), w2.float(), topw, ids, b13.float(),
                               b2.float(), SWIGLU)
    # bf16: the intermediate is stored rounded (values up to ~60 past the clamp), so compare
    # relative to the output's scale
    norm = want.abs().max() if dtype == torch.bfloat16 else 1.0
    assert_close(got.float() / norm, want / norm, dtype, seed, f"T={tokens} k={k}")
    # the biases and the activation matter: without them the result is another one
    plain = reference.fused_moe(x.float(), w13.float(), w2.float(), topw, ids)
    assert (plain - want).abs().max() > 0.1


def test_fused_moe_bias_without_clamp():
    """Biases alone keep the SiLU gate (each epilogue switch on its own)."""
    gen, seed = fresh_generator()
    x = randn(gen, 9, H)
    w13, b13, w2, b2 = weights(gen, torch.float32)
    topw, ids = routing(gen, 9, 2)
    got = fused_moe(*on_device(x, w13, w2, topw, ids), w13_bias=on_device(b13)[0],
                    w2_bias=on_device(b2)[0])
    want = reference.fused_moe(x, w13, w2, topw, ids, b13, b2)
    assert_close(got, want, torch.float32, seed, "bias, silu")


def test_bias_shape_checked():
    gen, _ = fresh_generator()
    x = randn(gen, 2, H)
    w13, b13, w2, b2 = weights(gen, torch.float32)
    topw, ids = routing(gen, 2, 2)
    with pytest.raises(ValueError, match="w2_bias"):
        fused_moe(*on_device(x, w13, w2, topw, ids), w2_bias=on_device(b13)[0])


def test_reference_activation_is_transformers():
    """reference.gpt_oss_swiglu on cat(gate, up) = GptOssExperts._apply_gate on the
    checkpoint's interleaved [g0, u0, g1, u1, ...] layout."""
    from transformers import GptOssConfig
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts
    gen, _ = fresh_generator()
    inter = randn(gen, 13, 2 * I, scale=6.0)                    # interleaved, as HF stores it
    hf = GptOssExperts(GptOssConfig(hidden_size=H, intermediate_size=I, num_local_experts=E))
    want = hf._apply_gate(inter)
    ours = reference.gpt_oss_swiglu(torch.cat((inter[:, ::2], inter[:, 1::2]), -1), hf.alpha, hf.limit)
    assert torch.equal(ours, want)
    assert (inter[:, ::2] > 7).any() and (inter[:, 1::2].abs() > 7).any()   # the clamps ran


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gpt_oss_swiglu_kernel(dtype):
    gen, seed = fresh_generator()
    x = randn(gen, 7, 2 * 200, dtype=dtype, scale=6.0)           # 200: not a power of two
    got = gpt_oss_swiglu(*on_device(x), *SWIGLU)
    assert got.shape == (7, 200) and got.dtype == dtype
    assert_close(got, reference.gpt_oss_swiglu(x.float(), *SWIGLU), dtype, seed, "swiglu")


def test_gpt_oss_engine_with_triton_kernels(tmp_path, monkeypatch):
    """The whole engine on a 2-layer GPT-OSS (a windowed layer and a full one, sinks, YaRN)
    with the Triton kernels gives transformers' greedy tokens, prompts past the window, and
    the MoE layers really ran the fused kernel."""
    import engine.kernels as K
    from engine import LLMEngine, SamplingParams
    from kernel_testlib import DEVICE
    from tests.hf_models import hf_greedy
    from tests.hf_models_gptoss import make_gpt_oss
    d = make_gpt_oss(tmp_path / "m", num_hidden_layers=2)
    prompts = [[7, 100, 33, 250, 9, 11, 12, 13, 14, 15, 16], list(range(40, 52))]
    ref = hf_greedy(d, prompts, 4)
    engine = LLMEngine.from_model_dir(d, num_blocks=16, block_size=4, kernel_backend="triton",
                                      device=str(DEVICE), dtype="float32")
    launched = []
    triton_op = K._triton_op
    monkeypatch.setattr(K, "_triton_op", lambda *a: launched.append(a[0]) or triton_op(*a))
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, logprobs=0)
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, params)
    done = {}
    while engine.has_unfinished_requests():
        done.update({o.request_id: o for o in engine.step() if o.finished})
    for i, (toks, lps) in enumerate(ref):
        assert done[f"r{i}"].token_ids == toks, f"prompt {i}"
        assert max(abs(a - b) for a, b in zip(done[f"r{i}"].logprobs, lps)) < 1e-3
    assert "moe" in launched
