"""MiniMax-M2 (`MiniMaxM2ForCausalLM`): the Llama decoder with

  * q and k RMSNorm over the whole projection (q_norm weight [heads x head_dim], k_norm
    [kv heads x head_dim]: one norm across all heads of a token, not one per head as Qwen3's
    and GLM's; transformers' MiniMaxM2Attention), before rotary;
  * partial rotary: `rotary_dim` (or head_dim x partial_rotary_factor) values of each head
    rotate, Neox-style, the rest pass through;
  * an MoE block in every layer: sigmoid scores, `e_score_correction_bias` added for the
    choice only (no groups), the chosen scores always renormalised, no scaling factor; no
    shared expert. Experts of `intermediate_size`.

Checkpoint names as Mixtral's: experts `block_sparse_moe.experts.E.w1` (gate) / `w3` (up) /
`w2` (down), router `block_sparse_moe.gate.weight`; the correction bias
`block_sparse_moe.e_score_correction_bias` (of the block, not of its router).
"""
from __future__ import annotations

import torch

from engine.config import ModelConfig, MoeConfig, rotary_dim_of

from .base import CausalLM
from .layers import Attention, DecoderLayer, RMSNorm
from .moe import BLOCK_SPARSE_EXPERTS, SparseMoeBlock



class MiniMaxM2Attention(Attention):
    """Attention whose q/k norms span every head of the token (RMSNorm over [T, nh * hd])."""

    def __init__(self, c: ModelConfig, backend: str):
        super().__init__(c, backend)
        self.q_norm = RMSNorm(self.q_size, c.rms_norm_eps, backend)
        self.k_norm = RMSNorm(self.kv_size, c.rms_norm_eps, backend)

    def project(self, x) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        T = x.shape[0]
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q, k = self.q_norm(q), self.k_norm(k)       # [T, nh * hd], [T, nkv * hd]
        return q.view(T, self.nh, self.hd), k.view(T, self.nkv, self.hd), v.view(T, self.nkv, self.hd)


class MiniMaxM2ForCausalLM(CausalLM):
    @classmethod
    def config_fields(cls, kind: str, c: dict, path) -> dict:
        if c.get("scoring_func", "sigmoid") != "sigmoid":
            raise ValueError(f"unsupported scoring_func {c['scoring_func']!r} in {path}: MiniMax-M2 "
                             f"routes by sigmoid")
        if c.get("qk_norm_type", "per_layer") != "per_layer":
            raise ValueError(f"unsupported qk_norm_type {c['qk_norm_type']!r} in {path}: MiniMax-M2 "
                             f"norms q and k over the whole projection (per_layer)")
        if c.get("shared_intermediate_size", 0):
            raise ValueError(f"shared_intermediate_size {c['shared_intermediate_size']} in {path}: "
                             f"MiniMax-M2 has no shared expert here (transformers' has none)")
        moe = MoeConfig.checked(
            path, num_experts=c["num_local_experts"], top_k=c["num_experts_per_tok"],
            intermediate_size=c["intermediate_size"], norm_topk_prob=True, shared_intermediate_size=0,
            sparse_layers=list(range(c["num_hidden_layers"])), scoring="sigmoid", correction_bias=True,
            hidden_act=c.get("hidden_act", "silu"))
        return dict(qkv_bias=False, qk_norm=False, sliding_window=None, moe=moe,
                    rotary_dim=rotary_dim_of(c, path))

    def make_layer(self, c: ModelConfig, layer: int):
        return DecoderLayer(c, self.backend, SparseMoeBlock(c, self.backend),
                            attention=MiniMaxM2Attention(c, self.backend))

    def checkpoint_name(self, name: str):
        if (expert := BLOCK_SPARSE_EXPERTS(name)) is not None:
            return expert
        name = name.replace(".block_sparse_moe.e_score_correction_bias", ".mlp.gate.e_score_correction_bias")
        return super().checkpoint_name(name.replace(".block_sparse_moe.gate.", ".mlp.gate."))
