"""The engine with the Triton kernels selected still produces transformers' greedy tokens,
with logprobs within 1e-3; an engine with another backend in the same process does not change
that (the backend belongs to each engine's model). Where CUDA exists the engine runs there
(fp32, decode from CUDA graphs); elsewhere the Triton interpreter runs it on CPU."""
import random
import sys

import pytest

import engine.kernels as K
from engine import LLMEngine, SamplingParams
from kernel_testlib import DEVICE
from tests.hf_models import hf_greedy, make_hf_model


def _run(engine, prompts, max_tokens):
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, SamplingParams(temperature=0, max_tokens=max_tokens,
                                                      ignore_eos=True, logprobs=0))
    done = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.finished:
                done[int(o.request_id[1:])] = o
    return done


def test_greedy_identical_to_transformers_with_triton_kernels(tmp_path, monkeypatch):
    d = make_hf_model("llama", tmp_path / "m")
    rng = random.Random(3)
    prompts = [[rng.randrange(3, 512) for _ in range(n)] for n in (5, 19, 33)]
    ref = hf_greedy(d, prompts, 6)
    launched = []          # recorded from the start: on CUDA, decode kernels launch at capture
    triton_op = K._triton_op
    monkeypatch.setattr(K, "_triton_op", lambda *a: launched.append(a[0]) or triton_op(*a))
    engine = LLMEngine.from_model_dir(d, device=str(DEVICE), dtype="float32", num_blocks=32,
                                      kernel_backend="triton",
                                      max_num_batched_tokens=24)   # chunked prefill too
    # a second engine, built after the first, with another backend: it must not switch the first
    other = LLMEngine.from_model_dir(d, device=str(DEVICE), dtype="float32", num_blocks=32,
                                     kernel_backend="torch")
    assert engine.model.backend == "triton" and other.model.backend == "torch"
    assert other.runner.graphs is None          # the torch references sync: no graphs for them
    done = _run(engine, prompts, 6)
    for i, (toks, lps) in enumerate(ref):
        assert done[i].token_ids == toks, f"prompt {i}"
        assert max(abs(a - b) for a, b in zip(done[i].logprobs, lps)) < 1e-3
    assert engine.kv.num_held_blocks() == 0
    # the Triton modules are imported on first use only: they really ran, for this engine
    assert set(launched) == {"decode_attention", "prefill_attention", "rotary_kv", "norm",
                             "activation"}
    for mod in set(launched):
        assert f"engine.kernels.{mod}" in sys.modules
    monkeypatch.setattr(K, "_triton_op", lambda *a: pytest.fail("torch engine launched Triton"))
    assert _run(other, prompts[:1], 2)[0].token_ids == ref[0][0][:2]
