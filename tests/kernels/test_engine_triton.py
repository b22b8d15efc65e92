"""The engine with the Triton kernels selected (run by the interpreter on CPU) still produces
transformers' greedy tokens, with logprobs within 1e-3."""
import random
import sys

from engine import LLMEngine, SamplingParams, kernels
from tests.hf_models import hf_greedy, make_hf_model


def test_greedy_identical_to_transformers_with_triton_kernels(tmp_path):
    d = make_hf_model("llama", tmp_path / "m")
    rng = random.Random(3)
    prompts = [[rng.randrange(3, 512) for _ in range(n)] for n in (5, 19, 33)]
    ref = hf_greedy(d, prompts, 6)
    try:
        engine = LLMEngine.from_model_dir(d, num_blocks=32, kernel_backend="triton",
                                          max_num_batched_tokens=24)   # chunked prefill too
        assert kernels.get_backend() == "triton"
        for i, p in enumerate(prompts):
            engine.add_request(f"r{i}", p, SamplingParams(temperature=0, max_tokens=6,
                                                          ignore_eos=True, logprobs=0))
        done = {}
        while engine.has_unfinished_requests():
            for o in engine.step():
                if o.finished:
                    done[int(o.request_id[1:])] = o
    finally:
        kernels.set_backend("auto")
    for i, (toks, lps) in enumerate(ref):
        assert done[i].token_ids == toks, f"prompt {i}"
        assert max(abs(a - b) for a, b in zip(done[i].logprobs, lps)) < 1e-3
    assert engine.kv.num_held_blocks() == 0
    # the Triton modules are imported on first use only: they really ran
    for mod in ("decode_attention", "prefill_attention", "kv_cache", "norm", "rotary", "activation"):
        assert f"engine.kernels.{mod}" in sys.modules
