"""GGUF files of the mixture-of-experts and MLA models (Mixtral, Qwen2-MoE, Qwen3-MoE,
DeepSeek-V3) and Gemma 3, written by the tests from Hugging Face directories the way llama.cpp's
convert_hf_to_gguf.py writes them (read from its source: conversion/deepseek.py
DeepseekV2Model, qwen.py Qwen2MoeModel, llama.py; tensor names from the `gguf` package's own
TensorNameMap):

    experts      each layer's per-expert tensors stacked: blk.N.ffn_{gate,up,down}_exps [E, ., .]
    deepseek2    head_count_kv 1, key_length = kv_lora_rank + rope, key_length_mla = nope + rope,
                 value_length_mla = v; kv_b_proj split into attn_k_b (per head, transposed) and
                 attn_v_b; e_score_correction_bias -> exp_probs_b.bias; yarn's mscale_all_dim as
                 yarn_log_multiplier = 0.1 x it
    llama        (Mixtral) q/k rows permuted as for Llama
    gemma3       every *norm.weight stored + 1; sliding_window, freq_base (global layers, with
                 their linear scaling), freq_base_swa (local); no layer pattern
    types        1-D tensors, norms, routers and biases F32; other weights `qtype`, F16 where a
                 row does not split into whole blocks (the converter's QuantError fallback)

`write_moe_gguf` also returns what the file holds, dequantized, under the Hugging Face names
(`stored`): a transformers model loaded with those weights is the reference for a quantized
file.
"""
from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import numpy as np
from safetensors.numpy import load_file, save_file

from tests.gguf_files import add_tokenizer, permute

GGUF_ARCH = {"deepseek_v3": "deepseek2", "qwen2_moe": "qwen2moe", "qwen3_moe": "qwen3moe",
             "mixtral": "llama", "gemma3_text": "gemma3"}
_EXPERT = re.compile(r"^model\.layers\.(\d+)\.(mlp|block_sparse_moe)\.experts\.(\d+)\.(\w+)\.weight$")


def write_moe_gguf(hf_dir: Path, out: Path, qtype: str = "F32", *, pre: str = "gpt2",
                   chat_template: str | None = None, split_kv_b: bool = True,
                   gating: int | None = 2) -> dict[str, np.ndarray]:
    """hf_dir -> out (a GGUF file); returns {HF name: float32 array as stored}. split_kv_b=False:
    the older files' one attn_kv_b. gating: DeepSeek's expert_gating_func (2: sigmoid, what the
    hub's config.json scoring_func gives; None: not written, as V2 files)."""
    import gguf

    c = json.loads((hf_dir / "config.json").read_text())
    arch = GGUF_ARCH[c["model_type"]]
    w = gguf.GGUFWriter(str(out), arch)
    _metadata(w, c, arch, gating)
    add_tokenizer(w, hf_dir, pre, chat_template=chat_template)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH[arch.upper().replace("-", "_")],
                                     c["num_hidden_layers"])
    stored = {}
    for pieces, back in _units(c, arch, load_file(str(hf_dir / "model.safetensors")), split_kv_b):
        held = []
        for hf_name, t in pieces:
            name = names.get_name(hf_name.replace("e_score_correction_bias", "e_score_correction.bias"),
                                  try_suffixes=(".weight", ".bias"))
            assert name is not None, hf_name
            held.append(_add(w, name, t, qtype))
        stored.update(back(held))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return stored


def _add(w, name: str, t: np.ndarray, qtype: str) -> np.ndarray:
    """Store `t` as the converter types it; return what the file then holds, as float32."""
    import gguf
    from gguf import GGMLQuantizationType as Q
    q = Q[qtype]
    if t.ndim <= 1 or name.endswith("_norm.weight") or not name.endswith(".weight") \
            or re.search(r"\.ffn_gate_inp(_shexp)?\.weight$", name):
        q = Q.F32
    if q == Q.F32:
        w.add_tensor(name, t)
        return t
    try:
        data = gguf.quants.quantize(t, q)
    except gguf.QuantError:
        q, data = Q.F16, gguf.quants.quantize(t, Q.F16)
    w.add_tensor(name, data, raw_dtype=q)
    return gguf.quants.dequantize(data, q).astype(np.float32).reshape(t.shape)


def _units(c: dict, arch: str, sd: dict, split_kv_b: bool):
    """([(HF-style name for the name map, array)], back: stored arrays -> {HF name: array})."""
    heads, experts = c["num_attention_heads"], {}
    for name in sorted(sd):
        t = sd[name].astype(np.float32)
        if m := _EXPERT.match(name):
            experts.setdefault((m[1], m[2], m[4]), {})[int(m[3])] = name
        elif name.endswith("kv_b_proj.weight") and split_kv_b:
            nope, v = c["qk_nope_head_dim"], c["v_head_dim"]
            kv = t.reshape(heads, nope + v, -1)
            yield ([(name.replace("kv_b", "k_b"), kv[:, :nope].transpose(0, 2, 1).copy()),
                    (name.replace("kv_b", "v_b"), kv[:, nope:].copy())],
                   lambda s, name=name: {name: np.concatenate([s[0].transpose(0, 2, 1), s[1]], 1)
                                         .reshape(-1, s[1].shape[-1])})
        elif arch == "gemma3" and name.endswith("norm.weight"):
            yield [(name, t + np.float32(1.0))], lambda s, name=name: {name: s[0] - np.float32(1.0)}
        elif arch == "llama" and (".q_proj." in name or ".k_proj." in name):
            n = heads if ".q_proj." in name else c["num_key_value_heads"]
            yield [(name, permute(t, n))], lambda s, name=name, n=n: {name: _unpermute(s[0], n)}
        else:
            yield [(name, t)], lambda s, name=name: {name: s[0]}
    for (layer, block, part), by_expert in experts.items():
        order = [by_expert[e] for e in range(len(by_expert))]
        yield ([(f"model.layers.{layer}.{block}.experts.{part}.weight",
                 np.stack([sd[n].astype(np.float32) for n in order]))],
               lambda s, order=order: {n: s[0][e] for e, n in enumerate(order)})


def _unpermute(w: np.ndarray, heads: int) -> np.ndarray:
    return w.reshape(heads, w.shape[0] // heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _metadata(w, c: dict, arch: str, gating: int | None) -> None:
    heads, layers = c["num_attention_heads"], c["num_hidden_layers"]
    w.add_block_count(layers)
    w.add_context_length(c["max_position_embeddings"])
    w.add_embedding_length(c["hidden_size"])
    w.add_feed_forward_length(c["intermediate_size"])
    w.add_head_count(heads)
    w.add_head_count_kv(1 if arch == "deepseek2" else c["num_key_value_heads"])
    w.add_layer_norm_rms_eps(c["rms_norm_eps"])
    rope = c.get("rope_parameters") or {}
    w.add_vocab_size(c["vocab_size"])
    if arch == "gemma3":
        _gemma3_metadata(w, c, rope)
    else:
        w.add_rope_freq_base(rope.get("rope_theta", 10000.0))
        w.add_expert_count(c.get("n_routed_experts") or c.get("num_experts") or c.get("num_local_experts"))
        w.add_expert_used_count(c["num_experts_per_tok"])
    if arch == "deepseek2":
        _deepseek_metadata(w, c, rope, gating)
        return
    if c.get("head_dim"):
        w.add_key_length(c["head_dim"])
        w.add_value_length(c["head_dim"])
    if c.get("moe_intermediate_size"):
        w.add_expert_feed_forward_length(c["moe_intermediate_size"])
    if c.get("shared_expert_intermediate_size"):
        w.add_expert_shared_feed_forward_length(c["shared_expert_intermediate_size"])


def _gemma3_metadata(w, c: dict, rope: dict) -> None:
    full, local = rope["full_attention"], rope["sliding_attention"]
    w.add_rope_freq_base(full["rope_theta"])
    w.add_rope_freq_base_swa(local["rope_theta"])
    if full.get("rope_type") == "linear":
        w.add_rope_scaling_type(__import__("gguf").RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(full["factor"])
    w.add_sliding_window(c["sliding_window"])


def _deepseek_metadata(w, c: dict, rope: dict, gating: int | None) -> None:
    rank, r = c["kv_lora_rank"], c["qk_rope_head_dim"]
    w.add_expert_group_count(c["n_group"])
    w.add_expert_group_used_count(c["topk_group"])
    if gating is not None:
        w.add_expert_gating_func(__import__("gguf").ExpertGatingFuncType(gating))
    w.add_leading_dense_block_count(c["first_k_dense_replace"])
    if c.get("q_lora_rank"):
        w.add_q_lora_rank(c["q_lora_rank"])
    w.add_kv_lora_rank(rank)
    w.add_key_length(rank + r)
    w.add_value_length(rank)
    w.add_key_length_mla(c["qk_nope_head_dim"] + r)
    w.add_value_length_mla(c["v_head_dim"])
    w.add_expert_feed_forward_length(c["moe_intermediate_size"])
    w.add_expert_shared_count(c["n_shared_experts"])
    w.add_expert_weights_scale(c["routed_scaling_factor"])
    if c.get("norm_topk_prob"):
        w.add_expert_weights_norm(True)
    w.add_rope_dimension_count(r)
    if rope.get("rope_type") == "yarn":
        w.add_rope_scaling_type(__import__("gguf").RopeScalingType.YARN)
        w.add_rope_scaling_factor(rope["factor"])
        w.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
        w.add_rope_scaling_yarn_beta_fast(rope["beta_fast"])
        w.add_rope_scaling_yarn_beta_slow(rope["beta_slow"])
        w.add_rope_scaling_yarn_log_mul(0.1 * rope["mscale_all_dim"])


def reference_dir(hf_dir: Path, stored: dict[str, np.ndarray], out: Path) -> Path:
    """A copy of hf_dir whose weights are what the GGUF file holds (transformers' reference
    for a quantized file)."""
    shutil.copytree(hf_dir, out)
    save_file({k: np.ascontiguousarray(v) for k, v in stored.items()}, str(out / "model.safetensors"),
              metadata={"format": "pt"})
    return out
