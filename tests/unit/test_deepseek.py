"""DeepSeek-V3 (MLA + its MoE) equals transformers token for token: the absorbed decode and the
expanded prefill, chunked prefill and prefix hits, the P/D split, with no block held."""
from __future__ import annotations

import pytest

from engine import LLMEngine
from engine.tiny_model import ensure_default_model
from tests.hf_models import hf_greedy
from tests.hf_models_mla import YARN, make_deepseek
from tests.unit.test_engine_vs_hf import (GREEDY, _prompts, assert_matches, assert_no_blocks_held,
                                          run_staggered)

VARIANTS = {"moe": {}, "dense": dict(first_k_dense_replace=3),
            "full-rank-q": dict(q_lora_rank=None, first_k_dense_replace=3),
            "yarn": dict(first_k_dense_replace=3, rope_parameters=YARN)}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    cache = {}

    def get(kind):
        if kind not in cache:
            d = make_deepseek(tmp_path_factory.mktemp(kind), **VARIANTS.get(kind, {}))
            cache[kind] = (d, hf_greedy(d, _prompts(), 32))
        return cache[kind]
    return get


@pytest.mark.parametrize("kind", list(VARIANTS))
@pytest.mark.parametrize("backend", ["torch", "auto"])
def test_greedy_identical_to_transformers(models, kind, backend):
    d, ref = models(kind)
    engine = LLMEngine.from_model_dir(d, num_blocks=256, block_size=8, kernel_backend=backend)
    assert_matches(run_staggered(engine, _prompts()), ref)
    assert_no_blocks_held(engine)


def test_pd_split_moves_the_latent_cache(models):
    """The whole P/D path in one process (a prefill worker chunking by 16 tokens, a decode
    worker, the gateway): greedy tokens equal transformers', a second prompt sharing the first
    one's blocks is a prefix hit on both workers, and every block comes back."""
    import uuid

    from engine.sampling_params import SamplingParams
    from gateway.request import GenerateInput
    from tests.unit.test_pd_inprocess import System

    d, ref = models("dense")
    tiny = ensure_default_model()                # the gateway needs a tokenizer to detokenize
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (d / name).write_bytes((tiny / name).read_bytes())
    prompts = _prompts()[5:]                              # 25, 40 and 63 tokens
    longer = prompts[-1] + [5, 6, 7]
    ref = ref[5:] + hf_greedy(d, [longer], 32)
    with System.started(str(d)) as s:
        async def main():
            outs = []
            for prompt in prompts + [longer]:
                inp = GenerateInput("ds-" + uuid.uuid4().hex, prompt,
                                    SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True))
                outs.append([t async for ev in s.gateway.generate(inp) for t in ev.token_ids])
            await s.wait_all_free()
            return outs
        outs = s.run(main())
    assert outs == [toks for toks, _ in ref]


def test_chunked_prefill_and_prefix_hit(models):
    """Chunks of 10 tokens over the expanded prefill, then a prompt sharing 15 cached blocks:
    only its new tokens are computed, and its tokens equal transformers'."""
    d, ref = models("moe")
    engine = LLMEngine.from_model_dir(d, num_blocks=256, block_size=4, max_num_batched_tokens=10)
    assert_matches(run_staggered(engine, _prompts()), ref)
    longer = _prompts()[-1] + [5, 6, 7, 8, 9]            # 63 + 5: 15 full blocks cached
    computed = []
    orig = engine.runner.execute
    engine.runner.execute = lambda sched, *args: computed.append(sched.num_tokens) or orig(sched, *args)
    out = run_staggered(engine, [longer])[0]
    assert out.num_cached_tokens == 60 and computed[0] == len(longer) - 60
    assert out.token_ids == hf_greedy(d, [longer], 32)[0][0]
    assert_no_blocks_held(engine)


@pytest.mark.parametrize("method,tol", [("int8", 0.15), ("int4_g32", 1.0), ("fp8", 0.4)])
def test_quantized_weights(models, method, tol):
    """The MLA projections and the experts held quantized by the scheme, kv_b_proj float (decode
    absorbs it), and prompt logprobs near the float model's."""
    from engine.models.moe import SparseMoeBlock
    from engine.quant.linear import QuantExperts, QuantLinear
    from engine.sampling_params import SamplingParams
    d, _ = models("moe")
    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0)
    prompt = _prompts()[-1]

    def run(**kw):
        engine = LLMEngine.from_model_dir(d, num_blocks=64, block_size=8, **kw)
        out = run_staggered(engine, [prompt], params)[0]
        return engine, [lp for lp, _ in out.prompt_logprobs[1:]]
    _, flt = run()
    engine, q = run(quantization=method)
    attn = engine.model.layers[1].self_attn
    assert all(isinstance(getattr(attn, n), QuantLinear) for n in ("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "o_proj"))
    assert not isinstance(attn.kv_b_proj, QuantLinear)
    assert all(isinstance(b.experts, QuantExperts) for b in engine.model.moe_blocks())
    assert isinstance(engine.model.layers[1].mlp, SparseMoeBlock)
    err = sum(abs(a - b) for a, b in zip(flt, q)) / len(q)
    assert 0 < err < tol, err
