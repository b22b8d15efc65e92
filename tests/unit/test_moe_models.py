"""Mixture-of-experts models (Mixtral, Qwen2-MoE, Qwen3-MoE): pdserve's greedy output equals
transformers' `generate()` token for token, logprobs within 1e-3 (float32), with requests
joining the batch at different steps, under chunked prefill, a prefix-cache hit, preemption,
the padded CUDA-graph decode path and the prefill/decode split (in one process, and over
gRPC through the gateway); unsupported configs fail with a clear error."""
from __future__ import annotations

import asyncio
import json
import uuid

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine import LLM, LLMEngine
from engine.config import ModelConfig
from engine.runner import ModelRunner
from engine.sampling_params import SamplingParams
from engine.tiny_model import ensure_default_model
from gateway.request import GenerateInput
from tests.helpers import split_generate
from tests.hf_models import hf_greedy, make_hf_model
from tests.unit.test_engine_vs_hf import (GREEDY, NEW, _prompts, assert_matches,
                                          assert_no_blocks_held, run_staggered)
from tests.unit.test_pd_inprocess import System

KINDS = ["mixtral", "qwen2_moe", "qwen3_moe"]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    cache = {}

    def get(kind):
        if kind not in cache:
            d = make_hf_model(kind, tmp_path_factory.mktemp(kind))
            cache[kind] = (d, hf_greedy(d, _prompts(), NEW))
        return cache[kind]
    return get


def test_configs_parse_as_transformers_builds_them(models):
    mix = ModelConfig.from_dir(models("mixtral")[0])
    assert (mix.moe.num_experts, mix.moe.top_k, mix.moe.norm_topk_prob) == (8, 2, True)
    # the window (256) is attended as a window now, so the context is the model's own
    assert mix.moe.sparse_layers == [0, 1] and mix.max_model_len == 512 and mix.layer_window(0) == 256
    q2 = ModelConfig.from_dir(models("qwen2_moe")[0])
    assert (q2.moe.top_k, q2.moe.norm_topk_prob, q2.moe.shared_intermediate_size) == (4, False, 96)
    assert q2.moe.sparse_layers == [1] and q2.qkv_bias                     # layer 0 dense
    q3 = ModelConfig.from_dir(models("qwen3_moe")[0])
    assert q3.moe.norm_topk_prob and q3.qk_norm and q3.moe.sparse_layers == [0, 1]


@pytest.mark.parametrize("kind", KINDS)
def test_greedy_identical_to_transformers(models, kind):
    d, ref = models(kind)
    engine = LLMEngine.from_model_dir(d, num_blocks=256)
    assert_matches(run_staggered(engine, _prompts()), ref)
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


@pytest.mark.parametrize("kind", KINDS)
def test_preemption_keeps_outputs_identical(models, kind):
    d, ref = models(kind)
    engine = LLMEngine.from_model_dir(d, num_blocks=14)
    outs = run_staggered(engine, _prompts())
    assert engine.scheduler.num_preemptions > 0
    assert_matches(outs, ref)
    assert_no_blocks_held(engine)


@pytest.mark.parametrize("kind", KINDS)
def test_split_prefill_and_decode_instances(models, kind):
    d, ref = models(kind)
    pre = LLMEngine.from_model_dir(d, num_blocks=64)
    dec = LLMEngine.from_model_dir(d, num_blocks=64)
    outs = [split_generate(pre, dec, f"s{i}", p, GREEDY)[1] for i, p in enumerate(_prompts())]
    assert_matches(outs, ref)
    assert_no_blocks_held(pre)
    assert_no_blocks_held(dec)


def test_padded_decode_graph_path(models):
    """The CUDA-graph decode path (static buffers, batches padded to a bucket, run eagerly on
    CPU): padding rows are routed too, and must not change the live rows' outputs."""
    d, ref = models("mixtral")
    engine = LLMEngine.from_model_dir(d, num_blocks=256)
    engine.runner = ModelRunner(engine.model, 256, 16, torch.float32, "cpu", max_num_seqs=8,
                                decode_graphs=True)
    assert_matches(run_staggered(engine, _prompts()), ref)


def test_over_pd_through_the_gateway(tmp_path, models):
    """Prefill and decode workers (gRPC, loopback KV transfer) and the gateway on the
    Qwen2-MoE model: streamed greedy tokens equal transformers'; every block comes back."""
    src, ref = models("qwen2_moe")
    d = _copy(src, tmp_path / "m")
    tiny = ensure_default_model()                # the gateway needs a tokenizer to detokenize
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (d / name).write_bytes((tiny / name).read_bytes())
    prompts = _prompts()[:4]

    async def one(prompt):
        inp = GenerateInput("moe-" + uuid.uuid4().hex, prompt,
                            SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True))
        return [t async for ev in system.gateway.generate(inp) for t in ev.token_ids]

    async def main():
        outs = await asyncio.gather(*map(one, prompts))
        assert outs == [toks for toks, _ in ref[:4]]
        await system.wait_all_free()
    with System.started(str(d)) as system:
        system.run(main())


def _copy(src, d):
    d.mkdir()
    for f in src.iterdir():
        (d / f.name).write_bytes(f.read_bytes())
    return d


@pytest.mark.parametrize("changes,message", [
    ({"hidden_act": "gelu"}, "unsupported hidden_act 'gelu'"),
    ({"num_experts_per_tok": 9}, "num_experts_per_tok 9 must be in 1..8"),
    ({"num_local_experts": None}, "needs 'num_local_experts'"),
])
def test_unsupported_configs_fail_clearly(tmp_path, models, changes, message):
    d = _copy(models("mixtral")[0], tmp_path / "m")
    c = json.loads((d / "config.json").read_text())
    c.update(changes)                                       # None: the field is absent
    (d / "config.json").write_text(json.dumps({k: v for k, v in c.items() if v is not None}))
    with pytest.raises(ValueError, match=message):
        LLMEngine.from_model_dir(d, num_blocks=16)


def test_missing_expert_tensor_fails_naming_it(tmp_path, models):
    d = _copy(models("qwen3_moe")[0], tmp_path / "m")
    tensors = load_file(d / "model.safetensors")
    del tensors["model.layers.1.mlp.experts.5.up_proj.weight"]
    save_file(tensors, d / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"15 of 16 expert tensors of 'layers.1.mlp.experts.gate_up_proj'"):
        LLMEngine.from_model_dir(d, num_blocks=16)
