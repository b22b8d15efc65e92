"""Sliding-window models past their window, against transformers: Mistral (every layer
windowed) and Qwen2 with use_sliding_window (the layers layer_types names windowed, the
others full), window 8 under prompts of up to 45 tokens and 32 new ones. Greedy tokens
identical, logprobs within 1e-3, with the torch references and the C kernels, chunked
prefill too; and the context no longer capped at the window."""
from __future__ import annotations

import random

import pytest

from engine import LLMEngine, SamplingParams
from engine.config import ModelConfig
from tests.hf_models import hf_greedy
from tests.hf_models_window import WINDOW, make_window_model

NEW = 32
LENGTHS = [5, 12, 30, 45]
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True, logprobs=0)


def _prompts():
    rng = random.Random(1)
    return [[rng.randrange(3, 512) for _ in range(n)] for n in LENGTHS]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    cache = {}

    def get(kind):
        if kind not in cache:
            d = make_window_model(kind, tmp_path_factory.mktemp(kind))
            cache[kind] = (d, hf_greedy(d, _prompts(), NEW))
        return cache[kind]
    return get


def _generate(engine: LLMEngine, prompts):
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, GREEDY)
    final = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                final[int(out.request_id[1:])] = out
    assert engine.kv.num_held_blocks() == 0
    return [final[i] for i in range(len(prompts))]


@pytest.mark.parametrize("kind", ["mistral-window", "qwen2-window"])
@pytest.mark.parametrize("backend, chunk", [("torch", 2048), ("auto", 7)])
def test_greedy_identical_past_the_window(models, kind, backend, chunk):
    d, ref = models(kind)
    engine = LLMEngine.from_model_dir(d, num_blocks=128, block_size=4, kernel_backend=backend,
                                      max_num_batched_tokens=chunk)
    for i, (o, (toks, lps)) in enumerate(zip(_generate(engine, _prompts()), ref)):
        assert o.token_ids == toks, f"prompt {i}: tokens differ"
        assert max(abs(a - b) for a, b in zip(o.logprobs, lps)) < 1e-3, f"prompt {i}: logprobs"


def test_windows_per_layer_and_no_cap(models):
    mistral = ModelConfig.from_dir(models("mistral-window")[0])
    assert mistral.max_model_len == 512 and mistral.layer_window(1) == WINDOW
    qwen2 = ModelConfig.from_dir(models("qwen2-window")[0])      # max_window_layers=1
    assert [qwen2.layer_window(i) for i in range(qwen2.num_layers)] == [None, WINDOW]
