"""Greedy output of pdserve's engine equals transformers' `generate()`, token for token, with
logprobs within 1e-3, for every supported architecture and under chunked prefill, prefix
caching, preemption and the prefill/decode split."""
from __future__ import annotations

import random

import pytest

from engine import LLM, LLMEngine, SamplingParams
from tests.helpers import split_generate
from tests.hf_models import hf_greedy, make_hf_model

ARCHS = ["llama", "llama3", "llama-tied", "mistral", "qwen2", "qwen3"]
NEW = 32
LENGTHS = [3, 7, 12, 16, 17, 25, 40, 63]


def _prompts(seed=0):
    rng = random.Random(seed)
    return [[rng.randrange(3, 512) for _ in range(n)] for n in LENGTHS]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    cache = {}

    def get(kind):
        if kind not in cache:
            d = make_hf_model(kind, tmp_path_factory.mktemp(kind))
            cache[kind] = (d, hf_greedy(d, _prompts(), NEW))
        return cache[kind]
    return get


GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True, logprobs=0)


def run_staggered(engine: LLMEngine, prompts, params=GREEDY):
    """Admit two requests every step, so requests join the running batch at different steps."""
    pending = list(enumerate(prompts))
    final = {}
    while pending or engine.has_unfinished_requests():
        for _ in range(2):
            if pending:
                i, p = pending.pop(0)
                engine.add_request(f"r{i}", p, params)
        for out in engine.step():
            if out.finished:
                final[int(out.request_id[1:])] = out
    return [final[i] for i in range(len(prompts))]


def assert_matches(outs, ref):
    for i, (o, (toks, lps)) in enumerate(zip(outs, ref)):
        assert o.token_ids == toks, f"prompt {i}: tokens differ"
        assert max(abs(a - b) for a, b in zip(o.logprobs, lps)) < 1e-3, f"prompt {i}: logprobs"


def assert_no_blocks_held(engine: LLMEngine):
    engine.kv.pool.check()
    assert engine.kv.num_held_blocks() == 0


@pytest.mark.parametrize("kind", ARCHS)
def test_greedy_identical_to_transformers(models, kind):
    d, ref = models(kind)
    engine = LLMEngine.from_model_dir(d, num_blocks=256)
    assert_matches(run_staggered(engine, _prompts()), ref)
    assert_no_blocks_held(engine)


def test_chunked_prefill(models):
    d, ref = models("llama")
    engine = LLMEngine.from_model_dir(d, num_blocks=256, max_num_batched_tokens=10)
    assert_matches(run_staggered(engine, _prompts()), ref)
    assert_no_blocks_held(engine)


def test_prefix_cache_hit_computes_only_new_tokens(models):
    d, _ = models("llama")
    engine = LLMEngine.from_model_dir(d, num_blocks=256, block_size=4)
    base = _prompts()[-1]                      # 63 tokens
    first = LLM.__new__(LLM)
    first.engine, first._counter = engine, 0
    a = first.generate([base], GREEDY)[0]
    computed = []
    orig = engine.runner.execute

    def spy(sched, *args):
        computed.append(sched.num_tokens)
        return orig(sched, *args)
    engine.runner.execute = spy
    longer = base + [5, 6, 7, 8, 9]            # shares all 15 full blocks of `base` (60 tokens)
    b = first.generate([longer], GREEDY)[0]
    assert b.num_cached_tokens == 60
    # the prompt's uncached tokens in the first step, then one token per decode step
    assert computed[0] == len(longer) - 60
    assert sum(computed) == len(longer) - 60 + NEW - 1
    ref = hf_greedy(d, [longer], NEW)[0]
    assert b.token_ids == ref[0]
    assert a.num_cached_tokens == 0
    assert_no_blocks_held(engine)


def test_requests_sharing_an_uncached_prefix_compute_it_once(models):
    # three prompts with one new 60-token prefix, submitted together: the first computes it,
    # the others wait a step for its blocks (engine/scheduler.py's in-batch sharing)
    d, _ = models("llama")
    engine = LLMEngine.from_model_dir(d, num_blocks=256, block_size=4)
    base = _prompts()[-1][:60]
    prompts = [base + [5, 6, 7], base + [8, 9, 10, 11, 12], base + [13, 14, 15, 16, 17, 18, 19]]
    llm = LLM.__new__(LLM)
    llm.engine, llm._counter = engine, 0
    outs = llm.generate(prompts, GREEDY)
    assert [o.num_cached_tokens for o in outs] == [0, 60, 60]
    assert engine.prompt_tokens_computed == 60 + 3 + 5 + 7
    ref = hf_greedy(d, prompts, NEW)
    assert [o.token_ids for o in outs] == [r[0] for r in ref]
    assert_no_blocks_held(engine)


def test_preemption_keeps_outputs_identical(models):
    d, ref = models("llama")
    # 8 requests need up to 7 blocks each at block size 16; 14 blocks force preemption
    engine = LLMEngine.from_model_dir(d, num_blocks=14)
    outs = run_staggered(engine, _prompts())
    assert engine.scheduler.num_preemptions > 0
    assert_matches(outs, ref)
    assert_no_blocks_held(engine)


def test_split_prefill_and_decode_instances(models):
    """Prefill in one engine, copy the blocks into blocks reserved in another, decode there."""
    d, ref = models("qwen3")
    pre = LLMEngine.from_model_dir(d, num_blocks=64)
    dec = LLMEngine.from_model_dir(d, num_blocks=64)
    outs = []
    for i, p in enumerate(_prompts()):
        first, final = split_generate(pre, dec, f"s{i}", p, GREEDY)
        assert first.finish_reason == "prefill_done" and len(first.token_ids) == 1
        outs.append(final)
    assert_matches(outs, ref)
    assert_no_blocks_held(pre)
    assert_no_blocks_held(dec)


def test_split_seeded_sampling_matches_one_engine(models):
    """A seeded, sampled request gives the same tokens whether one engine runs it or the
    prefill/decode split does (the decoder skips the draw the prefill worker made)."""
    d, _ = models("llama")
    params = SamplingParams(temperature=0.9, top_p=0.95, seed=1234, max_tokens=12, ignore_eos=True)
    prompt = _prompts()[3]
    one = LLM(d, num_blocks=64).generate([prompt], params)[0].token_ids
    pre = LLMEngine.from_model_dir(d, num_blocks=64)
    dec = LLMEngine.from_model_dir(d, num_blocks=64)
    _, final = split_generate(pre, dec, "s", prompt, params)
    assert final.token_ids == one
