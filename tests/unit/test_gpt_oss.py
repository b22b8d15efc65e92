"""GPT-OSS (engine/models/gpt_oss.py) against transformers 5.24 on a tiny random model with
the real structure (tests/hf_models_gptoss.py: sinks, a window of 8 on alternate layers,
YaRN, biased top-2-of-8 experts with the clamped SwiGLU): greedy tokens identical for 32
tokens on prompts longer than the window, logprobs within 1e-3, prompt logprobs too, under
chunked prefill and a prefix-cache hit, with the torch references and the C kernels (auto);
quantized experts carry the biases and the activation; bad configs are ValueErrors."""
from __future__ import annotations

import json
import random

import pytest
import torch

from engine import LLM, LLMEngine, SamplingParams
from tests.hf_models import hf_greedy
from tests.hf_models_gptoss import make_gpt_oss
from tests.unit.test_engine_vs_hf import GREEDY, NEW, assert_matches, assert_no_blocks_held, run_staggered

LENGTHS = [3, 9, 12, 17, 25, 40, 63]      # all but one longer than the window (8)
BACKENDS = ["torch", "auto"]              # auto on CPU: the C kernels (windowed decode, sinks)


def _prompts(seed=1):
    rng = random.Random(seed)
    return [[rng.randrange(3, 512) for _ in range(n)] for n in LENGTHS]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    d = make_gpt_oss(tmp_path_factory.mktemp("gpt_oss"))
    return d, hf_greedy(d, _prompts(), NEW)


def _engine(d, backend, **kw):
    return LLMEngine.from_model_dir(d, num_blocks=kw.pop("num_blocks", 256), kernel_backend=backend, **kw)


def test_config_reads_the_structure(model):
    c = _engine(model[0], "torch").config.model
    assert c.layer_types == ["sliding_attention", "full_attention"] * 2
    assert [c.layer_window(i) for i in range(4)] == [8, None, 8, None]
    assert c.attention_sinks and c.qkv_bias and c.moe.num_experts == 8 and c.moe.top_k == 2
    assert c.rope_scaling["rope_type"] == "yarn" and c.extra == dict(swiglu_alpha=1.702, swiglu_limit=7.0)
    assert c.max_model_len == 512           # windows are real: no cap at the window


@pytest.mark.parametrize("backend", BACKENDS)
def test_greedy_identical_to_transformers(model, backend):
    d, ref = model
    engine = _engine(d, backend)
    assert_matches(run_staggered(engine, _prompts()), ref)
    assert_no_blocks_held(engine)


@pytest.mark.parametrize("backend", BACKENDS)
def test_chunked_prefill(model, backend):
    """Chunks of 10 tokens over blocks of 4: each chunk's window reaches back into earlier
    chunks' blocks."""
    d, ref = model
    engine = _engine(d, backend, block_size=4, max_num_batched_tokens=10)
    assert_matches(run_staggered(engine, _prompts()), ref)
    assert_no_blocks_held(engine)


def _hf_prompt_logprobs(d, prompt):
    import transformers as T
    hf = T.AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
    with torch.no_grad():
        lp = torch.log_softmax(hf(torch.tensor([prompt])).logits[0].float(), -1)
    return [lp[j, prompt[j + 1]].item() for j in range(len(prompt) - 1)]


@pytest.mark.parametrize("backend", BACKENDS)
def test_prompt_logprobs_within_1e3(model, backend):
    d, _ = model
    prompt = _prompts(seed=5)[-1] + _prompts(seed=6)[-1]        # 126 tokens, past yarn's 64
    want = _hf_prompt_logprobs(d, prompt)
    llm = LLM.__new__(LLM)
    llm.engine, llm._counter = _engine(d, backend, max_num_batched_tokens=16), 0
    out = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0))[0]
    got = [lp for lp, _ in out.prompt_logprobs[1:]]
    assert len(got) == len(want)
    assert max(abs(a - b) for a, b in zip(got, want)) < 1e-3


@pytest.mark.parametrize("backend", BACKENDS)
def test_prefix_cache_hit(model, backend):
    d, _ = model
    engine = _engine(d, backend, block_size=4)
    llm = LLM.__new__(LLM)
    llm.engine, llm._counter = engine, 0
    base = _prompts()[-1]                                       # 63 tokens
    llm.generate([base], GREEDY)
    longer = base + [5, 6, 7, 8, 9]
    b = llm.generate([longer], GREEDY)[0]
    assert b.num_cached_tokens == 60
    toks, lps = hf_greedy(d, [longer], NEW)[0]
    assert b.token_ids == toks
    assert max(abs(x - y) for x, y in zip(b.logprobs, lps)) < 1e-3
    assert_no_blocks_held(engine)


def test_quantized_experts_keep_biases_and_activation(model):
    """--quantization int8: every GPT-OSS block's experts become QuantExperts with the
    biases on their layers and the clamped SwiGLU; each block's output stays within int8's
    error of the float block's (biases or activation lost would be O(1) off)."""
    from engine.models.gpt_oss import GptOssMoeBlock
    from engine.quant.linear import QuantExperts
    from engine.quant.quantize import quantize_model
    d, ref = model
    float_model = _engine(d, "torch").runner.model
    quant = _engine(d, "torch", quantization="int8")
    qmodel = quant.runner.model
    blocks = [m for m in qmodel.modules() if isinstance(m, GptOssMoeBlock)]
    assert len(blocks) == 4 and all(isinstance(b.experts, QuantExperts) for b in blocks)
    assert all(b.experts.swiglu == (1.702, 7.0) and b.experts.gate_up[0].bias is not None for b in blocks)
    x = torch.randn(16, 64, generator=torch.Generator().manual_seed(0))
    for fb, qb in zip(float_model.moe_blocks(), blocks):
        want, got = fb(x), qb(x)
        assert (got - want).norm() / want.norm() < 0.05
    outs = run_staggered(quant, _prompts()[:3], SamplingParams(temperature=0.0, max_tokens=8,
                                                               ignore_eos=True, logprobs=0))
    agree = sum(a == b for o, (toks, _) in zip(outs, ref) for a, b in zip(o.token_ids, toks[:8]))
    assert agree >= 12, f"int8 greedy tokens agree with float on only {agree} of 24"
    assert quantize_model(qmodel, "int8") is qmodel              # already quantized: untouched


def _config(tmp_path, **changes):
    c = dict(architectures=["GptOssForCausalLM"], model_type="gpt_oss", vocab_size=32, hidden_size=16,
             intermediate_size=8, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
             head_dim=8, sliding_window=4, num_local_experts=4, num_experts_per_tok=2,
             max_position_embeddings=64, rope_theta=150000.0)
    c.update(changes)
    (tmp_path / "config.json").write_text(json.dumps(c))
    return tmp_path


@pytest.mark.parametrize("changes,field", [
    (dict(layer_types=["sliding_attention"]), "layer_types"),
    (dict(layer_types=["sliding_attention", "chunked_attention"]), "layer_types"),
    (dict(swiglu_limit=None), "swiglu_limit"),
    (dict(swiglu_alpha=-1.0), "swiglu_alpha"),
    (dict(num_experts_per_tok=5), "num_experts_per_tok"),
    (dict(quantization_config=dict(quant_method="mxfp4")), "mxfp4"),
])
def test_bad_config_is_a_value_error_naming_file_and_field(tmp_path, changes, field):
    from engine.config import EngineConfig, EngineOptions
    d = _config(tmp_path, **changes)
    (d / "model.safetensors").write_bytes(b"")
    with pytest.raises(ValueError, match=field) as e:
        EngineConfig.build(d, EngineOptions())
        from engine.loader import checkpoint_tensors
        list(checkpoint_tensors(d))
    assert "config.json" in str(e.value)
