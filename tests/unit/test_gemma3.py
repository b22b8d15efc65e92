"""Gemma 3 (text) in pdserve's engine against transformers' Gemma3ForCausalLM on a tiny random
model: local (window 8) and global layers with their own rotary bases, linear rope scaling on
the global ones, Gemma's (1 + w) norms, four per layer, q/k norm, the scaled embedding, GeGLU,
query_pre_attn_scalar; prompts longer than the window. Greedy tokens identical for 32 tokens,
logprobs (sampled and prompt) within 1e-3, under chunked prefill and a prefix-cache hit too,
with the torch references, the C kernels (auto on CPU) and Triton under the interpreter."""
from __future__ import annotations

import json
import random

import pytest
import torch

from engine import LLM, LLMEngine, SamplingParams
from engine.config import ModelConfig
from tests.hf_models import hf_greedy
from tests.hf_models_window import WINDOW, make_window_model
from tests.unit.test_engine_vs_hf import assert_matches, assert_no_blocks_held, run_staggered

NEW = 32
LENGTHS = [3, 9, 17, 30, 45]          # most longer than the window
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True, logprobs=0)


def _prompts(seed=0):
    rng = random.Random(seed)
    return [[rng.randrange(3, 512) for _ in range(n)] for n in LENGTHS]


@pytest.fixture(scope="module")
def gemma(tmp_path_factory):
    d = make_window_model("gemma3_text", tmp_path_factory.mktemp("gemma3_text"))
    return d, hf_greedy(d, _prompts(), NEW)


def _run(engine: LLMEngine, prompts, params=GREEDY):
    """Two requests admitted per step (run_staggered); every block back afterwards."""
    outs = run_staggered(engine, prompts, params)
    assert_no_blocks_held(engine)
    return outs


@pytest.mark.parametrize("backend", ["torch", "auto"])
def test_greedy_identical_to_transformers(gemma, backend):
    d, ref = gemma
    assert_matches(_run(LLMEngine.from_model_dir(d, num_blocks=128, kernel_backend=backend),
                         _prompts()), ref)


def test_chunked_prefill_and_prefix_hit(gemma):
    """Chunks of 5 tokens (windows cross chunk and block boundaries); then a prompt sharing
    the longest one's first 44 tokens (11 blocks of 4) hits the prefix cache and computes
    only its tail, with the same tokens as transformers."""
    d, ref = gemma
    engine = LLMEngine.from_model_dir(d, num_blocks=128, block_size=4, max_num_batched_tokens=5)
    assert_matches(_run(engine, _prompts()), ref)
    longer = _prompts()[-1][:44] + [7, 8, 9]
    out = _run(engine, [longer])[0]
    assert out.num_cached_tokens == 44
    assert out.token_ids == hf_greedy(d, [longer], NEW)[0][0]


def test_prompt_logprobs(gemma):
    import transformers as T
    d, _ = gemma
    seq = _prompts()[-1]
    model = T.AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
    with torch.no_grad():
        lp = torch.log_softmax(model(torch.tensor([seq])).logits[0, :-1].float(), -1)
    want = lp[torch.arange(len(seq) - 1), seq[1:]]
    out = LLM(d, num_blocks=64, max_num_batched_tokens=16).generate(
        [seq], SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0))[0]
    got = torch.tensor([out.prompt_logprobs[j][0] for j in range(1, len(seq))])
    assert (got - want).abs().max().item() < 1e-3


def test_triton_backend_under_the_interpreter(gemma):
    d, ref = gemma
    engine = LLMEngine.from_model_dir(d, num_blocks=64, kernel_backend="triton",
                                      max_num_batched_tokens=16)
    short = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=0)
    out = _run(engine, [_prompts()[3]], short)[0]
    assert out.token_ids == ref[3][0][:6]


def test_config_layers_windows_and_ropes(gemma):
    d, _ = gemma
    c = ModelConfig.from_dir(d)
    assert [c.layer_window(i) for i in range(c.num_layers)] == [WINDOW, WINDOW, None, WINDOW, None]
    assert c.max_model_len == 512                  # not capped at the window
    rope = c.extra["rope"]
    assert rope["full_attention"]["rope_type"] == "linear" and rope["sliding_attention"]["rope_theta"] == 1e4


@pytest.mark.parametrize("field, value", [("final_logit_softcapping", 30.0),
                                          ("attn_logit_softcapping", 50.0),
                                          ("use_bidirectional_attention", True),
                                          ("hidden_activation", "gelu"),
                                          ("layer_types", ["sliding_attention"])])
def test_unsupported_config_refused(gemma, tmp_path, field, value):
    d, _ = gemma
    c = json.loads((d / "config.json").read_text())
    c[field] = value
    (tmp_path / "config.json").write_text(json.dumps(c))
    with pytest.raises(ValueError, match=field) as e:
        ModelConfig.from_dir(tmp_path)
    assert "config.json" in str(e.value)
