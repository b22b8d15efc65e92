"""GLM-4.5 / GLM-4.6 MoE (`Glm4MoeForCausalLM`): the Llama decoder with

  * partial rotary: the first head_dim x partial_rotary_factor (transformers' default 0.5)
    values of each q/k head rotate, Neox-style (rotate-half), the rest pass through;
  * q/k/v biases (`attention_bias`), per-head q/k RMSNorm when `use_qk_norm`;
  * the first `first_k_dense_replace` layers dense (MLP of `intermediate_size`), the others
    DeepSeek-V3's MoE (moe.py): sigmoid routing with `e_score_correction_bias`, grouped top-k
    (`n_group`, `topk_group`), renormalised when `norm_topk_prob`, x `routed_scaling_factor`,
    plus `n_shared_experts` x `moe_intermediate_size` of ungated shared experts.

Checkpoint names: experts `mlp.experts.E.{gate,up,down}_proj`, router `mlp.gate.weight` and
`mlp.gate.e_score_correction_bias`, shared experts `mlp.shared_experts.*`. The multi-token
prediction layers GLM checkpoints carry after the last decoder layer
(`num_nextn_predict_layers`, for speculative drafting) are skipped, as transformers skips them.
"""
from __future__ import annotations

import re

from engine.config import MoeConfig, rotary_dim_of

from .base import CausalLM
from .moe import MLP_EXPERTS, shared_experts_name

_LAYER = re.compile(r"^(?:model\.)?layers\.(\d+)\.")


class Glm4MoeForCausalLM(CausalLM):
    @classmethod
    def config_fields(cls, kind: str, c: dict, path) -> dict:
        layers, dense = c["num_hidden_layers"], c.get("first_k_dense_replace", 1)
        inter = c["moe_intermediate_size"]
        moe = MoeConfig.checked(
            path, num_experts=c["n_routed_experts"], top_k=c["num_experts_per_tok"],
            intermediate_size=inter, norm_topk_prob=bool(c.get("norm_topk_prob", True)),
            shared_intermediate_size=inter * c.get("n_shared_experts", 1),
            sparse_layers=list(range(dense, layers)), scoring="sigmoid", correction_bias=True,
            n_group=c.get("n_group", 1), topk_group=c.get("topk_group", 1),
            routed_scaling_factor=float(c.get("routed_scaling_factor", 1.0)),
            shared_expert_gate=False, hidden_act=c.get("hidden_act", "silu"))
        return dict(qkv_bias=bool(c.get("attention_bias", False)), qk_norm=bool(c.get("use_qk_norm", False)),
                    sliding_window=None, moe=moe, rotary_dim=rotary_dim_of(c, path, default_factor=0.5),
                    extra={"num_nextn_predict_layers": c.get("num_nextn_predict_layers", 0)})


    def checkpoint_name(self, name: str):
        return MLP_EXPERTS(name) or super().checkpoint_name(shared_experts_name(name))

    def skips(self, name: str) -> bool:
        """The multi-token-prediction layers: num_nextn_predict_layers of them, numbered from
        num_hidden_layers on."""
        m, c = _LAYER.match(name), self.config
        return m is not None and 0 <= int(m.group(1)) - c.num_layers < c.extra["num_nextn_predict_layers"]
