"""GPT-OSS (openai/gpt-oss-20b, gpt-oss-120b): the pre-norm decoder with

    attention  q/k/v/o projections with biases (attention_bias); a learned logit per head
               joining every softmax's denominator (`self_attn.sinks`, ModelConfig.
               attention_sinks); layers alternating a sliding window and full attention
               (layer_types: by default the even layers windowed); YaRN rope (the cos/sin
               table carries its attention factor, engine/kernels/rope.py)
    MoE        in every layer: router = Linear with bias over the experts; the top-k of the
               raw logits, softmax over those k only (transformers' GptOssTopKRouter);
               experts with biases and a clamped SwiGLU (engine.kernels.fused_moe with
               w13_bias / w2_bias / swiglu):
                   g = min(gate, limit); u = clamp(up, -limit, limit)
                   out = (u + 1) * g * sigmoid(alpha * g)        alpha 1.702, limit 7.0

Its checkpoint stores each layer's experts stacked and transposed, gate and up interleaved:

    mlp.experts.gate_up_proj       [E, H, 2I]  columns g0 u0 g1 u1 ...  -> ours [E, 2I, H]
    mlp.experts.gate_up_proj_bias  [E, 2I]     the same interleave      -> ours [E, 2I]
    mlp.experts.down_proj          [E, I, H]                            -> ours [E, H, I]
    mlp.experts.down_proj_bias     [E, H]
    mlp.router.weight / .bias      [E, H] / [E]

so `assemble` transposes and splits gate from up (rows: all gates, then all ups), once, at
load: the experts then run the same fused kernel as Mixtral's, biases and activation added.
OpenAI's own checkpoints store the experts as MXFP4 (quantization_config quant_method
"mxfp4"), which engine/quant does not read: loading one is a ValueError naming the method
(engine/quant/checkpoint.py); a bf16 checkpoint (or --quantization of one) works.
"""
from __future__ import annotations

import torch
from torch import nn

import engine.kernels as K
from engine.config import ModelConfig, MoeConfig

from .base import CausalLM
from .layers import Attention, DecoderLayer
from .moe import Experts

LAYER_TYPES = ("sliding_attention", "full_attention")


def topk_softmax(router_logits: torch.Tensor, top_k: int):
    """[T, E] logits -> (weights [T, k] fp32, expert ids [T, k] int64): the k largest logits,
    softmax over those k (GptOssTopKRouter; the weights sum to 1 by construction)."""
    top, ids = torch.topk(router_logits, top_k, dim=-1)
    return torch.softmax(top.float(), dim=-1), ids


class GptOssAttention(Attention):
    """layers.Attention (window and sinks by layer) with a bias on the output projection."""

    def __init__(self, c: ModelConfig, backend: str, layer: int):
        super().__init__(c, backend, layer)
        self.o_proj = nn.Linear(self.q_size, c.hidden_size, bias=c.qkv_bias)


class GptOssExperts(Experts):
    """moe.Experts (gate_up_proj [E, 2I, H] gate rows then up rows, down_proj [E, H, I]) and
    their biases."""

    def __init__(self, num_experts: int, hidden: int, intermediate: int):
        super().__init__(num_experts, hidden, intermediate)
        self.gate_up_proj_bias = nn.Parameter(torch.empty(num_experts, 2 * intermediate))
        self.down_proj_bias = nn.Parameter(torch.empty(num_experts, hidden))


class GptOssMoeBlock(nn.Module):
    """router -> topk_softmax -> the experts (fused_moe; with --quantization engine.quant's
    QuantExperts, which takes the biases and `swiglu` too)."""

    def __init__(self, c: ModelConfig, backend: str):
        super().__init__()
        m = c.moe
        self.backend, self.top_k = backend, m.top_k
        self.swiglu = (c.extra["swiglu_alpha"], c.extra["swiglu_limit"])     # (alpha, limit)
        self.router = nn.Linear(c.hidden_size, m.num_experts, bias=True)
        self.experts = GptOssExperts(m.num_experts, c.hidden_size, m.intermediate_size)

    def forward(self, x):
        weights, ids = topk_softmax(self.router(x), self.top_k)
        e = self.experts
        if isinstance(e, GptOssExperts):
            return K.fused_moe(x, e.gate_up_proj, e.down_proj, weights, ids, w13_bias=e.gate_up_proj_bias,
                               w2_bias=e.down_proj_bias, swiglu=self.swiglu, backend=self.backend)
        return e(x, weights, ids)      # quantized: engine.quant.linear.QuantExperts


def _positive(c: dict, key: str, default: float, path) -> float:
    value = c.get(key, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
        raise ValueError(f"{key} in {path} must be a positive number, got {value!r}")
    return float(value)


class GptOssForCausalLM(CausalLM):
    @classmethod
    def config_fields(cls, kind: str, c: dict, path) -> dict:
        n = c["num_hidden_layers"]
        moe = MoeConfig.checked(path, num_experts=c["num_local_experts"], top_k=c["num_experts_per_tok"],
                                intermediate_size=c["intermediate_size"], norm_topk_prob=True,
                                shared_intermediate_size=0, sparse_layers=list(range(n)))
        # transformers' default: layer i windowed when i is even
        types = c.get("layer_types") or [LAYER_TYPES[i % 2] for i in range(n)]
        if len(types) != n or set(types) - set(LAYER_TYPES):
            raise ValueError(f"layer_types in {path} must give one of {LAYER_TYPES} for each of "
                             f"the {n} layers, got {types!r}")
        window = c.get("sliding_window")
        if window is not None and (not isinstance(window, int) or window < 1):
            raise ValueError(f"sliding_window in {path} must be a positive integer, got {window!r}")
        extra = dict(swiglu_alpha=_positive(c, "swiglu_alpha", 1.702, path),
                     swiglu_limit=_positive(c, "swiglu_limit", 7.0, path))
        return dict(qkv_bias=bool(c.get("attention_bias", True)), qk_norm=False, moe=moe,
                    sliding_window=window, layer_types=list(types), attention_sinks=True,
                    extra=extra)

    def make_layer(self, c: ModelConfig, layer: int) -> nn.Module:
        return DecoderLayer(c, self.backend, GptOssMoeBlock(c, self.backend),
                            attention=GptOssAttention(c, self.backend, layer))

    def moe_blocks(self) -> list[GptOssMoeBlock]:
        return [m for m in self.layers.modules() if isinstance(m, GptOssMoeBlock)]

    def checkpoint_name(self, name: str):
        # the stored-transposed expert tensors go through assemble (shard 0: the whole tensor)
        if name.endswith((".experts.gate_up_proj", ".experts.gate_up_proj_bias", ".experts.down_proj")):
            return name, 0
        return super().checkpoint_name(name)

    def assemble(self, name: str, shards: dict):
        """The checkpoint's expert layout -> ours (module docstring); the rest as CausalLM."""
        if name.endswith((".experts.gate_up_proj", ".experts.down_proj")) and shards[0].dim() != 3:
            raise ValueError(f"checkpoint tensor {name!r} has shape {tuple(shards[0].shape)}: GPT-OSS "
                             "stores each layer's experts stacked, [E, H, 2I] and [E, I, H]")
        if name.endswith(".experts.gate_up_proj"):         # [E, H, 2I] interleaved -> [E, 2I, H]
            w = shards[0].transpose(1, 2)
            return torch.cat((w[:, 0::2], w[:, 1::2]), dim=1).contiguous()
        if name.endswith(".experts.gate_up_proj_bias"):    # [E, 2I] interleaved -> gates, ups
            b = shards[0]
            return torch.cat((b[:, 0::2], b[:, 1::2]), dim=1).contiguous()
        if name.endswith(".experts.down_proj"):            # [E, I, H] -> [E, H, I]
            return shards[0].transpose(1, 2).contiguous()
        return super().assemble(name, shards)
