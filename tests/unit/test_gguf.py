"""GGUF loading (engine/gguf.py) against transformers loading the same file
(`from_pretrained(dir, gguf_file=...)`, which dequantizes and un-permutes on its own): greedy
output token for token, the rebuilt tokenizer id for id, the chat template character for
character. The files are written by the tests (tests/gguf_files.py) from random models."""
from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch

from engine import LLM, SamplingParams
from engine.config import ModelConfig
from engine.gguf import open_gguf
from engine.tiny_model import CHAT_TEMPLATE
from engine.tokenizer import Tokenizer
from tests.gguf_files import tiny_hf_dir, write_gguf

MIXED = "Héllo wörld, ça va? 東京は晴れ 🙂🚀 naïve café — “quotes” <s> tab\tnew\nline  x"
PROMPTS = ["The quick brown fox", "Prefill computes the prompt; decode"]
NEW = 12
PRE = {"llama": "gpt2", "qwen2": "qwen2"}


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """(kind, qtype) -> directory holding one GGUF file m.gguf, built on first use."""
    cache, hf = {}, {}

    def get(kind, qtype="F32", **kw):
        key = (kind, qtype, tuple(sorted(kw.items())))
        if key not in cache:
            if kind not in hf:
                hf[kind] = tiny_hf_dir(kind, tmp_path_factory.mktemp(f"hf-{kind}"))
            d = tmp_path_factory.mktemp(f"{kind}-{qtype}")
            write_gguf(hf[kind], d / "m.gguf", qtype, pre=kw.pop("pre", PRE[kind]),
                       chat_template=CHAT_TEMPLATE, **kw)
            cache[key] = d
        return cache[key]
    get.hf = hf
    return get


def _hf(d):
    import transformers as T
    model = T.AutoModelForCausalLM.from_pretrained(d, gguf_file="m.gguf", dtype=torch.float32)
    return model.eval(), T.AutoTokenizer.from_pretrained(d, gguf_file="m.gguf")


@pytest.mark.parametrize("kind,qtype", [("llama", "F32"), ("llama", "Q8_0"), ("llama", "Q4_1"),
                                        ("qwen2", "F32"), ("qwen2", "Q4_1")])
def test_greedy_equals_transformers_on_the_same_file(files, kind, qtype):
    """Dequantized at load (quantization "none"), as transformers does; kept quantized (the
    default): tests/unit/test_prequant_gguf.py."""
    d = files(kind, qtype)
    model, hf_tok = _hf(d)
    llm = LLM(d / "m.gguf", num_blocks=32, block_size=8, quantization="none")
    prompts = [llm.tokenizer.encode(p) for p in PROMPTS]
    assert prompts == [hf_tok.encode(p) for p in PROMPTS]
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=NEW,
                                                ignore_eos=True, logprobs=0))
    for p, o in zip(prompts, outs):
        g = model.generate(torch.tensor([p]), max_new_tokens=NEW, do_sample=False,
                           output_logits=True, return_dict_in_generate=True,
                           eos_token_id=None, pad_token_id=0)
        toks = g.sequences[0, len(p):].tolist()
        assert o.token_ids == toks
        lps = [torch.log_softmax(l[0], -1)[t].item() for l, t in zip(g.logits, toks)]
        assert max(abs(a - b) for a, b in zip(o.logprobs, lps)) < 1e-3


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_tokenizer_rebuilt_from_metadata_equals_transformers(files, kind):
    d = files(kind)
    import transformers as T
    hf_tok = T.AutoTokenizer.from_pretrained(d, gguf_file="m.gguf")
    tok = Tokenizer.from_dir(d)                       # the directory holding the file
    ids = tok.encode(MIXED)
    assert ids == hf_tok.encode(MIXED)
    assert tok.decode(ids) == hf_tok.decode(ids, skip_special_tokens=True)
    assert tok.decode(ids, skip_special_tokens=False) == hf_tok.decode(ids)
    assert tok.decode(tok.encode(MIXED, add_special_tokens=False), skip_special_tokens=False) == MIXED
    messages = [{"role": "system", "content": "Be brief."},
                {"role": "user", "content": MIXED}]
    assert tok.apply_chat_template(messages) == hf_tok.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True)
    assert (tok.bos_token, tok.eos_token, tok.pad_token) == ("<s>", "</s>", "<pad>")
    assert tok.eos_token_ids == {hf_tok.eos_token_id}


def test_config_read_from_metadata(files):
    d = files("llama")
    hf = json.loads((files.hf["llama"] / "config.json").read_text())
    c = ModelConfig.from_dir(d / "m.gguf")
    assert (c.architecture, c.num_layers, c.hidden_size, c.intermediate_size, c.num_heads,
            c.num_kv_heads, c.vocab_size, c.max_position_embeddings, c.tie_word_embeddings) == (
        "LlamaForCausalLM", hf["num_hidden_layers"], hf["hidden_size"],
        hf["intermediate_size"], hf["num_attention_heads"], hf["num_key_value_heads"],
        hf["vocab_size"], hf["max_position_embeddings"], False)
    assert c.rms_norm_eps == pytest.approx(hf["rms_norm_eps"])
    assert c.name == "m"


def test_raw_tensors_keep_their_type_with_rows_in_hf_order(files):
    """The seam for quantized serving: q/k rows of a Q8_0 file, un-permuted but still Q8_0,
    are byte for byte the quantization of the original (unpermuted) weights."""
    import gguf
    from safetensors.numpy import load_file
    d = files("llama", "Q8_0")
    ref = load_file(str(files.hf["llama"] / "model.safetensors"))
    raw = {t.name: t for t in open_gguf(d / "m.gguf").raw_tensors()}
    for name in ("model.layers.0.self_attn.q_proj.weight", "model.layers.1.self_attn.k_proj.weight",
                 "model.layers.0.mlp.down_proj.weight"):
        t = raw[name]
        assert t.type_name == "Q8_0" and t.shape == ref[name].shape
        want = gguf.quants.quantize(ref[name].astype(np.float32), gguf.GGMLQuantizationType.Q8_0)
        assert np.array_equal(t.data, want)
    assert raw["model.norm.weight"].type_name == "F32"


@pytest.mark.parametrize("kw,match", [
    (dict(arch="gpt2"), "unsupported GGUF architecture 'gpt2'"),
    (dict(tokenizer_model="llama"), "unsupported GGUF tokenizer model 'llama'"),
    (dict(pre="falcon"), "unsupported GGUF pre-tokenizer 'falcon'"),
    (dict(qtype="Q5_0"), "unsupported type Q5_0"),
])
def test_unsupported_files_are_named(files, kw, match):
    qtype = kw.pop("qtype", "F32")
    d = files("llama", qtype, **kw)
    with pytest.raises(ValueError, match=match):
        LLM(d / "m.gguf", num_blocks=8)


def test_config_without_architectures_falls_back_to_model_type(files, tmp_path):
    """transformers writes no `architectures` for a model it loaded from GGUF."""
    files("llama")
    src = files.hf["llama"]
    d = shutil.copytree(src, tmp_path / "m")
    c = json.loads((d / "config.json").read_text())
    del c["architectures"]
    (d / "config.json").write_text(json.dumps(c))
    assert ModelConfig.from_dir(d).architecture == "LlamaForCausalLM"
    a = LLM(src, num_blocks=16).generate([[1, 5, 9]], SamplingParams(temperature=0, max_tokens=6))
    b = LLM(d, num_blocks=16).generate([[1, 5, 9]], SamplingParams(temperature=0, max_tokens=6))
    assert a[0].token_ids == b[0].token_ids


@pytest.mark.parametrize("qtype", ["F32", "F16", "Q8_0", "Q4_1"])
def test_header_parser_reads_what_the_gguf_package_reads(files, qtype, tmp_path):
    """read_gguf (struct over the mapped file) against the `gguf` package's own reader: every
    metadata value (strings, string and integer arrays, floats, bools), every tensor's name,
    type, dims and data view; and a truncated file is a clear ValueError."""
    from gguf import GGUFReader

    from engine.gguf import GGUFModel, read_gguf
    path = files("llama", qtype) / "m.gguf"
    meta, tensors = read_gguf(path)
    ref = GGUFReader(str(path))
    assert meta == {k: f.contents() for k, f in ref.fields.items() if not k.startswith("GGUF.")}
    assert len(tensors) == len(ref.tensors)
    for got, want in zip(tensors, ref.tensors):
        assert (got.name, got.type_name, got.shape) == (want.name, want.tensor_type.name,
                                                        tuple(want.shape.tolist()))
        assert got.data.dtype == want.data.dtype and np.array_equal(got.data, want.data)
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(path.read_bytes()[:4096])
    with pytest.raises(ValueError, match="not a readable GGUF file"):
        GGUFModel(cut)
