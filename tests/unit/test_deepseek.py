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

VARIANTS = {"dense": dict(first_k_dense_replace=3),
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
