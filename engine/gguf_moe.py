"""The mixture-of-experts architectures of GGUF (torch-free; the map of engine/gguf_arch.py):
Qwen2-MoE / Qwen3-MoE (`qwen2moe`, `qwen3moe`) and DeepSeek-V3 (`deepseek2`, which R1 and
Kimi K2 share; llama.cpp names the architecture after V2, whose files it also reads).

DeepSeek's multi-head latent attention in llama.cpp's converter (convert_hf_to_gguf.py,
DeepseekV2Model) and what is read back here:

    HF config / tensor                         GGUF
    num_key_value_heads (= heads)              attention.head_count_kv = 1 (MLA seen as MQA)
    kv_lora_rank + qk_rope_head_dim            attention.key_length   (the MQA key width)
    qk_nope_head_dim + qk_rope_head_dim        attention.key_length_mla  (older files: key_length)
    v_head_dim                                 attention.value_length_mla (older: value_length)
    kv_b_proj [H*(nope+v), rank]               attn_k_b [H, rank, nope] (k half, per head
                                               transposed) and attn_v_b [H, v, rank]
                                               (older files: attn_kv_b as is)
    mlp.gate.e_score_correction_bias           exp_probs_b.bias
    scoring_func sigmoid | softmax             expert_gating_func 2 | 1 (absent: softmax, V2)
    first_k_dense_replace, n_group, topk_group leading_dense_block_count, expert_group_count,
    routed_scaling_factor, norm_topk_prob      expert_group_used_count, expert_weights_scale,
                                               expert_weights_norm (absent: false)
    yarn mscale_all_dim                        rope.scaling.yarn_log_multiplier = 0.1 x it

The rotary rows stay as the checkpoint has them (llama.cpp's deepseek2 ropes adjacent pairs,
as rope_interleave says). llama.cpp's YaRN for deepseek2 leaves the rotary table unscaled and
sharpens the softmax by (1 + 0.1 mscale_all_dim ln factor)^2: transformers computes the same
with mscale equal to mscale_all_dim (DeepSeek-V3's and Kimi K2's own configs), so that is
what the config says (attention_factor 1, so a file without the multiplier keeps both 1).
"""
from __future__ import annotations

from typing import Iterator

import numpy as np

from .gguf_arch import _LAYER, GGUFArch, RawTensor, base_config, routed_layers

_SHARED = {"ffn_gate_shexp": "gate_proj", "ffn_up_shexp": "up_proj", "ffn_down_shexp": "down_proj"}


class QwenMoe(GGUFArch):
    """Stacked experts; Qwen2-MoE's sigmoid-gated shared expert. Dense layers (Qwen2-MoE's
    mlp_only_layers) are the ones without a router."""
    layer = {**_LAYER, "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
             **{k: f"mlp.shared_expert.{v}" for k, v in _SHARED.items()}}

    def __init__(self, hf_architecture: str):
        self.hf_architecture = hf_architecture

    def config(self, g) -> dict:
        c = super().config(g)
        routed = routed_layers(g)
        c.update(model_type={"qwen2moe": "qwen2_moe", "qwen3moe": "qwen3_moe"}[g.arch],
                 num_experts=g.arch_get("expert_count"),
                 num_experts_per_tok=g.arch_get("expert_used_count"),
                 moe_intermediate_size=g.arch_get("expert_feed_forward_length"),
                 shared_expert_intermediate_size=g.arch_get("expert_shared_feed_forward_length", 0),
                 # llama.cpp renormalises Qwen3-MoE's top-k and not Qwen2-MoE's unless told
                 norm_topk_prob=bool(g.arch_get("expert_weights_norm", g.arch == "qwen3moe")),
                 decoder_sparse_step=1,
                 mlp_only_layers=[i for i in range(c["num_hidden_layers"]) if i not in routed])
        return c

    def tensors(self, g, c: dict) -> Iterator[RawTensor]:
        for t in super().tensors(g, c):
            if t.name.endswith("shared_expert_gate.weight") and len(t.shape) == 1:
                t.shape, t.data = (1, t.shape[0]), t.data.reshape(1, -1)    # stored [H]
            yield t


class Deepseek2(GGUFArch):
    hf_architecture = "DeepseekV3ForCausalLM"
    layer = {**_LAYER, "attn_q_a": "self_attn.q_a_proj", "attn_q_a_norm": "self_attn.q_a_layernorm",
             "attn_q_b": "self_attn.q_b_proj", "attn_kv_a_mqa": "self_attn.kv_a_proj_with_mqa",
             "attn_kv_a_norm": "self_attn.kv_a_layernorm", "attn_kv_b": "self_attn.kv_b_proj",
             "attn_k_b": "self_attn.k_b_proj", "attn_v_b": "self_attn.v_b_proj",
             "exp_probs_b": "mlp.gate.e_score_correction",
             **{k: f"mlp.shared_experts.{v}" for k, v in _SHARED.items()}}

    def config(self, g) -> dict:
        c = base_config(g, self.hf_architecture)
        n, rope = c["num_hidden_layers"], g.arch_get("rope.dimension_count")
        qk = g.arch_get("attention.key_length_mla") or g.arch_get("attention.key_length")
        experts, dense = g.arch_get("expert_count") or None, g.arch_get("leading_dense_block_count", 0)
        routed = routed_layers(g)
        if experts and routed != list(range(dense, n)):
            raise ValueError(f"{g.path.name}: routed layers {routed} are not the layers after "
                             f"{g.arch}.leading_dense_block_count = {dense}")
        gating = g.arch_get("expert_gating_func", 1)
        if gating not in (1, 2):
            raise ValueError(f"{g.path.name}: unsupported {g.arch}.expert_gating_func {gating} "
                             "(1 softmax, 2 sigmoid)")
        biased = any(t.name.endswith("exp_probs_b.bias") for t in g.tensor_table)
        c.update(model_type="deepseek_v3", num_key_value_heads=c["num_attention_heads"],
                 head_dim=rope, q_lora_rank=g.arch_get("attention.q_lora_rank"),
                 kv_lora_rank=g.arch_get("attention.kv_lora_rank"), qk_rope_head_dim=rope,
                 qk_nope_head_dim=qk - rope,
                 v_head_dim=g.arch_get("attention.value_length_mla") or g.arch_get("attention.value_length"),
                 moe_intermediate_size=g.arch_get("expert_feed_forward_length"),
                 n_routed_experts=experts, num_experts_per_tok=g.arch_get("expert_used_count"),
                 n_shared_experts=g.arch_get("expert_shared_count", 0), first_k_dense_replace=dense,
                 routed_scaling_factor=float(g.arch_get("expert_weights_scale", 1.0)),
                 norm_topk_prob=bool(g.arch_get("expert_weights_norm", False)),
                 n_group=g.arch_get("expert_group_count", 1), topk_group=g.arch_get("expert_group_used_count", 1),
                 scoring_func={1: "softmax", 2: "sigmoid"}[gating],
                 topk_method="noaux_tc" if biased else "greedy",
                 rope_interleave=True, hidden_act="silu", attention_bias=False)
        if (yarn := self.yarn(g, c["rope_theta"])) is not None:
            c["rope_parameters"] = yarn
        return c

    def yarn(self, g, theta: float) -> dict | None:
        kind = g.arch_get("rope.scaling.type", "none")
        if kind == "none":
            return None
        if kind != "yarn":
            raise ValueError(f"{g.path.name}: unsupported rope scaling {kind!r} for {g.arch}")
        if g.arch_get("rope.scaling.yarn_attn_factor", 1.0) != 1.0:
            raise ValueError(f"{g.path.name}: {g.arch}.rope.scaling.yarn_attn_factor other than 1 "
                             "is not supported")
        mscale = round(float(g.arch_get("rope.scaling.yarn_log_multiplier", 0.0)) / 0.1, 6)
        return {"rope_type": "yarn", "rope_theta": theta,
                "factor": float(g.arch_get("rope.scaling.factor")),
                "original_max_position_embeddings": g.arch_get("rope.scaling.original_context_length"),
                "beta_fast": float(g.arch_get("rope.scaling.yarn_beta_fast", 32.0)),
                "beta_slow": float(g.arch_get("rope.scaling.yarn_beta_slow", 1.0)),
                "mscale": mscale, "mscale_all_dim": mscale, "attention_factor": 1.0}

    def hf_name(self, gguf_name: str) -> str | None:
        name = super().hf_name(gguf_name)
        return None if name is None else name.replace("e_score_correction.bias", "e_score_correction_bias")

    def tensors(self, g, c: dict) -> Iterator[RawTensor]:
        """kv_b_proj rebuilt (float32) from each layer's attn_k_b and attn_v_b."""
        halves: dict[str, dict[str, RawTensor]] = {}
        for t in super().tensors(g, c):
            for part in ("k_b_proj", "v_b_proj"):
                if t.name.endswith(f".{part}.weight"):
                    name = t.name.replace(part, "kv_b_proj")
                    halves.setdefault(name, {})[part] = t
                    if len(halves[name]) == 2:
                        yield kv_b(name, halves.pop(name))
                    break
            else:
                yield t
        if halves:
            raise ValueError(f"{g.path.name}: {sorted(halves)[0]} has only one of attn_k_b, attn_v_b")


def kv_b(name: str, halves: dict[str, RawTensor]) -> RawTensor:
    """kv_b_proj [H*(nope+v), rank]: per head the k rows (attn_k_b [H, rank, nope] transposed
    back) then the v rows (attn_v_b [H, v, rank])."""
    k, v = halves["k_b_proj"].dequantize(), halves["v_b_proj"].dequantize()
    if k.ndim != 3 or v.ndim != 3 or k.shape[:2] != (v.shape[0], v.shape[2]):
        raise ValueError(f"{name}: attn_k_b {k.shape} and attn_v_b {v.shape} do not pair up")
    w = np.concatenate([k.transpose(0, 2, 1), v], axis=1)          # [H, nope + v, rank]
    return RawTensor(name, "F32", (w.shape[0] * w.shape[1], w.shape[2]), w.reshape(-1, w.shape[2]))
