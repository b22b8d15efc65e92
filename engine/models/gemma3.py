"""Gemma 3, text only (`Gemma3ForCausalLM`, model_type gemma3_text): local and global layers.

What differs from the Llama decoder, each where it lives:

  * sliding-window ("sliding_attention") layers and full ("full_attention") layers, named per
    layer by layer_types (older configs: every sliding_window_pattern-th layer is global);
    each kind has its own rotary table: the local layers rope_local_base_freq (10k), the
    global ones rope_theta (1M) with their own scaling ("linear" from 4B up). transformers 5
    writes both under rope_parameters keyed by layer type. One [2, P, D] buffer holds them.
  * RMSNorm as x * (1 + w): the +1 is folded into every norm weight at load
    (checkpoint_name marks them, assemble adds it), so the ordinary rms_norm op runs. The
    sum is made in float32; in a 16-bit model the folded weight is then rounded once, where
    transformers keeps (1 + w) in float32 (outputs within that rounding).
  * four norms per layer: input -> attention -> post_attention, added to the residual;
    pre_feedforward -> MLP -> post_feedforward, added to the residual;
  * per-head q/k norm (as Qwen3), attention scale query_pre_attn_scalar ** -0.5;
  * the embedding scaled by sqrt(hidden_size), the factor rounded to the model dtype first
    (as transformers does: 55.5, not 55.43, in bfloat16);
  * the gated MLP's activation gelu_pytorch_tanh (engine.kernels.gelu_tanh_and_mul);
  * tied embeddings.

Refused with a ValueError naming config.json: logit soft-capping (Gemma 2's, which Gemma 3
configs leave unset), bidirectional attention, any other activation or rope type.
"""
from __future__ import annotations

import functools
from typing import Callable

import torch

import engine.kernels as K
from engine.config import ModelConfig
from engine.kernels.rope import build_cos_sin_cache

from .base import CausalLM
from .layers import MLP, AttentionMetadata, DecoderLayer, RMSNorm, input_dtype

PLUS_ONE = "plus_one"           # the shard key of a norm weight stored as w of (1 + w)
ROPE_TYPES = ("default", "linear")
TYPES = ("full_attention", "sliding_attention")     # the rotary table index of each kind


def _rope_parameters(c: dict, path) -> dict:
    """{layer type: {rope_type, rope_theta, factor?}}: transformers 5's rope_parameters, or
    the older rope_theta / rope_local_base_freq / rope_scaling."""
    rp = c.get("rope_parameters") or {}
    if "full_attention" not in rp:
        rp = {"full_attention": dict(c.get("rope_scaling") or {}, rope_theta=c.get("rope_theta", 1e6)),
              "sliding_attention": dict(rope_theta=c.get("rope_local_base_freq", 1e4))}
    out = {}
    for kind in TYPES:
        p = dict(rp.get(kind) or {})
        p.setdefault("rope_type", p.get("type", "default"))
        if p["rope_type"] not in ROPE_TYPES:
            raise ValueError(f"unsupported rope type {p['rope_type']!r} for {kind} layers in "
                             f"{path}: supported are {ROPE_TYPES}")
        if p["rope_type"] == "linear" and "factor" not in p:
            raise ValueError(f"linear rope scaling without a factor for {kind} layers in {path}")
        p.setdefault("rope_theta", 1e6 if kind == "full_attention" else 1e4)
        out[kind] = p
    return out


def _refuse(c: dict, path) -> None:
    for name in ("attn_logit_softcapping", "final_logit_softcapping"):
        if c.get(name) is not None:
            raise ValueError(f"unsupported {name} {c[name]!r} in {path}: Gemma 3 leaves it unset")
    if c.get("use_bidirectional_attention"):
        raise ValueError(f"unsupported use_bidirectional_attention in {path}: causal only")
    act = c.get("hidden_activation") or c.get("hidden_act") or "gelu_pytorch_tanh"
    if act != "gelu_pytorch_tanh":
        raise ValueError(f"unsupported hidden_activation {act!r} in {path}: gelu_pytorch_tanh only")


@functools.cache
def _rounded(x: float, dtype: torch.dtype) -> float:
    """x as `dtype` holds it (a host float: no device tensor, so CUDA graphs capture it)."""
    return torch.tensor(x, dtype=dtype).item()


class GeluMLP(MLP):
    """The gated MLP with gelu_tanh(gate) * up."""

    def forward(self, x):
        h = K.gelu_tanh_and_mul(self.gate_up_proj(x), backend=self.backend)
        want = input_dtype(self.down_proj)
        return self.down_proj(h if want is None else h.to(want))


class Gemma3DecoderLayer(DecoderLayer):
    """h -> h + post_attention(attn(input(h))) -> h + post_feedforward(mlp(pre_feedforward(h))),
    the residual adds fused into the input and pre_feedforward norms (the layer returns the
    MLP's normed output and the residual stream; the next norm adds them)."""

    def __init__(self, c: ModelConfig, backend: str, layer: int):
        super().__init__(c, backend, GeluMLP(c, backend), layer=layer)
        self.local = c.layer_types[layer] == "sliding_attention"
        self.self_attn.scale = c.extra["query_pre_attn_scalar"] ** -0.5
        self.pre_feedforward_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps, backend)
        self.post_feedforward_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps, backend)

    def forward(self, positions, h, residual, meta, cos_sin, rope_rows=None):
        h, residual = self.attend(positions, h, residual, meta, cos_sin, rope_rows)
        h = self.post_attention_layernorm(h)
        h, residual = self.pre_feedforward_layernorm(h, residual, input_dtype(self.mlp))
        return self.post_feedforward_layernorm(self.mlp(h)), residual


class Gemma3ForCausalLM(CausalLM):
    @classmethod
    def config_fields(cls, kind: str, c: dict, path) -> dict:
        _refuse(c, path)
        n, pattern = c["num_hidden_layers"], c.get("sliding_window_pattern", 6)
        types = c.get("layer_types") or ["sliding_attention" if (i + 1) % pattern else "full_attention"
                                         for i in range(n)]
        return dict(qkv_bias=bool(c.get("attention_bias", False)), qk_norm=True,
                    sliding_window=c.get("sliding_window"), layer_types=types,
                    hidden_act="gelu_pytorch_tanh",
                    extra=dict(rope=_rope_parameters(c, path),
                               query_pre_attn_scalar=float(c.get("query_pre_attn_scalar", 256))))

    def make_layer(self, c: ModelConfig, layer: int):
        return Gemma3DecoderLayer(c, self.backend, layer)

    def checkpoint_name(self, name: str):
        if name.endswith("norm.weight"):
            return name, PLUS_ONE
        return super().checkpoint_name(name)

    def assemble(self, name: str, shards: dict):
        if PLUS_ONE in shards:
            return shards[PLUS_ONE].float() + 1.0
        return super().assemble(name, shards)

    def rotary_table(self, device=None) -> torch.Tensor:
        """[2, P, D]: the global layers' table, then the local layers'."""
        c, rope = self.config, self.config.extra["rope"]
        return torch.stack([build_cos_sin_cache(c.head_dim, c.max_model_len + 1, rope[t]["rope_theta"],
                                                rope[t], device) for t in TYPES])

    def forward(self, input_ids, positions, meta: AttentionMetadata,
                layer_hook: Callable[[int], None] | None = None) -> torch.Tensor:
        h = self.embed_tokens(input_ids)
        h, residual = h * _rounded(self.config.hidden_size ** 0.5, h.dtype), None
        tables = (self.cos_sin[0], self.cos_sin[1])
        rows = [K.rope_rows(positions, t, backend=self.backend) for t in tables]
        for i, layer in enumerate(self.layers):
            h, residual = layer(positions, h, residual, meta, tables[layer.local], rows[layer.local])
            if layer_hook is not None:
                layer_hook(i)
        h, _ = self.norm(h, residual)
        return h
