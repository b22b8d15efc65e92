"""The CPU decode step in one C call (engine/models/decode_plan.py, engine/kernels/cpu_step.c)
and the int4 kernel it and the int4 layers run (engine/kernels/cpu_int4.c), against
references nobody here wrote: float64 torch matmuls of the dequantized weights for the
kernel, transformers on the same dequantized weights for the engine; and the plan against
the same engine stepping layer by layer (bitwise where both run the C kernels)."""
from __future__ import annotations

import logging
import random

import pytest
import torch

from engine import LLM, LLMEngine, SamplingParams
from engine.kernels import cpu as C
from engine.models.decode_plan import DecodePlan
from engine.quant.int4 import Int4Cpu, quantize_int4
from engine.quant.linear import QuantLinear
from kernel_testlib import fresh_generator, randn
from tests.hf_models import hf_greedy, make_hf_model

pytestmark = pytest.mark.skipif(not C.has_int4(), reason="the int4 C kernel needs AVX-512 here")


@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 9])
@pytest.mark.parametrize("group", [32, 128])
def test_int4_matmul_is_float32_of_the_dequantized_weight(m, group):
    """Every row count (the factored form up to 2 rows, 4x4 blocks and their tails above),
    N % 4 = 3 (the scalar rows), both group sizes: within float32 summation error of the
    float64 product of the dequantized weight; bfloat16 and strided x read as their values."""
    gen, seed = fresh_generator()
    n, k = 4 * 13 + 3, 384
    qw = quantize_int4(randn(gen, n, k), group)
    layout = Int4Cpu(qw, "cpu")
    x = randn(gen, m, k)
    want = x.double() @ qw.dequantize().double().T
    got = layout(x)
    assert got.dtype == torch.float32 and got.shape == (m, n)
    err = ((got.double() - want).abs().max() / want.abs().max()).item()
    assert err < 2e-6, (seed, err)
    wide = randn(gen, m, 2 * k, dtype=torch.bfloat16)[:, :k]           # rows 2k apart
    got = C.int4_matmul(wide, layout.qweight, layout.scale, layout.min, group)
    want = wide.double() @ qw.dequantize().double().T
    assert ((got.double() - want).abs().max() / want.abs().max()).item() < 2e-6, seed


def test_int4_layout_reads_back_exactly():
    gen, seed = fresh_generator()
    qw = quantize_int4(randn(gen, 64, 256), 32)
    back = Int4Cpu(qw, "cpu").quantized()
    assert torch.equal(back.packed, qw.packed) and torch.equal(back.scale, qw.scale), seed
    assert torch.equal(back.min, qw.min) and back.group == 32


def _prompts(n=3):
    rng = random.Random(3)
    return [[rng.randrange(3, 500) for _ in range(length)] for length in (5, 19, 11)[:n]]


def _generate(engine_kwargs, model_dir, prompts, tokens=8, plan=True, monkeypatch=None):
    """(outputs, decode steps the plan took) of one batch of greedy requests."""
    steps = []
    if not plan:
        monkeypatch.setattr(DecodePlan, "build", classmethod(lambda cls, model: None))
    llm = LLM(model_dir, **engine_kwargs)
    if plan:
        assert llm.engine.model.decode_plan is not None
        step = llm.engine.model.decode_plan.forward
        llm.engine.model.decode_plan.forward = lambda *a: steps.append(a[0].shape[0]) or step(*a)
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=tokens,
                                                ignore_eos=True, logprobs=0))
    if not plan:
        monkeypatch.undo()
    return outs, steps


@pytest.mark.parametrize("kind,quantization,overrides", [
    ("llama", "int4_g32", {}),
    ("qwen2", "int4_g128", dict(hidden_size=128, intermediate_size=256)),   # q/k/v biases
    ("qwen3", "int4_g32", {}),                                              # per-head q/k norms
    ("llama-tied", "int8_g32", {}),
    ("mistral", "none", dict(sliding_window=8)),                            # a window, float32
])
def test_plan_equals_the_layer_by_layer_step(tmp_path, monkeypatch, kind, quantization, overrides):
    """A batch of ragged prompts, greedy: the same tokens, and on quantized models the same
    logprobs to the bit (the same C kernels in the same order); on a float32 model the
    layer path's matmul is torch's (another summation order): logprobs within 1e-5. The
    plan took the decode steps: every one of 3, then 2, then 1 rows."""
    d = make_hf_model(kind, tmp_path / "m", **overrides)
    kw = dict(dtype="float32", num_blocks=64, block_size=8, quantization=quantization)
    prompts = _prompts()
    want, _ = _generate(kw, d, prompts, plan=False, monkeypatch=monkeypatch)
    got, steps = _generate(kw, d, prompts)
    assert steps and set(steps) == {3}, steps          # every decode step: the whole batch
    for w, g in zip(want, got):
        assert g.token_ids == w.token_ids
        if quantization == "none":
            assert max(abs(a - b) for a, b in zip(g.logprobs, w.logprobs)) < 1e-5
        else:
            assert g.logprobs == w.logprobs


def _dequantized_hf_copy(model, hf_dir, out):
    """The transformers model of `hf_dir` with every weight the engine's `model` quantized
    replaced by its dequantized value (q/k/v and gate/up split back out of the fused rows)."""
    import transformers as T
    hf = T.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    c = model.config
    sd = {}
    for i, layer in enumerate(model.layers):
        a, mlp, p = layer.self_attn, layer.mlp, f"model.layers.{i}."
        qkv = a.qkv_proj.dequantize()
        for name, w in zip("qkv", qkv.split([a.q_size, a.kv_size, a.kv_size])):
            sd[p + f"self_attn.{name}_proj.weight"] = w
        sd[p + "self_attn.o_proj.weight"] = a.o_proj.dequantize()
        gate, up = mlp.gate_up_proj.dequantize().chunk(2)
        sd[p + "mlp.gate_proj.weight"], sd[p + "mlp.up_proj.weight"] = gate, up
        sd[p + "mlp.down_proj.weight"] = mlp.down_proj.dequantize()
    sd["model.embed_tokens.weight"] = model.embed_tokens.quantized().dequantize()
    if not c.tie_word_embeddings:
        sd["lm_head.weight"] = model.lm_head.dequantize()
    missing = set(sd) - set(hf.state_dict())
    assert not missing, missing
    hf.load_state_dict(sd, strict=False)
    hf.save_pretrained(out)
    return out


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
def test_int4_engine_equals_transformers_on_its_dequantized_weights(tmp_path, kind):
    """int4_g32 layers on the cpu backend (prefill and the decode plan, float32 throughout)
    against transformers running the very weights they hold, dequantized: greedy tokens
    identical, logprobs within 1e-3 (the float32 engine's own tolerance, test_engine_vs_hf)."""
    d = make_hf_model(kind, tmp_path / "m")
    llm = LLM(d, dtype="float32", num_blocks=64, block_size=8, quantization="int4_g32",
              amx_weights="off")
    m = llm.engine.model
    assert isinstance(m.layers[0].self_attn.qkv_proj, QuantLinear)
    assert isinstance(m.layers[0].self_attn.qkv_proj.packed, Int4Cpu) and m.decode_plan is not None
    ref = _dequantized_hf_copy(m, d, tmp_path / "deq")
    prompts = _prompts()
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True,
                                                logprobs=0))
    for o, (toks, lps) in zip(outs, hf_greedy(ref, prompts, 10)):
        assert o.token_ids == toks
        assert max(abs(a - b) for a, b in zip(o.logprobs, lps)) < 1e-3


def test_no_plan_where_the_c_step_does_not_apply(tmp_path, caplog):
    """MoE layers, int8 per channel, an 8-bit cache: no plan, the reason logged, and the
    engine steps layer by layer (and still answers)."""
    caplog.set_level(logging.INFO, logger="engine.models.decode_plan")
    moe = LLMEngine.from_model_dir(make_hf_model("mixtral", tmp_path / "moe"), dtype="float32",
                                   num_blocks=32, block_size=8)
    assert moe.model.decode_plan is None and "SparseMoeBlock" in caplog.text
    d = make_hf_model("llama", tmp_path / "m")
    int8 = LLMEngine.from_model_dir(d, dtype="float32", num_blocks=32, block_size=8, quantization="int8")
    assert int8.model.decode_plan is None and "Int8Packed weights" in caplog.text
    kv8 = LLMEngine.from_model_dir(d, dtype="float32", num_blocks=32, block_size=8, kv_cache_dtype="int8")
    assert kv8.model.backend == "auto" and kv8.model.decode_plan is None
    out = LLM.__new__(LLM)
    out.engine, out._counter = int8, 0
    assert len(out.generate([[5, 6, 7]], SamplingParams(max_tokens=3, ignore_eos=True))[0].token_ids) == 3


@pytest.mark.parametrize("m", [1, 4, 7, 13])
def test_bf16_matmul_is_float32_of_the_rounded_values(m):
    """cpu_bf16.c: x rounded to bfloat16 (as torch rounds it), times a bfloat16 weight,
    summed in float32: within float32 summation error of the float64 product of those
    values (N % 4 = 1 and K % 32 = 8: the scalar rows and the masked tail)."""
    gen, seed = fresh_generator()
    x, w = randn(gen, m, 328), randn(gen, 4 * 9 + 1, 328, dtype=torch.bfloat16)
    got = C.bf16_matmul(x, w)
    want = x.bfloat16().double() @ w.double().T
    assert got.dtype == torch.float32
    assert ((got.double() - want).abs().max() / want.abs().max()).item() < 2e-6, seed


needs_tiles = pytest.mark.skipif(not C.has_bf16_tiles(), reason="this CPU (or its kernel) "
                                 "gives no AMX bfloat16 tiles")


@needs_tiles
@pytest.mark.parametrize("m,n,k", [(8, 37, 96), (16, 64, 32), (17, 80, 576), (33, 48, 64),
                                   (64, 200, 1536), (100, 96, 128)])
def test_bf16_tiles_are_float32_of_the_rounded_values(m, n, k):
    """cpu_bf16.c on the AMX tiles (K % 32 == 0, M >= pd_bf16_tile_rows): the same product as
    the dot-product kernel, to float32 summation error of the float64 one; M not a multiple
    of 16 (the padded B tile), N not a multiple of 32 or 16 (a lone A tile, then the dot
    products for the last columns)."""
    gen, seed = fresh_generator()
    x, w = randn(gen, m, k), randn(gen, n, k, dtype=torch.bfloat16)
    assert C.bf16_tile_rows() <= m
    got = C.bf16_matmul(x, w)
    want = x.bfloat16().double() @ w.double().T
    assert ((got.double() - want).abs().max() / want.abs().max()).item() < 2e-6, seed
    before = C.bf16_tile_rows()
    try:
        C.bf16_tile_rows(0)                                # the dot products
        dots = C.bf16_matmul(x, w)
    finally:
        C.bf16_tile_rows(before)
    assert ((got - dots).abs().max() / want.abs().max()).item() < 2e-6, seed


@needs_tiles
def test_a_plan_step_on_the_tiles_equals_the_dot_products(tmp_path, monkeypatch):
    """The decode plan's batches of 8+ rows multiply by the bfloat16 copies on the tiles:
    greedy tokens equal those of the same plan on the dot-product kernel (pd_bf16_tile_rows
    0) up to a near-tie, and the steps did run on the plan."""
    from test_amx import _same_until_a_near_tie
    d = make_hf_model("llama", tmp_path / "m", hidden_size=128, intermediate_size=256)
    kw = dict(dtype="float32", num_blocks=128, block_size=8, quantization="int4_g32",
              amx_weights="bf16", amx_min_rows=8)
    prompts = (_prompts() * 4)[:12]
    before = C.bf16_tile_rows()
    try:
        C.bf16_tile_rows(0)
        want, _ = _generate(kw, d, prompts, monkeypatch=monkeypatch)
        C.bf16_tile_rows(8)
        got, steps = _generate(kw, d, prompts, monkeypatch=monkeypatch)
    finally:
        C.bf16_tile_rows(before)
    assert max(steps) >= 8, steps                          # batches on the tiles
    assert not _same_until_a_near_tie(got, want)


def test_batches_of_amx_rows_take_the_bfloat16_copies(tmp_path, monkeypatch):
    """With bfloat16 copies for batches of >= amx_min_rows rows (engine/quant/amx.py) the plan
    multiplies such batches by them (cpu_bf16.c, where the CPU has bfloat16 dot products;
    else it leaves them to the layer path: `max_rows`), and smaller ones by the int4 codes;
    the copies dropped, the plan is rebuilt without them. Tokens equal the layer path's
    (oneDNN on the same copies) up to a near-tie, as tests/kernels/test_amx.py compares."""
    from engine.quant import amx
    from test_amx import _same_until_a_near_tie
    d = make_hf_model("llama", tmp_path / "m", hidden_size=128, intermediate_size=256)
    kw = dict(dtype="float32", num_blocks=64, block_size=8, quantization="int4_g32",
              amx_weights="bf16", amx_min_rows=3)
    prompts = _prompts()
    want, _ = _generate(kw, d, prompts, plan=False, monkeypatch=monkeypatch)
    llm = LLM(d, **kw)
    plan = llm.engine.model.decode_plan
    assert llm.engine.amx.on and plan._layers[0].qkv.dense_rows == (3 if C.has_bf16() else 0)
    assert plan.max_rows == (0 if C.has_bf16() else 3)
    got = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=0))
    assert not _same_until_a_near_tie(got, want)
    amx.detach(llm.engine.model)
    plan = llm.engine.model.decode_plan
    assert plan.max_rows == 0 and not plan._layers[0].qkv.dense


def test_default_model_plan_equals_the_layer_by_layer_step(monkeypatch, default_model_dir):
    """SmolLM2-135M as stored (Q4_1 decoder linears, Q8_0 table and head; the GGUF that
    pdserve up caches): the same greedy tokens and logprobs, bit for bit, for a batch."""
    d = default_model_dir
    kw = dict(num_blocks=64, amx_weights="off")
    prompts = [[1, 504, 3458, 282, 4649, 314], [1, 42, 9112, 1489], [1, 1552, 2143, 253, 655]]
    want, _ = _generate(kw, d, prompts, tokens=6, plan=False, monkeypatch=monkeypatch)
    got, steps = _generate(kw, d, prompts, tokens=6)
    assert steps
    for w, g in zip(want, got):
        assert g.token_ids == w.token_ids and g.logprobs == w.logprobs


@pytest.mark.parametrize("threads", [2, 5])
def test_helper_threads_change_no_bit(tmp_path, threads):
    """The step shared with helper threads (cpu_pool.c) gives the one-thread step's tokens and
    logprobs to the bit, batches of every size the engine forms, bfloat16 copies on; five
    threads on this machine's cores also exercise the caller taking back chunks from
    helpers the OS has not run."""
    d = make_hf_model("llama", tmp_path / "m", hidden_size=128, intermediate_size=256)
    kw = dict(dtype="float32", num_blocks=128, block_size=8, quantization="int4_g32",
              amx_weights="bf16", amx_min_rows=3)
    rng = random.Random(5)
    prompts = [[rng.randrange(3, 500) for _ in range(n)] for n in (3, 17, 9, 30, 5, 12)]
    sp = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=0)
    one = LLM(d, step_threads=1, **kw)
    many = LLM(d, step_threads=threads, **kw)
    assert one.engine.model.decode_plan.threads == 1 and many.engine.model.decode_plan.threads == threads
    for batch in (prompts[:1], prompts[:4], prompts):
        for a, b in zip(one.generate(batch, sp), many.generate(batch, sp)):
            assert a.token_ids == b.token_ids and a.logprobs == b.logprobs
