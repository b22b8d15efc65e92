"""The engine on CPU with the C kernels (backend auto, which a float32 model with a float32 KV
cache resolves to "cpu") gives the greedy tokens of the same engine on the torch references,
logprobs within 1e-3 (quantized: 5e-3, their heads differ, below), for float and int8
weights (int8 and the 8-bit head on cpu.c's own matmuls) (whose layers then take bfloat16 from
the C kernels directly), with chunked prefill, a batch and prefix-cache hits; and where the
kernels do not apply the engine stays on the references. (int4 on the cpu backend computes in
float32 where torch's int4 kernel rounds to bfloat16: tests/kernels/test_decode_plan.py
compares it with transformers on the same dequantized weights instead.)"""
import random

import pytest

from engine import LLMEngine, SamplingParams
from engine.kernels import cpu as C
from engine.models.decode_plan import DecodePlan
from tests.hf_models import make_hf_model

pytestmark = pytest.mark.skipif(C.library() is None, reason="no C compiler: the CPU kernels are not built")


def _run(engine, prompts, max_tokens):
    """The first three prompts as one batch, then the two sharing a prefix one after the
    other (the second hits the first's cached blocks)."""
    done = {}
    for wave in ([0, 1, 2], [3], [4]):
        for i in wave:
            engine.add_request(f"r{i}", prompts[i], SamplingParams(
                temperature=0, max_tokens=max_tokens, ignore_eos=True, logprobs=0))
        while engine.has_unfinished_requests():
            for o in engine.step():
                if o.finished:
                    done[int(o.request_id[1:])] = o
    return done


def _prompts():
    rng = random.Random(7)
    prefix = [rng.randrange(3, 512) for _ in range(20)]
    return ([[rng.randrange(3, 512) for _ in range(n)] for n in (7, 33, 1)]
            + [prefix + [rng.randrange(3, 512) for _ in range(n)] for n in (3, 9)])


@pytest.mark.parametrize("kind,quantization", [("llama", "none"), ("qwen3", "none"),
                                               ("qwen2", "int8"), ("mistral", "none")])
def test_cpu_kernels_engine_matches_torch_engine(tmp_path, monkeypatch, kind, quantization):
    d = make_hf_model(kind, tmp_path / "m")
    prompts = _prompts()
    opts = dict(dtype="float32", num_blocks=48, block_size=8, max_num_batched_tokens=24,
                quantization=quantization)                       # 24: chunked prefill
    want = _run(LLMEngine.from_model_dir(d, kernel_backend="torch", **opts), prompts, 6)
    calls = []
    for name in ("rms_norm", "rope_write_kv", "rope_decode_attention", "silu_and_mul", "int8_matmul"):
        fn = getattr(C, name)
        monkeypatch.setattr(C, name, lambda *a, _fn=fn, _n=name, **kw: calls.append(_n) or _fn(*a, **kw))
    step = DecodePlan.forward
    monkeypatch.setattr(DecodePlan, "forward", lambda *a, **kw: calls.append("decode_step") or step(*a, **kw))
    engine = LLMEngine.from_model_dir(d, **opts)
    assert engine.model.backend == "cpu" and engine.model.layers[0].self_attn.backend == "cpu"
    got = _run(engine, prompts, 6)
    # quantized: the references' 8-bit head (torch's int4 kernel on the nibble split) rounds
    # every logit but the near-top ones to bfloat16, which moves the log-sum-exp; the C
    # kernels' head is float32 throughout
    tol = 1e-3 if quantization == "none" else 5e-3
    for i in range(len(prompts)):
        assert got[i].token_ids == want[i].token_ids, f"prompt {i}"
        assert max(abs(a - b) for a, b in zip(got[i].logprobs, want[i].logprobs)) < tol
    # prefill: rotary + cache write; decode: the whole step in one C call (decode_plan.py),
    # or where the plan does not take the model (int8 per channel) the fused rotary, cache
    # write and attention layer by layer
    assert {"rms_norm", "rope_write_kv", "silu_and_mul"} <= set(calls)
    planned = quantization != "int8"
    assert ("decode_step" in calls) == planned and ("rope_decode_attention" in calls) != planned
    assert ("int8_matmul" in calls) == (quantization == "int8")
    assert got[4].num_cached_tokens >= 16       # two full blocks of the shared prefix were hit
    assert engine.kv.num_held_blocks() == 0


def test_where_the_kernels_do_not_apply_the_engine_stays_on_the_references(tmp_path, monkeypatch):
    d = make_hf_model("llama", tmp_path / "m")
    opts = dict(dtype="float32", num_blocks=16, block_size=8)
    assert LLMEngine.from_model_dir(d, kv_cache_dtype="int8", **opts).model.backend == "auto"
    assert LLMEngine.from_model_dir(d, **{**opts, "dtype": "bfloat16"}).model.backend == "auto"
    with pytest.raises(ValueError, match="float32 KV cache"):
        LLMEngine.from_model_dir(d, kernel_backend="cpu", kv_cache_dtype="int8", **opts)
    monkeypatch.setattr(C, "_lib", None)          # no compiler: auto keeps the references ...
    assert LLMEngine.from_model_dir(d, **opts).model.backend == "auto"
    with pytest.raises(ValueError, match="C compiler"):  # ... and asking for them says why
        LLMEngine.from_model_dir(d, kernel_backend="cpu", **opts)
