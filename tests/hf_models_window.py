"""Tiny random Hugging Face models with sliding windows (Mistral, Qwen2 with layer_types) and
Gemma 3, saved with `save_pretrained`; the initialisation of tests/hf_models.make_hf_model
(norm weights and biases perturbed so that they matter)."""
from __future__ import annotations

from pathlib import Path

import torch

from tests.hf_models import COMMON

WINDOW = 8
GEMMA3 = dict(COMMON, num_hidden_layers=5, head_dim=16, query_pre_attn_scalar=24,
              sliding_window=WINDOW, tie_word_embeddings=True,
              layer_types=["sliding_attention", "sliding_attention", "full_attention",
                           "sliding_attention", "full_attention"],
              rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                               "full_attention": {"rope_type": "linear", "factor": 4.0,
                                                  "rope_theta": 1000000.0}})


def make_window_model(kind: str, out: Path, **overrides) -> Path:
    """kind: mistral-window (every layer windowed, WINDOW tokens) | qwen2-window (layers from
    max_window_layers=1 on windowed, as Qwen2's layer_types says) | gemma3_text (local and global
    layers, linear rope scaling on the global ones)."""
    import transformers as T
    if kind == "mistral-window":
        cfg, cls = T.MistralConfig(**dict(COMMON, sliding_window=WINDOW, **overrides)), T.MistralForCausalLM
    elif kind == "qwen2-window":
        cfg = T.Qwen2Config(**dict(COMMON, use_sliding_window=True, sliding_window=WINDOW,
                                   max_window_layers=1, **overrides))
        cls = T.Qwen2ForCausalLM
    elif kind == "gemma3_text":
        cfg, cls = T.Gemma3TextConfig(**dict(GEMMA3, **overrides)), T.Gemma3ForCausalLM
    else:
        raise ValueError(kind)
    torch.manual_seed(0)
    model = cls(cfg).float().eval()
    with torch.no_grad():   # biases are zero-initialised, Gemma's norms too: make them matter
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
    model.save_pretrained(out)
    return out
