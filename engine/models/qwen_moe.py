"""Qwen2-MoE and Qwen3-MoE: the Qwen decoders with MoE blocks where configured (every
`decoder_sparse_step`-th layer not in `mlp_only_layers`), top-k unnormalised unless
`norm_topk_prob`; Qwen2-MoE adds a sigmoid-gated shared expert (and q/k/v biases), Qwen3-MoE
per-head q/k RMSNorm. Experts stored as `mlp.experts.E.gate_proj` / `up_proj` / `down_proj`."""
from __future__ import annotations

from engine.config import MoeConfig

from .base import CausalLM, layer_types
from .moe import MLP_EXPERTS



class QwenMoeForCausalLM(CausalLM):
    @classmethod
    def config_fields(cls, kind: str, c: dict, path) -> dict:
        e = c["num_experts"] if "num_experts" in c else c["num_local_experts"]   # transformers 5 writes the latter
        step, dense = c.get("decoder_sparse_step", 1), set(c.get("mlp_only_layers") or [])
        moe = MoeConfig.checked(
            path, num_experts=e, top_k=c["num_experts_per_tok"], intermediate_size=c["moe_intermediate_size"],
            norm_topk_prob=bool(c.get("norm_topk_prob", False)),
            shared_intermediate_size=c.get("shared_expert_intermediate_size", 0) if kind == "qwen2_moe" else 0,
            sparse_layers=[i for i in range(c["num_hidden_layers"])
                           if i not in dense and e > 0 and (i + 1) % step == 0],
            hidden_act=c.get("hidden_act", "silu"))
        # the window (when on): Qwen3-MoE's on every layer; Qwen2-MoE's on those layer_types
        # names (transformers: every other one below max_window_layers)
        window = (c.get("sliding_window") or None) if c.get("use_sliding_window") else None
        first = c.get("max_window_layers", 28)
        types = layer_types(c, window, lambda i: (i + 1) % 2 == 1 and i < first) \
            if kind == "qwen2_moe" else None
        return dict(qkv_bias=(kind == "qwen2_moe" and c.get("qkv_bias", True)) or bool(c.get("attention_bias", False)),
                    qk_norm=kind == "qwen3_moe", moe=moe, sliding_window=window, layer_types=types)


    def checkpoint_name(self, name: str):
        return MLP_EXPERTS(name) or super().checkpoint_name(name)
