"""GGUF Q8_0 / Q4_0 / Q4_1 tensors kept quantized at load (engine/quant/checkpoint.py): the
layers hold the file's codes and scales exactly (checked against the `gguf` package's own
dequantization and the block bytes), and the engine agrees with transformers loading the same
file (which dequantizes it) within the bf16 compute of torch's CPU kernels. The files are
written by the tests (tests/gguf_files.py) from random models."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from engine import LLM, SamplingParams
from engine.gguf import open_gguf
from engine.quant.int8_g32 import G32Int4Pack, G32Plain
from engine.quant.linear import QuantEmbedding, QuantLinear
from tests.gguf_files import tiny_hf_dir, write_gguf

PROMPTS = ["The quick brown fox", "Prefill computes the prompt; decode", "a b c d e f",
           "Héllo wörld 12345"]
NEW = 12
PRE = {"llama": "gpt2", "llama-tied": "gpt2", "qwen2": "qwen2"}
METHOD = {"Q8_0": "int8_g32", "Q4_0": "int4_g32", "Q4_1": "int4_g32"}
BLOCK = {"Q8_0": 34, "Q4_0": 18, "Q4_1": 20}
FUSED = {"self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
         "self_attn.o_proj": ("self_attn.o_proj",),
         "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"), "mlp.down_proj": ("mlp.down_proj",)}


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    cache, hf = {}, {}

    def get(kind, qtype, types=None):
        # initializer_range 0.2: peakier logits than the default's, fewer near-ties
        key = (kind, qtype, tuple(sorted((types or {}).items())))
        if key not in cache:
            if kind not in hf:
                hf[kind] = tiny_hf_dir(kind, tmp_path_factory.mktemp(f"hf-{kind}"), initializer_range=0.2)
            d = tmp_path_factory.mktemp(f"{kind}-{qtype}")
            write_gguf(hf[kind], d / "m.gguf", qtype, pre=PRE[kind], types=types)
            cache[key] = d
        return cache[key]
    return get


def _block_f16(raw, offset: int) -> torch.Tensor:
    """The float16 at `offset` of every block of a quantized GGUF tensor: [N, K/32]."""
    n, k = raw.shape
    b = np.ascontiguousarray(raw.data).reshape(n, k // 32, BLOCK[raw.type_name])
    return torch.from_numpy(b[..., offset:offset + 2].copy().view(np.float16)[..., 0])


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_0", "Q4_1"])
def test_layers_hold_the_stored_codes_and_scales(files, qtype):
    d = files("llama", qtype)
    raw = {t.name: t for t in open_gguf(d / "m.gguf").raw_tensors()}
    model = LLM(d / "m.gguf", num_blocks=16, block_size=8).engine.model
    for i, layer in enumerate(model.layers):
        for fused, parts in FUSED.items():
            lin = layer.get_submodule(fused)
            assert isinstance(lin, QuantLinear) and lin.method == METHOD[qtype]
            ts = [raw[f"model.layers.{i}.{p}.weight"] for p in parts]
            # the weight the layer stands for is the file's, bit for bit
            want = torch.cat([torch.from_numpy(t.dequantize()) for t in ts])
            assert torch.equal(lin.dequantize(), want), fused
            # and the scales (and Q4_1's mins) are the blocks' float16s, unrounded
            held = lin.quantized()
            assert held.scale.dtype == torch.float16
            assert torch.equal(held.scale, torch.cat([_block_f16(t, 0) for t in ts]))
            if qtype == "Q4_1":
                assert torch.equal(held.min, torch.cat([_block_f16(t, 2) for t in ts]))
    head = raw["lm_head.weight"]
    assert isinstance(model.lm_head, QuantLinear)
    assert torch.equal(model.lm_head.dequantize(), torch.from_numpy(head.dequantize()))
    emb = raw["model.embed_tokens.weight"]
    if qtype == "Q8_0":         # an int8 table stays quantized; 4-bit ones are dequantized
        assert isinstance(model.embed_tokens, QuantEmbedding)
        ids = torch.arange(emb.shape[0])
        assert torch.equal(model.embed_tokens(ids), torch.from_numpy(emb.dequantize()))
    else:
        assert torch.equal(model.embed_tokens.weight, torch.from_numpy(emb.dequantize()))


def _hf(d, dtype=torch.float32):
    import transformers as T
    return T.AutoModelForCausalLM.from_pretrained(d, gguf_file="m.gguf", dtype=dtype).eval()


@pytest.mark.parametrize("kind,qtype", [("llama", "Q8_0"), ("llama", "Q4_0"), ("llama", "Q4_1"),
                                        ("qwen2", "Q4_1"), ("llama-tied", "Q8_0")])
def test_agrees_with_transformers_on_the_same_file(files, kind, qtype):
    """transformers dequantizes the file and computes in float32; torch's CPU kernels compute in
    bfloat16. The budget: twice the largest logprob change that running transformers itself in
    bfloat16 makes on the same tokens. Along transformers' greedy continuation (teacher forced,
    through prompt logprobs): every token's logprob within the budget, pdserve's argmax equal
    to transformers' wherever its top-two margin exceeds the budget (at least a third of the
    positions); free-running greedy output identical up to the first closer call (random models
    have many)."""
    d = files(kind, qtype)
    ref32, ref16 = _hf(d), _hf(d, torch.bfloat16)
    llm = LLM(d / "m.gguf", num_blocks=64, block_size=8)
    assert isinstance(llm.engine.model.layers[0].mlp.down_proj, QuantLinear)
    runs = []
    for text in PROMPTS:
        p = llm.tokenizer.encode(text)
        seq = ref32.generate(torch.tensor([p]), max_new_tokens=NEW, do_sample=False,
                             eos_token_id=None, pad_token_id=0)[0].tolist()
        with torch.no_grad():
            ref, bf16 = (torch.log_softmax(m(torch.tensor([seq])).logits[0, len(p) - 1:-1].float(), -1)
                         for m in (ref32, ref16))
        runs.append((p, seq, ref, bf16))
    budget = 2 * max((b - r)[torch.arange(NEW), seq[len(p):]].abs().max().item()
                     for p, seq, r, b in runs)
    compared = checked = 0
    for p, seq, ref, _ in runs:
        out = llm.generate([seq], SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=1))[0]
        first_tie = NEW
        for j, t in enumerate(seq[len(p):]):
            lp, top = out.prompt_logprobs[len(p) + j]
            assert abs(lp - ref[j, t].item()) < budget, (p, j, budget)
            two = ref[j].topk(2).values
            if two[0] - two[1] > budget:
                assert top[0][0] == t, (p, j)
                checked += 1
            else:
                first_tie = min(first_tie, j)
        free = llm.generate([p], SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True))[0]
        assert free.token_ids[:first_tie] == seq[len(p):len(p) + first_tie], p
        compared += first_tie
    print(f"{kind} {qtype}: logprob budget {budget:.3f}, argmax checked at {checked} of "
          f"{len(runs) * NEW}, free-running tokens compared {compared}")
    assert checked >= len(runs) * NEW // 3       # measured 18-34 of 48


def test_quantization_must_agree_with_the_file(files):
    d = files("llama", "Q4_1")
    with pytest.raises(ValueError, match="stored pre-quantized as int4_g32; quantization 'int8' disagrees"):
        LLM(d / "m.gguf", num_blocks=8, quantization="int8")
    same = LLM(d / "m.gguf", num_blocks=8, quantization="int4_g32").engine.model
    assert isinstance(same.layers[0].self_attn.qkv_proj, QuantLinear)
    # 'none': every tensor dequantized (exactly: what transformers computes with)
    none = LLM(d / "m.gguf", num_blocks=8, quantization="none").engine.model
    assert not any(isinstance(m, (QuantLinear, QuantEmbedding)) for m in none.modules())
    raw = {t.name: t for t in open_gguf(d / "m.gguf").raw_tensors()}
    assert torch.equal(none.layers[1].mlp.down_proj.weight,
                       torch.from_numpy(raw["model.layers.1.mlp.down_proj.weight"].dequantize()))


def test_fused_parts_of_different_types_are_dequantized(files):
    """llama.cpp mixes types (Q4_K_M keeps V in 6 bits): q/k Q4_1 with v Q8_0 cannot share one
    layout, so qkv is float; the other layers stay quantized."""
    d = files("llama", "Q4_1", {"blk.0.attn_v.weight": "Q8_0"})
    raw = {t.name: t for t in open_gguf(d / "m.gguf").raw_tensors()}
    model = LLM(d / "m.gguf", num_blocks=8).engine.model
    qkv = model.layers[0].self_attn.qkv_proj
    assert type(qkv) is nn.Linear
    want = torch.cat([torch.from_numpy(raw[f"model.layers.0.self_attn.{p}_proj.weight"].dequantize())
                      for p in "qkv"])
    assert torch.equal(qkv.weight, want)
    assert isinstance(model.layers[1].self_attn.qkv_proj, QuantLinear)
    assert isinstance(model.layers[0].mlp.gate_up_proj, QuantLinear)


@pytest.mark.parametrize("backend", ["torch", "auto"])
def test_tied_q8_0_table_is_one_copy_for_lookups_and_logits(files, backend):
    """One copy of the table for lookups and logits: in torch's CPU int4 layout on the torch
    references (top logits recomputed exactly), as plain codes and float32 scales on the C
    kernels (auto on CPU, where they build: float32 logits throughout)."""
    from engine.kernels import cpu
    d = files("llama-tied", "Q8_0")
    raw = {t.name: t for t in open_gguf(d / "m.gguf").raw_tensors()}
    model = LLM(d / "m.gguf", num_blocks=8, kernel_backend=backend).engine.model
    emb, head = model.embed_tokens, model.lm_head
    assert isinstance(emb, QuantEmbedding) and head.packed is emb.packed
    on_c = model.backend == "cpu"
    assert on_c == (backend == "auto" and cpu.library() is not None)
    if on_c:
        assert isinstance(emb.packed, G32Plain)      # float32 logits from the codes
    else:                                            # torch's CPU int4 layout, top logits exact
        assert isinstance(emb.packed, G32Int4Pack) and emb.packed.rows_ok and head.head
    want = torch.from_numpy(raw["model.embed_tokens.weight"].dequantize())
    assert torch.equal(head.dequantize(), want)
    assert torch.equal(emb(torch.arange(want.shape[0])), want)
    h = torch.randn(3, want.shape[1])
    ref = h @ want.T
    if on_c:
        torch.testing.assert_close(head(h), ref, atol=1e-5 * ref.abs().max().item(), rtol=1e-5)
    torch.testing.assert_close(head(h), ref, atol=0.01 * ref.abs().max().item(), rtol=0.01)
