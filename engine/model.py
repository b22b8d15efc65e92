"""Llama-family decoder (Llama 2/3, Mistral, Qwen2, Qwen3, and the MoE models Mixtral,
Qwen2-MoE, Qwen3-MoE, whose MoE block is engine/moe.py's) over a paged KV cache.

The forward pass takes a flat, ragged batch: every scheduled token of every request in one
[T] row, with `AttentionMetadata` saying where each request's queries start, how long its
context is, and which cache slot each new token's K/V goes to.

`backend` (auto | torch | triton) is the kernel backend this model's layers pass to every op
in engine.kernels: it belongs to the model, not to the process.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn

from . import kernels as K
from .config import ModelConfig, check_kernel_backend
from .kernels.rope import build_cos_sin_cache
from .moe import SparseMoeBlock

log = logging.getLogger(__name__)


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


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, backend: str):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps, self.backend = eps, backend

    def forward(self, x, residual=None, out_dtype=None):
        return K.rms_norm(x, self.weight, self.eps, residual, out_dtype=out_dtype, backend=self.backend)


def input_dtype(linear: nn.Module) -> torch.dtype | None:
    """The dtype `linear` multiplies in when it is not the activations' (engine.quant's CPU
    int8 / int4 layers: bfloat16): the op before it writes that dtype where it can."""
    return getattr(linear, "input_dtype", None)


class Attention(nn.Module):
    def __init__(self, c: ModelConfig, backend: str):
        super().__init__()
        self.backend = backend
        self.nh, self.nkv, self.hd = c.num_heads, c.num_kv_heads, c.head_dim
        self.q_size, self.kv_size = self.nh * self.hd, self.nkv * self.hd
        self.qkv_proj = nn.Linear(c.hidden_size, self.q_size + 2 * self.kv_size, bias=c.qkv_bias)
        self.o_proj = nn.Linear(self.q_size, c.hidden_size, bias=False)
        self.q_norm = RMSNorm(self.hd, c.rms_norm_eps, backend) if c.qk_norm else None
        self.k_norm = RMSNorm(self.hd, c.rms_norm_eps, backend) if c.qk_norm else None
        self.scale = self.hd ** -0.5
        self.k_cache = self.v_cache = None   # [num_blocks, block_size, nkv, hd], bound later
        self.k_scales = self.v_scales = None # [num_blocks, nkv] fp32 for an 8-bit cache

    def forward(self, positions, x, meta: AttentionMetadata, cos_sin, rope_rows=None):
        T = x.shape[0]
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(T, self.nh, self.hd)
        k = k.view(T, self.nkv, self.hd)
        v = v.view(T, self.nkv, self.hd)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        scales = dict(k_scales=self.k_scales, v_scales=self.v_scales, backend=self.backend)
        q = K.rotary_embedding_write_kv(positions, q, k, v, cos_sin, self.k_cache, self.v_cache,
                                        meta.slot_mapping, rows=rope_rows, **scales)
        if meta.decode_only:
            o = K.paged_decode_attention(q, self.k_cache, self.v_cache, meta.block_tables,
                                         meta.context_lens, self.scale,
                                         max_context_len=meta.max_context_len,
                                         out_dtype=input_dtype(self.o_proj), **scales)
        else:
            o = K.paged_prefill_attention(q, self.k_cache, self.v_cache, meta.block_tables,
                                          meta.cu_seqlens_q, meta.context_lens, self.scale,
                                          max_q_len=meta.max_q_len, **scales)
        return self.o_proj(o.reshape(T, self.q_size))


class MLP(nn.Module):
    def __init__(self, c: ModelConfig, backend: str, intermediate_size: int | None = None):
        super().__init__()
        self.backend = backend
        inter = intermediate_size or c.intermediate_size
        self.gate_up_proj = nn.Linear(c.hidden_size, 2 * inter, bias=False)
        self.down_proj = nn.Linear(inter, c.hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(K.silu_and_mul(self.gate_up_proj(x), out_dtype=input_dtype(self.down_proj),
                                             backend=self.backend))


def make_mlp(c: ModelConfig, layer: int, backend: str) -> nn.Module:
    """Layer `layer`'s MLP: dense, or an MoE block (with Qwen2-MoE's shared expert)."""
    if not c.is_moe_layer(layer):
        return MLP(c, backend)
    shared = c.moe.shared_intermediate_size
    return SparseMoeBlock(c, backend, MLP(c, backend, shared) if shared else None)


class DecoderLayer(nn.Module):
    def __init__(self, c: ModelConfig, backend: str, layer: int):
        super().__init__()
        self.self_attn = Attention(c, backend)
        self.mlp = make_mlp(c, layer, backend)
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps, backend)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps, backend)

    def forward(self, positions, h, residual, meta, cos_sin, rope_rows=None):
        wants = input_dtype(self.self_attn.qkv_proj)
        if residual is None:
            residual, h = h, self.input_layernorm(h, out_dtype=wants)
        else:
            h, residual = self.input_layernorm(h, residual, wants)
        h = self.self_attn(positions, h, meta, cos_sin, rope_rows)
        h, residual = self.post_attention_layernorm(h, residual, input_dtype(getattr(self.mlp, "gate_up_proj", None)))
        return self.mlp(h), residual


class CausalLM(nn.Module):
    def __init__(self, c: ModelConfig, backend: str = "auto"):
        super().__init__()
        self.config = c
        self.backend = check_kernel_backend(backend)
        # on the meta device (the loader's build, which then fills every tensor) nothing is
        # drawn or computed: torch's first meta normal_ and meta arithmetic cost ~1 s each
        meta = torch.empty(0).is_meta
        self.embed_tokens = nn.Embedding(c.vocab_size, c.hidden_size, _weight=torch.empty(
            c.vocab_size, c.hidden_size) if meta else None)
        self.layers = nn.ModuleList(DecoderLayer(c, backend, i) for i in range(c.num_layers))
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps, backend)
        self.lm_head = None if c.tie_word_embeddings else nn.Linear(c.hidden_size, c.vocab_size, bias=False)
        self.register_buffer("cos_sin", torch.empty(c.max_model_len + 1, c.head_dim) if meta else
                             build_cos_sin_cache(c.head_dim, c.max_model_len + 1, c.rope_theta,
                                                 c.rope_scaling), persistent=False)

    def bind_kv_cache(self, kv_cache: torch.Tensor, kv_scales: torch.Tensor | None = None) -> None:
        """kv_cache: [num_layers, 2, num_blocks, block_size, nkv, hd]; kv_scales [num_layers,
        2, num_blocks, nkv] fp32 when the cache is 8-bit; each layer keeps views.
        Here the backend is settled: on CPU, "auto" becomes "cpu" (the C kernels) for a
        float32 model and cache where they build; "cpu" asked for elsewhere is a ValueError."""
        asked = self.backend
        cpu_ok = (kv_cache.device.type == "cpu" and kv_cache.dtype == torch.float32
                  and self.norm.weight.dtype == torch.float32 and K.cpu.library() is not None)
        if self.backend == "cpu" and not cpu_ok:
            raise ValueError("kernel backend 'cpu' runs a float32 model with a float32 KV cache on "
                             "CPU, and needs a C compiler to build its kernels (engine/kernels/cpu.py)")
        if self.backend == "auto" and cpu_ok:
            for m in self.modules():            # every layer hands its backend to its ops
                if isinstance(vars(m).get("backend"), str):
                    m.backend = "cpu"
        if self.backend == "cpu":
            from .quant.linear import set_backend
            set_backend(self, "cpu")           # int8_g32 weights into cpu.c's layout
        log.info("kernel backend %s (asked: %s)", self.backend if self.backend != "auto" else
                 ("triton" if kv_cache.is_cuda else "torch"), asked)
        for i, layer in enumerate(self.layers):
            layer.self_attn.k_cache, layer.self_attn.v_cache = kv_cache[i, 0], kv_cache[i, 1]
            if kv_scales is not None:
                layer.self_attn.k_scales, layer.self_attn.v_scales = kv_scales[i, 0], kv_scales[i, 1]

    QUANTIZABLE = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")

    def quantizable_linears(self):
        """(parent, name, module) of each decoder linear a scheme may quantize: attention,
        dense MLPs and shared experts; routers and gates stay float."""
        for parent in self.layers.modules():
            for name in self.QUANTIZABLE:
                if isinstance(child := getattr(parent, name, None), nn.Module):
                    yield parent, name, child

    def moe_blocks(self):
        return [m for m in self.layers.modules() if isinstance(m, SparseMoeBlock)]

    def forward(self, input_ids, positions, meta: AttentionMetadata,
                layer_hook: Callable[[int], None] | None = None) -> torch.Tensor:
        """[T] ids -> [T, hidden] final hidden states. `layer_hook(i)` runs once layer i's KV
        is in the cache (the prefill worker ships it while later layers compute)."""
        h, residual = self.embed_tokens(input_ids), None
        rows = K.rope_rows(positions, self.cos_sin, backend=self.backend)     # once, every layer
        for i, layer in enumerate(self.layers):
            h, residual = layer(positions, h, residual, meta, self.cos_sin, rows)
            if layer_hook is not None:
                layer_hook(i)
        h, _ = self.norm(h, residual)
        return h

    def compute_logits(self, h: torch.Tensor) -> torch.Tensor:
        if self.lm_head is None:
            return nn.functional.linear(h, self.embed_tokens.weight).float()
        return self.lm_head(h).float()      # nn.Linear, or engine.quant's QuantLinear
