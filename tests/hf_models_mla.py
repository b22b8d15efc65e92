"""Tiny random DeepSeek-V3 models (multi-head latent attention, its MoE) for the equivalence
tests, saved with `save_pretrained` as tests/hf_models.py does for the other families."""
from __future__ import annotations

from pathlib import Path

import torch

from tests.hf_models import COMMON

# the real structure at toy sizes: low-rank q and kv, a rotary part, a dense first layer, 8
# routed experts in 4 groups (top-2 of 2 groups), a shared expert, a routed scaling factor
DEEPSEEK = dict(COMMON, num_hidden_layers=3, num_key_value_heads=4, q_lora_rank=64,
                kv_lora_rank=32, qk_rope_head_dim=16, qk_nope_head_dim=16, v_head_dim=24,
                moe_intermediate_size=32, n_routed_experts=8, num_experts_per_tok=2, n_group=4,
                topk_group=2, n_shared_experts=1, first_k_dense_replace=1,
                routed_scaling_factor=2.5, norm_topk_prob=True)

YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "mscale": 1.0,
        "mscale_all_dim": 1.0, "beta_fast": 32, "beta_slow": 1,
        "original_max_position_embeddings": 128}


def make_deepseek(out: Path, **overrides) -> Path:
    """overrides: any DeepseekV3Config field (q_lora_rank=None: a full-rank q_proj;
    first_k_dense_replace=layers: no MoE; rope_parameters=YARN)."""
    import transformers as T
    cfg = T.DeepseekV3Config(**{**DEEPSEEK, **overrides})
    torch.manual_seed(0)
    model = T.DeepseekV3ForCausalLM(cfg).float().eval()
    with torch.no_grad():   # biases, norms and the routing correction are zero/one: make them matter
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(torch.randn_like(b) * 0.05)
    model.save_pretrained(out)
    return out


def make_mla_model(kind: str, out: Path, **overrides) -> Path:
    """tests/golden.py's builder signature: `kind` is "deepseek_v3"; `overrides` as
    make_deepseek's (its num_key_value_heads is ignored: MLA has none)."""
    assert kind == "deepseek_v3", kind
    return make_deepseek(out, **overrides)
