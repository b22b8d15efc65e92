"""Rotary-embedding tables (default and llama3 scaling), computed as Hugging Face does, in fp32."""
from __future__ import annotations

import math

import torch


def inv_freq(head_dim: int, base: float, rope_scaling: dict | None = None) -> torch.Tensor:
    inv = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if not rope_scaling:
        return inv
    # llama3: long wavelengths slowed by `factor`, short ones kept, a smooth ramp between.
    factor = rope_scaling["factor"]
    lo, hi = rope_scaling["low_freq_factor"], rope_scaling["high_freq_factor"]
    old_len = rope_scaling["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > old_len / lo, inv / factor, inv)
    smooth = (old_len / wavelen - lo) / (hi - lo)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < old_len / hi) * ~(wavelen > old_len / lo)
    return torch.where(medium, smoothed, scaled)


def build_cos_sin_cache(head_dim: int, max_pos: int, base: float,
                        rope_scaling: dict | None = None, device="cpu") -> torch.Tensor:
    """[max_pos, head_dim] fp32 = cat(cos, sin) of position * inv_freq (head_dim/2 each)."""
    freqs = torch.outer(torch.arange(max_pos, dtype=torch.float32), inv_freq(head_dim, base, rope_scaling))
    return torch.cat((freqs.cos(), freqs.sin()), dim=-1).to(device)
