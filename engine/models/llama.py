"""The Llama family: Llama 2/3, Mistral, Qwen2 (q/k/v biases) and Qwen3 (per-head q/k
RMSNorm). One decoder (base.CausalLM with layers.py's blocks); the members differ only in
config.json fields, read here."""
from __future__ import annotations

from .base import CausalLM, layer_types


class LlamaForCausalLM(CausalLM):
    @classmethod
    def config_fields(cls, kind: str, c: dict, path) -> dict:
        # Mistral's sliding window is on unless use_sliding_window says otherwise, on every
        # layer; Qwen2's and Qwen3's off, else on the layers layer_types names (transformers:
        # those from max_window_layers on)
        sliding = c.get("use_sliding_window", kind == "mistral")
        window = (c.get("sliding_window") or None) if sliding else None
        types = None
        if kind in ("qwen2", "qwen3"):
            first = c.get("max_window_layers", 28)
            types = layer_types(c, window, lambda i: i >= first)
        return dict(qkv_bias=kind == "qwen2" or bool(c.get("attention_bias", False)),
                    qk_norm=kind == "qwen3", sliding_window=window, layer_types=types)
