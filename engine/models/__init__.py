"""Model families, one file each, behind this registry (torch-free: config.py reads the names;
a family's module, which imports torch, is loaded on first use).

    layers.py     the shared blocks: RMSNorm, Attention (GQA, optional bias and q/k norm),
                  MLP, DecoderLayer, AttentionMetadata
    moe.py        the MoE block (router, experts, Qwen2-MoE's shared expert), expert stacking
    base.py       CausalLM: the decoder and the hooks a family overrides (config fields,
                  MLP/layer, checkpoint names, fused and stacked shards)
    llama.py      Llama 2/3, Mistral, Qwen2, Qwen3
    mixtral.py    Mixtral
    qwen_moe.py   Qwen2-MoE, Qwen3-MoE
    deepseek.py   DeepSeek-V3 / R1, Kimi K2: multi-head latent attention, its MoE
    gemma3.py     Gemma 3 (text): local (sliding) and global layers, Gemma's norms
    glm4_moe.py   GLM-4.5 MoE (partial rotary, DeepSeek-style routing, shared experts)
    minimax_m2.py MiniMax-M2 (q/k norm over the whole projection, sigmoid routing)
    gpt_oss.py    GPT-OSS (sinks, alternating sliding windows, biased experts, clamped SwiGLU)

A new family: one file with a CausalLM subclass (kernels only where it needs a new op), and
its architectures' lines in ARCHITECTURES below.
"""
from __future__ import annotations

import importlib

# Hugging Face architecture -> (its config.json model_type, "module:class" under engine/models)
ARCHITECTURES = {
    "LlamaForCausalLM": ("llama", "llama:LlamaForCausalLM"),
    "MistralForCausalLM": ("mistral", "llama:LlamaForCausalLM"),
    "Qwen2ForCausalLM": ("qwen2", "llama:LlamaForCausalLM"),
    "Qwen3ForCausalLM": ("qwen3", "llama:LlamaForCausalLM"),
    "MixtralForCausalLM": ("mixtral", "mixtral:MixtralForCausalLM"),
    "Qwen2MoeForCausalLM": ("qwen2_moe", "qwen_moe:QwenMoeForCausalLM"),
    "Qwen3MoeForCausalLM": ("qwen3_moe", "qwen_moe:QwenMoeForCausalLM"),
    "DeepseekV3ForCausalLM": ("deepseek_v3", "deepseek:DeepseekV3ForCausalLM"),
    "Gemma3ForCausalLM": ("gemma3_text", "gemma3:Gemma3ForCausalLM"),
    "Glm4MoeForCausalLM": ("glm4_moe", "glm4_moe:Glm4MoeForCausalLM"),
    "MiniMaxM2ForCausalLM": ("minimax_m2", "minimax_m2:MiniMaxM2ForCausalLM"),
    "GptOssForCausalLM": ("gpt_oss", "gpt_oss:GptOssForCausalLM"),
}
SUPPORTED_ARCHITECTURES = {arch: kind for arch, (kind, _) in ARCHITECTURES.items()}


def model_class(architecture: str):
    """The CausalLM subclass that implements `architecture`."""
    if architecture not in ARCHITECTURES:
        raise ValueError(f"unsupported architecture {architecture!r}: supported are {sorted(ARCHITECTURES)}")
    module, _, cls = ARCHITECTURES[architecture][1].partition(":")
    return getattr(importlib.import_module(f"{__name__}.{module}"), cls)


def build(config, backend: str = "auto"):
    """The (random-initialised) model of `config` (engine.config.ModelConfig)."""
    return model_class(config.architecture)(config, backend)
