"""The rotary cos/sin cache, computed in fp32 exactly as Hugging Face computes inv_freq.

Used by both the CPU path and the Triton rotary kernel (which only reads the cache), so the
llama3, linear and YaRN frequency rescalings live here and nowhere else. YaRN also scales
attention: transformers multiplies cos and sin by its attention factor (so q.k by its square),
and so does this table; the kernels see nothing new.
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


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    """YaRN's attention temperature for a context stretched `scale` times (1 when not
    stretched). DeepSeek-V3 also scales its softmax by yarn_mscale(factor, mscale_all_dim)^2."""
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def yarn_parameters(dim: int, base: float, rope_scaling: dict) -> tuple[torch.Tensor, float]:
    """HF `_compute_yarn_parameters` -> (inv_freq [dim/2] fp32, attention factor).

    Frequencies that turn more than beta_fast times over the original context keep their
    value (extrapolation), those turning fewer than beta_slow times are divided by `factor`
    (interpolation), the dimensions in between blend linearly. `rope_scaling` must hold
    `factor` and `original_max_position_embeddings` (engine.config fills both from
    config.json as transformers does); `attention_factor` unset: yarn_mscale(factor, mscale) /
    yarn_mscale(factor, mscale_all_dim) when both are set, else yarn_mscale(factor)."""
    try:
        factor = float(rope_scaling["factor"])
        orig = rope_scaling["original_max_position_embeddings"]
    except KeyError as e:
        raise ValueError(f"yarn rope scaling needs {e.args[0]!r}") from None
    attention_factor = rope_scaling.get("attention_factor")
    mscale, mscale_all_dim = rope_scaling.get("mscale"), rope_scaling.get("mscale_all_dim")
    if attention_factor is None:
        if mscale and mscale_all_dim:
            attention_factor = float(yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all_dim))
        else:
            attention_factor = yarn_mscale(factor)
    beta_fast = rope_scaling.get("beta_fast") or 32
    beta_slow = rope_scaling.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:    # the dimension turning `rotations` times
        return (dim * math.log(orig / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if rope_scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001       # as HF: no zero-width ramp
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    # the same operations in the same order as HF, so the table matches it bit for bit
    pos_freqs = base ** (torch.arange(0, dim, 2).to(dtype=torch.float) / dim)
    extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (factor * pos_freqs)
    keep = 1 - ramp         # 1: the extrapolated (original) frequency, 0: the interpolated one
    return interpolation * (1 - keep) + extrapolation * keep, attention_factor


def rope_type(rope_scaling: dict | None) -> str:
    if not rope_scaling:
        return "default"
    return rope_scaling.get("rope_type", rope_scaling.get("type", "default"))


def build_cos_sin_cache(head_dim: int, max_pos: int, base: float, rope_scaling: dict | None = None,
                        device: torch.device | str | None = None) -> torch.Tensor:
    """[max_pos, head_dim] fp32 = cat(cos(p * inv_freq), sin(p * inv_freq)) per position p.

    `rope_scaling` is the HF config dict: None or rope_type "default" -> plain frequencies;
    "llama3" -> Llama 3.1 scaling (its attention factor is 1.0); "linear" -> every frequency
    divided by `factor` (position interpolation, Gemma 3 4B+); "yarn" -> YaRN's frequencies,
    cos and sin times its attention factor (yarn_parameters). Anything else raises.
    """
    if head_dim % 2:
        raise ValueError(f"rotary head_dim must be even, got {head_dim}")
    kind = rope_type(rope_scaling)
    inv_freq, attention_factor = default_inv_freq(head_dim, base), 1.0
    if kind == "llama3":
        inv_freq = llama3_inv_freq(inv_freq, rope_scaling)
    elif kind == "linear":
        inv_freq = inv_freq / rope_scaling["factor"]          # HF: inv_freq /= factor, fp32
    elif kind == "yarn":
        inv_freq, attention_factor = yarn_parameters(head_dim, base, rope_scaling)
    elif kind != "default":
        raise NotImplementedError(f"rope_scaling type {kind!r} is not supported (default, llama3, "
                                  "linear, yarn)")
    # HF: freqs = inv_freq[:, None] @ position_ids[None, :] in fp32; one product per element,
    # so an outer product rounds identically.
    freqs = torch.outer(torch.arange(max_pos, dtype=torch.int64).float(), inv_freq)   # [P, D/2]
    cos, sin = freqs.cos(), freqs.sin()
    if attention_factor != 1.0:     # HF: emb.cos() * attention_scaling, in fp32
        cos, sin = cos * attention_factor, sin * attention_factor
    return torch.cat((cos, sin), dim=-1).to(device)
