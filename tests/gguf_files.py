"""GGUF files written by the tests from Hugging Face directories, the way llama.cpp's
converter writes them (its tensor names and metadata keys, Llama's q/k rows permuted), with
`gguf.GGUFWriter` and `gguf.quants.quantize`."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from safetensors.numpy import load_file

LAYER = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
         "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
         "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
         "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
         "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}
GLOBAL = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}


def gguf_name(hf: str) -> str:
    base, _, suffix = hf.rpartition(".")
    if base in GLOBAL:
        return f"{GLOBAL[base]}.{suffix}"
    _, _, i, rest = base.split(".", 3)       # model.layers.N.rest
    return f"blk.{i}.{LAYER[rest]}.{suffix}"


def permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's converter: per head, rows (0..d/2-1, d/2..d-1) interleaved."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_gguf(hf_dir: Path, out: Path, qtype: str = "F32", *, pre: str = "gpt2",
               tokenizer_model: str = "gpt2", arch: str | None = None,
               chat_template: str | None = None, types: dict[str, str] | None = None) -> Path:
    """hf_dir (config.json, model.safetensors, tokenizer.json) -> out, a GGUF file. 2-D
    weights are stored as `qtype` (or as `types` names them: GGUF tensor name -> type),
    everything else as F32."""
    import gguf

    c = json.loads((hf_dir / "config.json").read_text())
    arch = arch or c["model_type"]
    w = gguf.GGUFWriter(str(out), arch)
    heads, kv = c["num_attention_heads"], c["num_key_value_heads"]
    w.add_block_count(c["num_hidden_layers"])
    w.add_context_length(c["max_position_embeddings"])
    w.add_embedding_length(c["hidden_size"])
    w.add_feed_forward_length(c["intermediate_size"])
    w.add_head_count(heads)
    w.add_head_count_kv(kv)
    w.add_layer_norm_rms_eps(c["rms_norm_eps"])
    rope = c.get("rope_parameters") or {}
    w.add_rope_freq_base(rope.get("rope_theta", c.get("rope_theta", 10000.0)))
    if c.get("head_dim") and c["head_dim"] != c["hidden_size"] // heads:
        w.add_key_length(c["head_dim"])
        w.add_value_length(c["head_dim"])
    w.add_vocab_size(c["vocab_size"])

    add_tokenizer(w, hf_dir, pre, tokenizer_model, chat_template)
    for name, t in sorted(load_file(str(hf_dir / "model.safetensors")).items()):
        t = t.astype(np.float32)
        if arch == "llama" and (".q_proj." in name or ".k_proj." in name):
            t = permute(t, heads if ".q_proj." in name else kv)
        q = gguf.GGMLQuantizationType[(types or {}).get(gguf_name(name), qtype)]
        if t.ndim == 2 and q != gguf.GGMLQuantizationType.F32:
            w.add_tensor(gguf_name(name), gguf.quants.quantize(t, q), raw_dtype=q)
        else:
            w.add_tensor(gguf_name(name), t)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


def add_tokenizer(w, hf_dir: Path, pre: str = "gpt2", tokenizer_model: str = "gpt2",
                  chat_template: str | None = None) -> None:
    """tokenizer.json's byte-level BPE as tokenizer.ggml.* metadata, as the converter writes it."""
    tok = json.loads((hf_dir / "tokenizer.json").read_text())
    vocab = dict(tok["model"]["vocab"])
    special = {t["content"] for t in tok["added_tokens"] if t["special"]}
    vocab.update({t["content"]: t["id"] for t in tok["added_tokens"]})
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    assert [vocab[t] for t in tokens] == list(range(len(tokens)))
    merges = [m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]]
    w.add_tokenizer_model(tokenizer_model)
    w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_types([3 if t in special else 1 for t in tokens])
    w.add_token_merges(merges)
    w.add_bos_token_id(vocab["<s>"])
    w.add_eos_token_id(vocab["</s>"])
    w.add_pad_token_id(vocab["<pad>"])
    w.add_add_bos_token(True)
    if chat_template:
        w.add_chat_template(chat_template)


def tiny_hf_dir(kind: str, out: Path, **overrides) -> Path:
    """A random transformers model of `kind` (tests/hf_models.py, "deepseek_v3":
    tests/hf_models_mla.py, "gemma3_text": tests/hf_models_window.py; `overrides` for its config)
    beside the tiny model's byte-level BPE tokenizer and chat template."""
    import shutil

    from engine.tiny_model import make_tiny_model
    from tests.hf_models import make_hf_model
    from tests.hf_models_mla import make_deepseek
    from tests.hf_models_window import make_window_model
    tiny = make_tiny_model(out / "tiny")
    overrides = dict(dict(vocab_size=1024), **overrides)
    if kind == "deepseek_v3":
        d = make_deepseek(out / kind, **overrides)
    elif kind == "gemma3_text":
        d = make_window_model(kind, out / kind, **overrides)
    else:
        d = make_hf_model(kind, out / kind, **overrides)
    for f in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(tiny / f, d / f)
    return d
