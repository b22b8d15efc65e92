"""Mixtral: the Llama decoder with an MoE block in every layer (moe.py), top-k of
`num_local_experts` always renormalised, a sliding window; its experts stored as
`block_sparse_moe.experts.E.w1` (gate) / `w3` (up) / `w2` (down), its router as
`block_sparse_moe.gate`."""
from __future__ import annotations

from engine.config import MoeConfig

from .base import CausalLM
from .moe import BLOCK_SPARSE_EXPERTS



class MixtralForCausalLM(CausalLM):
    @classmethod
    def config_fields(cls, kind: str, c: dict, path) -> dict:
        moe = MoeConfig.checked(path, num_experts=c["num_local_experts"], top_k=c["num_experts_per_tok"],
                                intermediate_size=c["intermediate_size"], norm_topk_prob=True,
                                shared_intermediate_size=0,
                                sparse_layers=list(range(c["num_hidden_layers"])),
                                hidden_act=c.get("hidden_act", "silu"))
        return dict(qkv_bias=bool(c.get("attention_bias", False)), qk_norm=False, moe=moe,
                    sliding_window=c.get("sliding_window") if c.get("use_sliding_window", True) else None)


    def checkpoint_name(self, name: str):
        if (expert := BLOCK_SPARSE_EXPERTS(name)) is not None:
            return expert
        return super().checkpoint_name(name.replace(".block_sparse_moe.gate.", ".mlp.gate."))
