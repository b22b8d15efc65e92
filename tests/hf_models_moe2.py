"""Tiny random GLM-4.5 MoE and MiniMax-M2 models for the equivalence tests, saved with
`save_pretrained` (the real structure at toy sizes: hidden 64, 4 heads over 2 KV heads, 8
experts top-2, partial rotary; GLM with a dense first layer, 2 groups of which 1 is kept,
2 shared experts, q/k/v biases, per-head q/k norm; MiniMax with whole-projection q/k norms).
Biases, norms and the routers' correction biases are perturbed so that they matter."""
from __future__ import annotations

from pathlib import Path

import torch

from tests.hf_models import COMMON

GLM = dict(COMMON, head_dim=16, intermediate_size=96, moe_intermediate_size=32, n_routed_experts=8,
           num_experts_per_tok=2, n_shared_experts=2, n_group=2, topk_group=1, first_k_dense_replace=1,
           routed_scaling_factor=1.8, norm_topk_prob=True, attention_bias=True, use_qk_norm=True,
           rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5})
KINDS = ("glm4_moe", "minimax_m2")
MINIMAX = dict(COMMON, head_dim=16, intermediate_size=32, num_local_experts=8, num_experts_per_tok=2,
               rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5})


def make_moe2_model(kind: str, out: Path, **overrides) -> Path:
    """kind: glm4_moe | minimax_m2; `overrides` are config fields."""
    import transformers as T
    if kind == "glm4_moe":
        cls, cfg = T.Glm4MoeForCausalLM, T.Glm4MoeConfig(**{**GLM, **overrides})
    elif kind == "minimax_m2":
        cls, cfg = T.MiniMaxM2ForCausalLM, T.MiniMaxM2Config(**{**MINIMAX, **overrides})
    else:
        raise ValueError(kind)
    torch.manual_seed(0)
    model = cls(cfg).float().eval()
    with torch.no_grad():
        for name, p in [*model.named_parameters(), *model.named_buffers()]:
            if name.endswith("e_score_correction_bias"):
                # on the scale of the sigmoid scores' spread: the bias moves choices
                p.copy_(torch.randn_like(p) * 0.05)
            elif name.endswith("bias") or "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
    model.save_pretrained(out)
    return out
