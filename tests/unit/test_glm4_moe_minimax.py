"""GLM-4.5 MoE and MiniMax-M2 (tiny random models of their real structure:
tests/hf_models_moe2.py): pdserve's greedy output equals transformers' `generate()` token for
token, logprobs within 1e-3 (float32), on the torch references and on the CPU C kernels, with
requests joining the batch at different steps, under chunked prefill, a prefix-cache hit and
the prefill/decode split; int8 and int4_g32 weights load and stay near the float model; the
correction bias and partial rotary change the output (so the tests see them); unsupported
configs fail with a ValueError naming the field."""
from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine import LLM, LLMEngine
from engine.config import ModelConfig
from engine.quant.linear import QuantExperts, QuantLinear
from engine.sampling_params import SamplingParams
from tests.helpers import split_generate
from tests.hf_models import hf_greedy
from tests.hf_models_moe2 import make_moe2_model
from tests.unit.test_engine_vs_hf import (GREEDY, NEW, _prompts, assert_matches,
                                          assert_no_blocks_held, run_staggered)

KINDS = ["glm4_moe", "minimax_m2"]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    cache = {}

    def get(kind):
        if kind not in cache:
            d = make_moe2_model(kind, tmp_path_factory.mktemp(kind))
            cache[kind] = (d, hf_greedy(d, _prompts(), NEW))
        return cache[kind]
    return get


def test_configs_parse_as_transformers_builds_them(models):
    glm = ModelConfig.from_dir(models("glm4_moe")[0])
    m = glm.moe
    assert (m.num_experts, m.top_k, m.n_group, m.topk_group, m.scoring) == (8, 2, 2, 1, "sigmoid")
    assert m.correction_bias and not m.shared_expert_gate and m.routed_scaling_factor == 1.8
    assert m.shared_intermediate_size == 64 and m.sparse_layers == [1]        # layer 0 dense
    assert glm.rotary_dim == 8 and glm.qkv_bias and glm.qk_norm
    mm = ModelConfig.from_dir(models("minimax_m2")[0])
    assert mm.rotary_dim == 8 and mm.moe.sparse_layers == [0, 1] and mm.moe.n_group == 1
    assert mm.moe.norm_topk_prob and mm.moe.shared_intermediate_size == 0 and not mm.qk_norm


@pytest.mark.parametrize("backend", ["torch", "auto"])
@pytest.mark.parametrize("kind", KINDS)
def test_greedy_identical_to_transformers(models, kind, backend):
    d, ref = models(kind)
    engine = LLMEngine.from_model_dir(d, num_blocks=256, kernel_backend=backend)
    assert_matches(run_staggered(engine, _prompts()), ref)
    assert_no_blocks_held(engine)


@pytest.mark.parametrize("kind", KINDS)
def test_triton_kernels(models, kind):
    """The Triton path (the fused partial rotary + cache write, the MoE kernel, norms over
    q/k views): on CUDA where there is one, else under the interpreter (two prompts, a few
    tokens: the interpreter is slow); chunked prefill too."""
    d, ref = models(kind)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    engine = LLMEngine.from_model_dir(d, device=device, dtype="float32", num_blocks=32,
                                      kernel_backend="triton", max_num_batched_tokens=12)
    prompts, n = _prompts()[1:3], 4
    outs = run_staggered(engine, prompts, SamplingParams(temperature=0.0, max_tokens=n,
                                                         ignore_eos=True, logprobs=0))
    assert_matches(outs, [(toks[:n], lps[:n]) for toks, lps in ref[1:3]])
    assert_no_blocks_held(engine)


@pytest.mark.parametrize("kind", KINDS)
def test_chunked_prefill(models, kind):
    d, ref = models(kind)
    engine = LLMEngine.from_model_dir(d, num_blocks=256, max_num_batched_tokens=10)
    assert_matches(run_staggered(engine, _prompts()), ref)
    assert_no_blocks_held(engine)


@pytest.mark.parametrize("kind", KINDS)
def test_prefix_cache_hit(models, kind):
    d, _ = models(kind)
    llm = LLM(d, num_blocks=256, block_size=4)
    base = _prompts()[-1]                           # 63 tokens: 15 full blocks
    llm.generate([base], GREEDY)
    longer = base + [5, 6, 7, 8, 9]
    out = llm.generate([longer], GREEDY)[0]
    assert out.num_cached_tokens == 60
    assert_matches([out], hf_greedy(d, [longer], NEW))
    assert_no_blocks_held(llm.engine)


def test_split_prefill_and_decode_instances(models):
    d, ref = models("glm4_moe")
    pre = LLMEngine.from_model_dir(d, num_blocks=64)
    dec = LLMEngine.from_model_dir(d, num_blocks=64)
    outs = [split_generate(pre, dec, f"s{i}", p, GREEDY)[1] for i, p in enumerate(_prompts()[:4])]
    assert_matches(outs, ref[:4])
    assert_no_blocks_held(pre)
    assert_no_blocks_held(dec)


@pytest.mark.parametrize("kind", KINDS)
def test_the_correction_bias_and_partial_rotary_matter(models, kind):
    """Without them the tokens change: the equivalence tests above exercise both."""
    d, ref = models(kind)
    engine = LLMEngine.from_model_dir(d, num_blocks=256)
    for block in engine.model.moe_blocks():
        block.gate.e_score_correction_bias.zero_()
    assert [o.token_ids for o in run_staggered(engine, _prompts())] != [t for t, _ in ref]
    engine = LLMEngine.from_model_dir(d, num_blocks=256)
    c = engine.model.config
    c.rotary_dim = None                               # rotate the whole head instead
    engine.model.cos_sin = engine.model.rotary_table()
    assert engine.model.cos_sin.shape[1] == c.head_dim
    assert [o.token_ids for o in run_staggered(engine, _prompts())] != [t for t, _ in ref]


# Teacher-forced along the float model's greedy continuations, mean |logprob - float's| over
# 64 tokens, measured: int8 0.042 (GLM) 0.033 (MiniMax); int4_g32 0.34, 0.31 (a model with
# the wrong weights is off by ~3). Bounds: about 2x.
CLOSE = {"int8": 0.1, "int4_g32": 0.7}


@pytest.mark.parametrize("method", list(CLOSE))
@pytest.mark.parametrize("kind", KINDS)
def test_quantized_weights_load_and_stay_near_float(models, kind, method):
    d, _ = models(kind)
    prompts = _prompts()[:4]
    flt = LLM(d, num_blocks=256)
    cont = flt.generate(prompts, SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True))
    seqs = [p + list(o.token_ids) for p, o in zip(prompts, cont)]
    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0)

    def logprobs(llm):
        return torch.cat([torch.tensor([o.prompt_logprobs[j][0] for j in range(len(p), len(s))])
                          for o, p, s in zip(llm.generate(seqs, params), prompts, seqs)])
    q = LLM(d, num_blocks=256, quantization=method)
    for block in q.engine.model.moe_blocks():
        assert isinstance(block.experts, QuantExperts)
        assert isinstance(block.gate.weight, torch.nn.Parameter)     # the router stays float
        if block.shared_expert is not None:
            assert isinstance(block.shared_expert.gate_up_proj, QuantLinear)
    assert isinstance(q.engine.model.layers[0].self_attn.qkv_proj, QuantLinear)
    diff = (logprobs(q) - logprobs(flt)).abs().mean().item()
    assert diff < CLOSE[method], f"{method}: mean |logprob difference| {diff:.3f}"


def _copy(src, d):
    d.mkdir()
    for f in src.iterdir():
        (d / f.name).write_bytes(f.read_bytes())
    return d


def test_glm_multi_token_prediction_layers_are_skipped(tmp_path, models):
    d = _copy(models("glm4_moe")[0], tmp_path / "m")
    tensors = load_file(d / "model.safetensors")
    extra = {k.replace("layers.1.", "layers.2."): v.clone() for k, v in tensors.items() if ".layers.1." in k}
    save_file({**tensors, **extra}, d / "model.safetensors", metadata={"format": "pt"})
    LLMEngine.from_model_dir(d, num_blocks=16)        # num_nextn_predict_layers 1: layer 2 skipped
    c = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**c, "num_nextn_predict_layers": 0}))
    with pytest.raises(ValueError, match="unexpected tensor 'model.layers.2."):
        LLMEngine.from_model_dir(d, num_blocks=16)


@pytest.mark.parametrize("kind,changes,message", [
    ("glm4_moe", {"rope_parameters": {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.1}},
     r"partial_rotary_factor 0.1 in .*config.json gives rotary dimension 1"),
    ("glm4_moe", {"n_group": 3}, "n_group 3 in .*config.json must divide the 8 experts"),
    ("glm4_moe", {"topk_group": 3}, "topk_group 3 must be in 1..2"),
    ("glm4_moe", {"n_routed_experts": None}, "needs 'n_routed_experts'"),
    ("minimax_m2", {"rotary_dim": 18}, "rotary_dim in .*config.json gives rotary dimension 18"),
    ("minimax_m2", {"scoring_func": "softmax"}, "unsupported scoring_func 'softmax'"),
    ("minimax_m2", {"qk_norm_type": "per_head"}, "unsupported qk_norm_type 'per_head'"),
    ("minimax_m2", {"hidden_act": "gelu"}, "unsupported hidden_act 'gelu'"),
])
def test_unsupported_configs_fail_clearly(tmp_path, models, kind, changes, message):
    d = _copy(models(kind)[0], tmp_path / "m")
    c = json.loads((d / "config.json").read_text())
    c.update(changes)                                       # None: the field is absent
    (d / "config.json").write_text(json.dumps({k: v for k, v in c.items() if v is not None}))
    with pytest.raises(ValueError, match=message):
        ModelConfig.from_dir(d)
