"""A tiny random GPT-OSS built with transformers and saved with `save_pretrained`: the real
structure (q/k/v/o biases, sinks, layers alternating a window of 8 and full attention, YaRN,
8 experts top-2 with biases and the clamped SwiGLU), small enough for a CPU test."""
from __future__ import annotations

from pathlib import Path

import torch

GPT_OSS = dict(vocab_size=512, hidden_size=64, intermediate_size=32, num_hidden_layers=4,
               num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=8,
               num_local_experts=8, num_experts_per_tok=2, max_position_embeddings=512,
               initializer_range=0.15, bos_token_id=1, eos_token_id=None, pad_token_id=0,
               # a short pre-yarn context, so the prompts reach both the interpolated and the
               # extrapolated frequencies; attention factor 1 + 0.1 ln 8
               rope_parameters=dict(rope_type="yarn", rope_theta=150000.0, factor=8.0,
                                    beta_fast=32.0, beta_slow=1.0, truncate=False,
                                    original_max_position_embeddings=64))


def make_gpt_oss(out: Path, **overrides) -> Path:
    """GptOssForCausalLM of GPT_OSS (+ overrides), float32, saved in `out`. Biases (zero at
    init), norms and sinks are perturbed so that each of them changes the output."""
    import transformers as T
    cfg = T.GptOssConfig(**{**GPT_OSS, **overrides})
    torch.manual_seed(0)
    model = T.GptOssForCausalLM(cfg).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("sinks"):
                p.copy_(torch.randn_like(p) * 1.5)
            elif name.endswith("bias") or "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
    model.save_pretrained(out)
    return out


def make_gpt_oss_model(kind: str, out: Path, **overrides) -> Path:
    """tests/golden.py's builder signature (`kind` is "gpt_oss")."""
    assert kind == "gpt_oss", kind
    return make_gpt_oss(out, **overrides)
