"""The rotary cos/sin cache, computed in fp32 exactly as Hugging Face computes inv_freq.

Used by both the CPU path and the Triton rotary kernel (which only reads the cache), so the
llama3 and linear frequency rescalings live here and nowhere else.
"""
from __future__ import annotations

import math

import torch


def default_inv_freq(head_dim: int, base: float) -> torch.Tensor:
    """HF `_compute_default_rope_parameters`: 1 / base^(2i/d), i = 0..d/2-1, fp32. [D/2]"""
    return 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))


def llama3_inv_freq(inv_freq: torch.Tensor, rope_scaling: dict) -> torch.Tensor:
    """HF `_compute_llama3_parameters`: long wavelengths are slowed by `factor`, short ones
    kept, the band in between interpolated smoothly."""
    factor = rope_scaling["factor"]
    low_freq_factor = rope_scaling["low_freq_factor"]
    high_freq_factor = rope_scaling["high_freq_factor"]
    old_context_len = rope_scaling["original_max_position_embeddings"]
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(medium, smoothed, scaled)


def rope_type(rope_scaling: dict | None) -> str:
    if not rope_scaling:
        return "default"
    return rope_scaling.get("rope_type", rope_scaling.get("type", "default"))


def build_cos_sin_cache(head_dim: int, max_pos: int, base: float, rope_scaling: dict | None = None,
                        device: torch.device | str | None = None) -> torch.Tensor:
    """[max_pos, head_dim] fp32 = cat(cos(p * inv_freq), sin(p * inv_freq)) per position p.

    `rope_scaling` is the HF config dict: None or rope_type "default" -> plain frequencies;
    "llama3" -> Llama 3.1 scaling (its attention factor is 1.0); "linear" -> every frequency
    divided by `factor` (position interpolation, Gemma 3 4B+). Anything else raises.
    """
    if head_dim % 2:
        raise ValueError(f"rotary head_dim must be even, got {head_dim}")
    kind = rope_type(rope_scaling)
    inv_freq = default_inv_freq(head_dim, base)
    if kind == "llama3":
        inv_freq = llama3_inv_freq(inv_freq, rope_scaling)
    elif kind == "linear":
        inv_freq = inv_freq / rope_scaling["factor"]          # HF: inv_freq /= factor, fp32
    elif kind != "default":
        raise NotImplementedError(f"rope_scaling type {kind!r} is not supported (default, llama3, linear)")
    # HF: freqs = inv_freq[:, None] @ position_ids[None, :] in fp32; one product per element,
    # so an outer product rounds identically.
    freqs = torch.outer(torch.arange(max_pos, dtype=torch.int64).float(), inv_freq)   # [P, D/2]
    return torch.cat((freqs.cos(), freqs.sin()), dim=-1).to(device)
