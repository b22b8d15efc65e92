"""The Llama family: Llama 2/3, Mistral, Qwen2 (q/k/v biases) and Qwen3 (per-head q/k
RMSNorm). One decoder (base.CausalLM with layers.py's blocks); the members differ only in
config.json fields, read here."""
from __future__ import annotations

from .base import CausalLM


class LlamaForCausalLM(CausalLM):
    @classmethod
    def config_fields(cls, kind: str, c: dict, path) -> dict:
        # Mistral's sliding window is on unless use_sliding_window says otherwise; Qwen2's off
        sliding = c.get("use_sliding_window", kind == "mistral")
        return dict(qkv_bias=kind == "qwen2" or bool(c.get("attention_bias", False)),
                    qk_norm=kind == "qwen3",
                    sliding_window=c.get("sliding_window") if sliding else None)
