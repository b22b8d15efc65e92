"""DeepSeek-V3 (and R1, Kimi K2: the same architecture): multi-head latent attention (MLA)
and a fine-grained MoE with shared experts after `first_k_dense_replace` dense layers.

MLA (the DeepSeek-V2 paper), per token and layer:

    q      = q_b_proj(norm(q_a_proj(x)))            [H, nope + rope]   (or q_proj(x))
    latent = kv_a_proj_with_mqa(x) = c | k_pe        c: kv_lora_rank, k_pe: rope (one for all heads)
    cache  <- norm(c) | rotary(k_pe)                  kv_lora_rank + rope values: all that is kept
    k, v   = kv_b_proj(norm(c)) split per head        [H, nope] and [H, v_head_dim]

Two ways to attend, one result:
  * prefill, expanded: each request's cached latents are expanded through kv_b_proj into
    per-head keys and values, then ordinary causal attention (compute-bound: fine);
  * decode, absorbed: kv_b_proj's key half is multiplied into the query instead
    (q_nope . (W_uk c) = (W_uk^T q_nope) . c), so every head attends the cached latent rows
    directly (engine.kernels.paged_mla_decode_attention: MQA with 576-wide keys on the real
    model), and the value half is applied once to the attended latent. Decode then reads
    576 values per cached token instead of 2 x heads x 128 expanded ones.

The checkpoint's rotary dims are interleaved pairs (rope_interleave); they are reordered once at
load (`assemble`) into the half-split order the rotary kernels use: q and k move together, so
every score is unchanged.
"""
from __future__ import annotations

import re

import torch
from torch import nn

import engine.kernels as K
from engine.config import MlaConfig, ModelConfig, MoeConfig
from engine.kernels.rope import yarn_mscale

from .base import CausalLM
from .layers import AttentionMetadata, DecoderLayer, RMSNorm, input_dtype
from .moe import MLP_EXPERTS, shared_experts_name

# projections whose rotary rows come interleaved in the checkpoint (rope_interleave)
_ROPE_ROWS = ("q_proj", "q_b_proj", "kv_a_proj_with_mqa")


class MlaAttention(nn.Module):
    def __init__(self, c: ModelConfig, backend: str):
        super().__init__()
        m: MlaConfig = c.mla
        self.backend, self.m, self.nh = backend, m, c.num_heads
        self.qk_dim = m.qk_nope_head_dim + m.qk_rope_head_dim
        bias = c.qkv_bias
        if m.q_lora_rank:
            self.q_a_proj = nn.Linear(c.hidden_size, m.q_lora_rank, bias=bias)
            self.q_a_layernorm = RMSNorm(m.q_lora_rank, 1e-6, backend)
            self.q_b_proj = nn.Linear(m.q_lora_rank, self.nh * self.qk_dim, bias=False)
        else:
            self.q_proj = nn.Linear(c.hidden_size, self.nh * self.qk_dim, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(c.hidden_size, m.latent_dim, bias=bias)
        self.kv_a_layernorm = RMSNorm(m.kv_lora_rank, 1e-6, backend)
        self.kv_b_proj = nn.Linear(m.kv_lora_rank, self.nh * (m.qk_nope_head_dim + m.v_head_dim), bias=False)
        self.o_proj = nn.Linear(self.nh * m.v_head_dim, c.hidden_size, bias=bias)
        self.scale = self.qk_dim ** -0.5
        r = c.rope_scaling or {}
        if r.get("mscale_all_dim"):     # YaRN: the softmax sharpened as transformers does
            self.scale *= yarn_mscale(r["factor"], r["mscale_all_dim"]) ** 2
        self.cache = self.cache_scales = None   # [num_blocks, block_size, latent], bound later
        self._absorbed = None

    @property
    def input_dtype(self) -> torch.dtype | None:
        return input_dtype(self.kv_a_proj_with_mqa)

    def bind_kv_cache(self, cache, scales=None) -> None:
        if scales is not None:
            raise ValueError("an 8-bit KV cache is not supported for MLA models (kv_cache_dtype auto)")
        self.cache = cache.view(cache.shape[0], cache.shape[1], -1)   # [blocks, bs, 1, D] -> [.., D]

    def absorbed(self) -> tuple[torch.Tensor, torch.Tensor]:
        """kv_b_proj's halves per head: W_uk [H, nope, rank] and W_uv^T [H, rank, v], made once."""
        w = self.kv_b_proj.weight
        if self._absorbed is None or self._absorbed[0] is not w:
            m = self.m
            per_head = w.view(self.nh, m.qk_nope_head_dim + m.v_head_dim, m.kv_lora_rank)
            self._absorbed = (w, per_head[:, :m.qk_nope_head_dim].contiguous(),
                              per_head[:, m.qk_nope_head_dim:].transpose(1, 2).contiguous())
        return self._absorbed[1], self._absorbed[2]

    def forward(self, positions, x, meta: AttentionMetadata, cos_sin, rope_rows=None):
        T, m = x.shape[0], self.m
        q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x))) if m.q_lora_rank else self.q_proj(x)
        q_nope, q_pe = q.view(T, self.nh, self.qk_dim).split([m.qk_nope_head_dim, m.qk_rope_head_dim], -1)
        c, k_pe = self.kv_a_proj_with_mqa(x).split([m.kv_lora_rank, m.qk_rope_head_dim], -1)
        c = self.kv_a_layernorm(c.contiguous())
        q_pe, k_pe = K.rotary_embedding(positions, q_pe.contiguous(), k_pe.reshape(T, 1, -1),
                                        cos_sin, rows=rope_rows, backend=self.backend)
        K.write_latent_cache(torch.cat([c, k_pe.view(T, -1)], -1), self.cache, meta.slot_mapping,
                             backend=self.backend)
        if meta.decode_only:
            o = self._decode(q_nope, q_pe, meta)
        else:
            o = self._prefill(q_nope, q_pe, meta)
        return self.o_proj(o.reshape(T, self.nh * m.v_head_dim))

    def _decode(self, q_nope, q_pe, meta: AttentionMetadata) -> torch.Tensor:
        """Absorbed: queries into the latent space, attention there, values out of it."""
        w_uk, w_uv = self.absorbed()
        q_lat = torch.bmm(q_nope.transpose(0, 1), w_uk).transpose(0, 1)        # [T, H, rank]
        o_lat = K.paged_mla_decode_attention(torch.cat([q_lat, q_pe], -1), self.cache,
                                             meta.block_tables, meta.context_lens, self.scale,
                                             self.m.kv_lora_rank, max_context_len=meta.max_context_len,
                                             backend=self.backend)
        return torch.bmm(o_lat.transpose(0, 1), w_uv).transpose(0, 1)          # [T, H, v]

    def _prefill(self, q_nope, q_pe, meta: AttentionMetadata) -> torch.Tensor:
        """Expanded, one request at a time: its cached latents (the prefix and this chunk)
        through kv_b_proj into per-head keys and values, causal attention offset by the
        prefix."""
        m, bs = self.m, self.cache.shape[1]
        cu, lens = meta.cu_seqlens_q.tolist(), meta.context_lens.tolist()
        out = []
        for b, L in enumerate(lens):
            n = cu[b + 1] - cu[b]
            rows = self.cache[meta.block_tables[b, :-(-L // bs)].long()].flatten(0, 1)[:L]
            kv = self.kv_b_proj(rows[:, :m.kv_lora_rank].to(q_nope.dtype)).view(L, self.nh, -1)
            k_nope, v = kv.split([m.qk_nope_head_dim, m.v_head_dim], -1)
            k = torch.cat([k_nope, rows[:, None, m.kv_lora_rank:].to(k_nope.dtype).expand(L, self.nh, -1)], -1)
            q = torch.cat([q_nope[cu[b]:cu[b + 1]], q_pe[cu[b]:cu[b + 1]]], -1)
            # query i sits at position L - n + i and sees keys 0 .. L - n + i
            mask = torch.arange(L, device=q.device)[None, :] <= torch.arange(L - n, L, device=q.device)[:, None]
            o = nn.functional.scaled_dot_product_attention(
                q.transpose(0, 1).float(), k.transpose(0, 1).float(), v.transpose(0, 1).float(),
                attn_mask=mask, scale=self.scale)
            out.append(o.transpose(0, 1).to(q_nope.dtype))
        return torch.cat(out)


class DeepseekV3ForCausalLM(CausalLM):
    packed_modules = {**CausalLM.packed_modules, **{p: (p, 0) for p in _ROPE_ROWS}}
    quantizable = ("q_proj", "q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "o_proj",
                   "gate_up_proj", "down_proj")     # kv_b_proj stays float: decode absorbs it

    @classmethod
    def config_fields(cls, kind: str, c: dict, path) -> dict:
        mla = MlaConfig(q_lora_rank=c.get("q_lora_rank"), kv_lora_rank=c["kv_lora_rank"],
                        qk_nope_head_dim=c["qk_nope_head_dim"], qk_rope_head_dim=c["qk_rope_head_dim"],
                        v_head_dim=c["v_head_dim"])
        if c.get("hidden_act", "silu") != "silu":
            raise ValueError(f"unsupported hidden_act {c['hidden_act']!r} in {path}")
        dense = c.get("first_k_dense_replace", 0)
        # the rotary table is as wide as the rotary key (base.CausalLM.rotary_table)
        return dict(qkv_bias=bool(c.get("attention_bias", False)), qk_norm=False, mla=mla,
                    rotary_dim=mla.qk_rope_head_dim,
                    moe=cls.moe_config(c, path, dense),
                    extra=dict(rope_interleave=bool(c.get("rope_interleave", True))))

    @classmethod
    def moe_config(cls, c: dict, path, dense: int) -> MoeConfig | None:
        """Routed experts after the first `dense` layers: sigmoid scores with the correction
        bias, grouped top-k, the routed scaling factor, ungated shared experts."""
        layers, experts = c["num_hidden_layers"], c.get("n_routed_experts") or 0
        if dense >= layers or not experts:
            return None
        if c.get("scoring_func", "sigmoid") != "sigmoid" or c.get("topk_method", "noaux_tc") != "noaux_tc":
            raise ValueError(f"{path}: only DeepSeek-V3's routing (scoring_func sigmoid, topk_method "
                             f"noaux_tc) is supported")
        return MoeConfig.checked(
            path, num_experts=experts, top_k=c["num_experts_per_tok"],
            intermediate_size=c["moe_intermediate_size"], norm_topk_prob=bool(c.get("norm_topk_prob", True)),
            shared_intermediate_size=c["moe_intermediate_size"] * (c.get("n_shared_experts") or 0),
            sparse_layers=list(range(dense, layers)), scoring="sigmoid", correction_bias=True,
            n_group=c.get("n_group") or 1, topk_group=c.get("topk_group") or 1,
            routed_scaling_factor=float(c.get("routed_scaling_factor", 1.0)), shared_expert_gate=False,
            hidden_act=c.get("hidden_act", "silu"))


    def checkpoint_name(self, name: str):
        return MLP_EXPERTS(name) or super().checkpoint_name(shared_experts_name(name))

    def skips(self, name: str) -> bool:
        """The multi-token-prediction layer(s) DeepSeek-V3's checkpoints carry after the last
        (model.layers.61 of 61): transformers does not run them, nor does this."""
        m = re.match(r"layers\.(\d+)\.", name)
        return m is not None and int(m.group(1)) >= self.config.num_layers

    def make_layer(self, c: ModelConfig, layer: int) -> nn.Module:
        return DecoderLayer(c, self.backend, self.make_mlp(c, layer), MlaAttention(c, self.backend))

    def assemble(self, name: str, shards: dict):
        fused = name.split(".")[-2]
        if fused not in _ROPE_ROWS:
            return super().assemble(name, shards)
        w = shards[0]
        if not isinstance(w, torch.Tensor):
            w = w.dequantize()
        return self.deinterleave_rope(fused, w) if self.config.extra.get("rope_interleave") else w

    def deinterleave_rope(self, fused: str, w: torch.Tensor) -> torch.Tensor:
        """Rows of each rotary block from pairs (x0, x1), (x2, x3), .. to evens then odds."""
        m, rope = self.config.mla, self.config.mla.qk_rope_head_dim
        order = torch.cat([torch.arange(0, rope, 2), torch.arange(1, rope, 2)])
        if fused == "kv_a_proj_with_mqa":
            return torch.cat([w[:m.kv_lora_rank], w[m.kv_lora_rank:][order]])
        heads = w.view(self.config.num_heads, m.qk_nope_head_dim + rope, *w.shape[1:])
        return torch.cat([heads[:, :m.qk_nope_head_dim], heads[:, m.qk_nope_head_dim:][:, order]], 1).flatten(0, 1)
