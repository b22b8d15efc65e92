"""The blocks decoder models are built from: norms, attention over the paged KV cache, the
gated MLP, and the pre-norm decoder layer that joins them (the MoE block: moe.py).

Every block takes a flat, ragged batch: every scheduled token of every request in one [T]
row, with `AttentionMetadata` saying where each request's queries start, how long its
context is, and which cache slot each new token's K/V goes to. Each block keeps the model's
kernel `backend` and hands it to every op of engine.kernels (base.CausalLM.set_backend).

The blocks call each other's `forward` directly, not through nn.Module.__call__ (its hook
machinery costs ~1.5 us a call, a dozen calls a layer: ~4% of a one-row decode step on
CPU), and CausalLM.forward calls each layer's: forward hooks on the blocks inside a model
are not run (hooks on the model itself are).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

import engine.kernels as K
from engine.config import ModelConfig


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor      # [T] int64, cache slot of each new token (-1: skip)
    block_tables: torch.Tensor      # [B, max_blocks] int32
    context_lens: torch.Tensor      # [B] int32, tokens in cache after this step
    cu_seqlens_q: torch.Tensor      # [B + 1] int32
    max_q_len: int
    max_context_len: int

    @property
    def decode_only(self) -> bool:
        return self.max_q_len == 1


def input_dtype(block: nn.Module | None) -> torch.dtype | None:
    """The dtype `block` (a linear layer, or a block whose first op is one) multiplies in
    when it is not the activations' (engine.quant's CPU int8 / int4 layers: bfloat16): the
    op before it writes that dtype where it can."""
    return getattr(block, "input_dtype", None)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, backend: str):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps, self.backend = eps, backend

    def forward(self, x, residual=None, out_dtype=None):
        return K.rms_norm(x, self.weight, self.eps, residual, out_dtype=out_dtype, backend=self.backend)


class Attention(nn.Module):
    """Grouped-query attention with fused q/k/v rows (`qkv_proj`), an optional bias and
    optional per-head RMSNorm of q and k (Qwen3), rotary on q and k, K/V written to the paged
    cache; decode and prefill kernels by the batch's shape. `layer`'s sliding window
    (ModelConfig.layer_window) and, with ModelConfig.attention_sinks, a learned logit per
    head in every softmax (`sinks`, GPT-OSS) go to both kernels."""

    def __init__(self, c: ModelConfig, backend: str, layer: int | None = None):
        super().__init__()
        if layer is None and c.layer_types is not None:
            raise ValueError("Attention of a model with layer_types needs its layer index")
        self.backend = backend
        self.window = c.layer_window(layer or 0)
        self.sinks = nn.Parameter(torch.zeros(c.num_heads)) if c.attention_sinks else None
        self.nh, self.nkv, self.hd = c.num_heads, c.num_kv_heads, c.head_dim
        self.q_size, self.kv_size = self.nh * self.hd, self.nkv * self.hd
        self.qkv_proj = nn.Linear(c.hidden_size, self.q_size + 2 * self.kv_size, bias=c.qkv_bias)
        self.o_proj = nn.Linear(self.q_size, c.hidden_size, bias=False)
        self.q_norm = RMSNorm(self.hd, c.rms_norm_eps, backend) if c.qk_norm else None
        self.k_norm = RMSNorm(self.hd, c.rms_norm_eps, backend) if c.qk_norm else None
        self.scale = self.hd ** -0.5
        self.k_cache = self.v_cache = None   # [num_blocks, block_size, nkv, hd], bound later
        self.k_scales = self.v_scales = None # [num_blocks, nkv] fp32 for an 8-bit cache
        self.k_shift = None                  # [nkv, hd] fp32: subtracted from K (8-bit cache)

    @property
    def input_dtype(self) -> torch.dtype | None:
        return input_dtype(self.qkv_proj)

    def bind_kv_cache(self, k_cache, v_cache, k_scales=None, v_scales=None) -> None:
        self.k_cache, self.v_cache, self.k_scales, self.v_scales = k_cache, v_cache, k_scales, v_scales

    def project(self, x) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [T, hidden] -> q [T, nh, hd], k and v [T, nkv, hd]: the fused projection, then
        the per-head q/k norm where the model has one (a family with another norm overrides
        this: minimax_m2.py)."""
        T = x.shape[0]
        # split_with_sizes: Tensor.split's Python wrapper costs 3x the op at decode sizes
        q, k, v = self.qkv_proj.forward(x).split_with_sizes([self.q_size, self.kv_size, self.kv_size], -1)
        q = q.view(T, self.nh, self.hd)
        k = k.view(T, self.nkv, self.hd)
        v = v.view(T, self.nkv, self.hd)
        if self.q_norm is not None:
            q, k = self.q_norm.forward(q), self.k_norm.forward(k)
        return q, k, v

    def forward(self, positions, x, meta: AttentionMetadata, cos_sin, rope_rows=None):
        T = x.shape[0]
        q, k, v = self.project(x)
        scales = dict(k_scales=self.k_scales, v_scales=self.v_scales, backend=self.backend)
        sinks = None if self.sinks is None else self.sinks.float()
        if meta.decode_only:           # rotary, the cache write and attention: one C call on CPU
            o = K.rope_decode_attention(positions, q, k, v, cos_sin, self.k_cache, self.v_cache,
                                        meta.slot_mapping, meta.block_tables, meta.context_lens,
                                        self.scale, max_context_len=meta.max_context_len,
                                        k_shift=self.k_shift, rows=rope_rows, window=self.window,
                                        sinks=sinks, out_dtype=input_dtype(self.o_proj), **scales)
        else:
            q = K.rotary_embedding_write_kv(positions, q, k, v, cos_sin, self.k_cache, self.v_cache,
                                            meta.slot_mapping, rows=rope_rows, k_shift=self.k_shift,
                                            **scales)
            o = K.paged_prefill_attention(q, self.k_cache, self.v_cache, meta.block_tables,
                                          meta.cu_seqlens_q, meta.context_lens, self.scale,
                                          max_q_len=meta.max_q_len, window=self.window,
                                          sinks=sinks, **scales)
        return self.o_proj.forward(o.reshape(T, self.q_size))


class MLP(nn.Module):
    """SiLU-gated MLP with fused gate and up rows (`gate_up_proj`)."""

    def __init__(self, c: ModelConfig, backend: str, intermediate_size: int | None = None):
        super().__init__()
        self.backend = backend
        inter = intermediate_size or c.intermediate_size
        self.gate_up_proj = nn.Linear(c.hidden_size, 2 * inter, bias=False)
        self.down_proj = nn.Linear(inter, c.hidden_size, bias=False)

    @property
    def input_dtype(self) -> torch.dtype | None:
        return input_dtype(self.gate_up_proj)

    def forward(self, x):
        down = self.down_proj
        return down.forward(K.silu_and_mul(self.gate_up_proj.forward(x), out_dtype=input_dtype(down),
                                           backend=self.backend))


class DecoderLayer(nn.Module):
    """Pre-norm: h += attn(norm(h)); h += mlp(norm(h)), the residual add fused into the norms."""

    def __init__(self, c: ModelConfig, backend: str, mlp: nn.Module, attention: nn.Module | None = None,
                 layer: int | None = None):
        super().__init__()
        self.self_attn = attention or Attention(c, backend, layer)
        self.mlp = mlp
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps, backend)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps, backend)

    def attend(self, positions, h, residual, meta, cos_sin, rope_rows):
        """(attention of input_layernorm(h + residual), the residual stream): the first layer
        gets no residual and starts it."""
        attn = self.self_attn
        wants = input_dtype(attn)
        if residual is None:
            residual, h = h, self.input_layernorm.forward(h, out_dtype=wants)
        else:
            h, residual = self.input_layernorm.forward(h, residual, wants)
        return attn.forward(positions, h, meta, cos_sin, rope_rows), residual

    def forward(self, positions, h, residual, meta, cos_sin, rope_rows=None):
        h, residual = self.attend(positions, h, residual, meta, cos_sin, rope_rows)
        mlp = self.mlp
        h, residual = self.post_attention_layernorm.forward(h, residual, input_dtype(mlp))
        return mlp.forward(h), residual
