"""DeepSeek-V3 (MLA + its MoE) equals transformers token for token: the absorbed decode and the
expanded prefill, chunked prefill and prefix hits, the P/D split, with no block held."""
from __future__ import annotations

import pytest

from engine import LLMEngine
from tests.hf_models import hf_greedy
from tests.hf_models_mla import YARN, make_deepseek
from tests.unit.test_engine_vs_hf import (GREEDY, _prompts, assert_matches, assert_no_blocks_held,
                                          run_staggered)

VARIANTS = {"dense": dict(first_k_dense_replace=3), "full-rank-q": dict(q_lora_rank=None, first_k_dense_replace=3)}


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
