"""The engine with the Triton kernels and an 8-bit KV cache (fp8_e4m3, int8) gives the greedy
tokens of the same engine with the torch references and the same KV dtype, logprobs within
1e-3: the Triton write keeps the reference's codes and scales, and Triton attention reads
them. Chunked prefill and a shared prompt prefix (prefix-cache hits on 8-bit blocks) run
through it. Where CUDA exists the engine runs there; elsewhere under the interpreter on CPU."""
import random

import pytest

import engine.kernels as K
from engine import LLMEngine, SamplingParams
from kernel_testlib import DEVICE
from tests.hf_models import make_hf_model


def _run(engine, prompts, max_tokens):
    done = {}
    for i, p in enumerate(prompts):      # one after another: the later prompts hit the prefix
        engine.add_request(f"r{i}", p, SamplingParams(temperature=0, max_tokens=max_tokens,
                                                      ignore_eos=True, logprobs=0))
        while engine.has_unfinished_requests():
            for o in engine.step():
                if o.finished:
                    done[i] = o
    return done


@pytest.mark.parametrize("kv_dtype", ["fp8_e4m3", "int8"])
def test_triton_engine_matches_torch_engine(tmp_path, monkeypatch, kv_dtype):
    d = make_hf_model("llama", tmp_path / "m")
    rng = random.Random(5)
    prefix = [rng.randrange(3, 512) for _ in range(20)]
    prompts = [[rng.randrange(3, 512) for _ in range(n)] for n in (7, 33)]
    prompts += [prefix + [rng.randrange(3, 512) for _ in range(n)] for n in (3, 9)]
    opts = dict(device=str(DEVICE), dtype="float32", num_blocks=32, block_size=8,
                kv_cache_dtype=kv_dtype, max_num_batched_tokens=24)   # chunked prefill too
    want = _run(LLMEngine.from_model_dir(d, kernel_backend="torch", **opts), prompts, 6)
    launched = []
    triton_op = K._triton_op
    monkeypatch.setattr(K, "_triton_op", lambda *a: launched.append(a[:2]) or triton_op(*a))
    engine = LLMEngine.from_model_dir(d, kernel_backend="triton", **opts)
    assert engine.runner.kv_scales is not None
    got = _run(engine, prompts, 6)
    for i in range(len(prompts)):
        assert got[i].token_ids == want[i].token_ids, f"prompt {i}"
        assert max(abs(a - b) for a, b in zip(got[i].logprobs, want[i].logprobs)) < 1e-3
    assert got[3].num_cached_tokens >= 16      # two full blocks of the shared prefix were hit
    assert engine.kv.num_held_blocks() == 0
    assert {("kv_cache", "write_kv_cache_quant"), ("rotary", "rotary_embedding"),
            ("decode_attention", "paged_decode_attention"),
            ("prefill_attention", "paged_prefill_attention")} <= set(launched)
    assert ("rotary_kv", "rotary_embedding_write_kv") not in launched
