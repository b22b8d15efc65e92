"""Hugging Face checkpoints with a `quantization_config` (engine/quant/checkpoint.py), written
by the tests from a tiny float model (tests/prequant_files.py): fp8 per tensor and per channel
(both scale names), compressed-tensors pack-quantized int4 (g128 fp16 scales, g32 bf16 ones)
and float-quantized fp8. The layers hold exactly the weights the layout defines, outputs stay
within the quantization error of the float model, and transformers loading the same checkpoint
(dequantizing it on CPU) agrees."""
from __future__ import annotations

import json

import pytest
import torch
from torch import nn

from engine import LLM, SamplingParams
from engine.quant.linear import QuantLinear
from tests.gguf_files import tiny_hf_dir
from tests.prequant_files import stored_definition, write_quantized

SCHEMES = {  # name -> (write_quantized kwargs, the method the layers hold)
    # q/k/v's (gate/up's) per-tensor scales differ: per channel once fused
    "fp8_tensor": (dict(scheme="fp8_tensor"), "fp8"),
    "fp8_channel_inv": (dict(scheme="fp8_channel", scale_name="weight_scale_inv"), "fp8"),
    "ct_int4_g128": (dict(scheme="ct_int4", group=128), "int4_g128"),
    "ct_int4_g32_bf16": (dict(scheme="ct_int4", group=32, scale_dtype=torch.bfloat16), "int4_g32"),
    "ct_fp8_channel": (dict(scheme="ct_fp8"), "fp8"),
}
PROMPTS = [[1, 17, 300, 42, 9], [1, 500, 501, 7], [1, 64, 65, 66, 67, 900]]
NEW = 10
PARTS = {"self_attn.qkv_proj": "qkv", "mlp.gate_up_proj": ("gate", "up")}


@pytest.fixture(scope="module")
def src(tmp_path_factory):
    return tiny_hf_dir("llama", tmp_path_factory.mktemp("float"), hidden_size=128,
                       intermediate_size=256, initializer_range=0.2)


@pytest.fixture(scope="module")
def ckpt(src, tmp_path_factory):
    made = {}

    def get(name):
        if name not in made:
            kw, _ = SCHEMES[name]
            made[name] = write_quantized(src, tmp_path_factory.mktemp("q") / name, **kw)
        return made[name]
    return get


@pytest.mark.parametrize("name", list(SCHEMES))
def test_layers_hold_the_weights_the_layout_defines(ckpt, name):
    d = ckpt(name)
    model = LLM(d, num_blocks=16, block_size=8).engine.model
    for i, layer in enumerate(model.layers):
        for path, parts in (("self_attn.qkv_proj", [f"self_attn.{p}_proj" for p in "qkv"]),
                            ("self_attn.o_proj", ["self_attn.o_proj"]),
                            ("mlp.gate_up_proj", ["mlp.gate_proj", "mlp.up_proj"]),
                            ("mlp.down_proj", ["mlp.down_proj"])):
            lin = layer.get_submodule(path)
            method = "fp8_tensor" if name == "fp8_tensor" and len(parts) == 1 else SCHEMES[name][1]
            assert isinstance(lin, QuantLinear) and lin.method == method
            want = torch.cat([stored_definition(d, f"model.layers.{i}.{p}") for p in parts])
            assert torch.equal(lin.dequantize(), want), path
    # the head and the embedding are float in these checkpoints and stay so
    assert type(model.lm_head) is nn.Linear and type(model.embed_tokens) is nn.Embedding


def _transformers(d, dequantized_from=None, dtype=torch.float32):
    """transformers on `d`; with `dequantized_from`: the float model with its linear weights
    replaced by that checkpoint's definition (what an exact dequantization computes)."""
    import transformers as T
    m = T.AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
    if dequantized_from is not None:
        with torch.no_grad():
            for name, p in m.named_parameters():
                if name.endswith("_proj.weight"):
                    p.copy_(stored_definition(dequantized_from, name.removesuffix(".weight")))
    return m.to(dtype)


def _logprobs(model, seq, plen):
    with torch.no_grad():
        lp = torch.log_softmax(model(torch.tensor([seq])).logits[0, plen - 1:-1].float(), -1)
    return lp[torch.arange(len(seq) - plen), seq[plen:]]


def _pdserve_logprobs(llm, seq, plen):
    out = llm.generate([seq], SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=1))[0]
    return torch.tensor([out.prompt_logprobs[j][0] for j in range(plen, len(seq))])


@pytest.mark.parametrize("name", list(SCHEMES))
def test_outputs_within_the_quantization_error_of_the_float_model(src, ckpt, name):
    """Along the float model's greedy continuations (teacher forced): pdserve's logprobs differ
    from the float model's by at most what the quantization itself moves them (transformers in
    float32 on the exactly dequantized weights) plus the bf16 compute budget (twice what running
    that reference in bfloat16 moves them), and from that dequantized reference by at most
    the budget."""
    d = ckpt(name)
    float_m, deq = _transformers(src), _transformers(src, d)
    deq16 = _transformers(src, d, torch.bfloat16)
    llm = LLM(d, num_blocks=64, block_size=8)
    rows = []
    for p in PROMPTS:
        seq = float_m.generate(torch.tensor([p]), max_new_tokens=NEW, do_sample=False,
                               eos_token_id=None, pad_token_id=0)[0].tolist()
        rows.append([_logprobs(float_m, seq, len(p)), _logprobs(deq, seq, len(p)),
                     _logprobs(deq16, seq, len(p)), _pdserve_logprobs(llm, seq, len(p))])
    quant_err = max((r[1] - r[0]).abs().max().item() for r in rows)
    budget = 2 * max((r[2] - r[1]).abs().max().item() for r in rows)
    for flt, ref, _, pd in rows:
        assert (pd - ref).abs().max().item() <= budget
        assert (pd - flt).abs().max().item() <= quant_err + budget
    print(f"{name}: quantization moves logprobs by up to {quant_err:.3f}, bf16 budget {budget:.3f}")


@pytest.mark.parametrize("name", ["fp8_channel_inv", "ct_int4_g128", "ct_fp8_channel"])
def test_transformers_loads_the_same_checkpoint_the_same_way(ckpt, name):
    """transformers reads fp8 scales named `weight_scale_inv` only (a `weight_scale` checkpoint,
    vLLM's name, loads with its scales left out: not compared), and compressed-tensors through
    that package, both dequantized on CPU: its weights equal pdserve's (int4: to the rounding of
    its float16 dequantization)."""
    import transformers as T
    d = ckpt(name)
    kw = {}
    if name.startswith("ct_"):
        pytest.importorskip("compressed_tensors")
        kw["quantization_config"] = T.CompressedTensorsConfig(dequantize=True)
    hf = T.AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32, **kw).eval()
    model = LLM(d, num_blocks=16, block_size=8).engine.model
    for i, layer in enumerate(model.layers):
        q, k, v = layer.self_attn.qkv_proj.dequantize().split([128, 64, 64])
        for ours, theirs in ((q, "q_proj"), (k, "k_proj"), (v, "v_proj")):
            w = getattr(hf.model.layers[i].self_attn, theirs).weight.float()
            torch.testing.assert_close(w, ours, atol=1e-3 if "int4" in name else 0, rtol=0)


def test_unsupported_layouts_are_named(src, tmp_path):
    d = write_quantized(src, tmp_path / "m", "fp8_channel")
    c = json.loads((d / "config.json").read_text())
    for qc, match in (({"quant_method": "fp8", "weight_block_size": [128, 128]}, "block-wise fp8"),
                      ({"quant_method": "awq", "bits": 4}, "unsupported quantization_config quant_method 'awq'"),
                      ({"quant_method": "compressed-tensors", "config_groups": {"g": {"format": "pack-quantized",
                        "weights": {"num_bits": 4, "type": "int", "strategy": "group", "group_size": 128,
                                    "symmetric": False}}}}, "group 'g'")):
        (d / "config.json").write_text(json.dumps(dict(c, quantization_config=qc)))
        with pytest.raises(ValueError, match=match):
            LLM(d, num_blocks=8)


def test_quantization_must_agree_with_the_checkpoint(ckpt):
    d = ckpt("ct_int4_g128")
    with pytest.raises(ValueError, match="stored pre-quantized as int4_g128; quantization 'int4_g32'"):
        LLM(d, num_blocks=8, quantization="int4_g32")
    none = LLM(d, num_blocks=8, quantization="none").engine.model
    assert type(none.layers[0].mlp.down_proj) is nn.Linear
    assert torch.equal(none.layers[0].mlp.down_proj.weight, stored_definition(d, "model.layers.0.mlp.down_proj"))
