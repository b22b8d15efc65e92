"""Typed configuration of the engine: model (read from a Hugging Face config.json), cache,
scheduler (in scheduler.py), composed into `EngineConfig`. Validation happens here."""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch

from .scheduler import SchedulerConfig

SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
}


@dataclass
class ModelConfig:
    model_dir: str
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    qk_norm: bool
    max_model_len: int
    bos_token_id: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)
    name: str = ""

    @classmethod
    def from_dir(cls, model_dir: str | Path, max_model_len: int | None = None) -> "ModelConfig":
        d = Path(model_dir)
        if not d.is_dir():
            raise ValueError(f"model directory {str(d)!r} does not exist")
        path = d / "config.json"
        if not path.exists():
            raise ValueError(f"model directory {str(d)!r} has no config.json")
        c = json.loads(path.read_text())
        archs = c.get("architectures") or []
        arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
        if arch is None:
            raise ValueError(f"unsupported architecture {archs or c.get('model_type')!r} in "
                             f"{path}: supported are {sorted(SUPPORTED_ARCHITECTURES)}")
        kind = SUPPORTED_ARCHITECTURES[arch]
        heads = c["num_attention_heads"]
        # transformers >= 5 writes rope settings under rope_parameters.
        rope = dict(c.get("rope_parameters") or {})
        theta = rope.get("rope_theta", c.get("rope_theta", 10000.0))
        scaling = c.get("rope_scaling") or (rope if rope.get("rope_type", "default") != "default" else None)
        if scaling is not None:
            rtype = scaling.get("rope_type", scaling.get("type"))
            if rtype not in ("default", "llama3"):
                raise ValueError(f"unsupported rope scaling {rtype!r} in {path}")
            if rtype == "default":
                scaling = None
        max_pos = c.get("max_position_embeddings", 2048)
        window = c.get("sliding_window") if c.get("use_sliding_window", kind == "mistral") else None
        limit = min(max_pos, window) if window else max_pos   # within the window, attention is full
        eos = c.get("eos_token_id")
        eos = [eos] if isinstance(eos, int) else list(eos or [])
        cfg = cls(
            model_dir=str(d), architecture=arch, vocab_size=c["vocab_size"],
            hidden_size=c["hidden_size"], intermediate_size=c["intermediate_size"],
            num_layers=c["num_hidden_layers"], num_heads=heads,
            num_kv_heads=c.get("num_key_value_heads") or heads,
            head_dim=c.get("head_dim") or c["hidden_size"] // heads,
            rms_norm_eps=c.get("rms_norm_eps", 1e-6), rope_theta=float(theta),
            rope_scaling=scaling, max_position_embeddings=max_pos,
            tie_word_embeddings=bool(c.get("tie_word_embeddings", False)),
            qkv_bias=kind == "qwen2" or bool(c.get("attention_bias", False)),
            qk_norm=kind == "qwen3",
            max_model_len=min(max_model_len or limit, limit),
            bos_token_id=c.get("bos_token_id"), eos_token_ids=eos, name=d.name,
        )
        if cfg.num_heads % cfg.num_kv_heads:
            raise ValueError(f"num_attention_heads {heads} is not a multiple of num_key_value_heads")
        return cfg


@dataclass
class CacheConfig:
    block_size: int = 16
    num_blocks: int | None = None         # None: sized from kv_cache_memory_gb
    kv_cache_memory_gb: float = 1.0
    enable_prefix_caching: bool = True

    def __post_init__(self):
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two, got {self.block_size}")


@dataclass
class EngineConfig:
    model: ModelConfig
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    device: str = "cpu"
    dtype: str = "auto"                    # auto: float32 on CPU, bfloat16 on CUDA
    kernel_backend: str = "auto"           # auto | torch | triton

    @property
    def torch_dtype(self) -> torch.dtype:
        if self.dtype == "auto":
            return torch.float32 if self.device == "cpu" else torch.bfloat16
        try:
            return {"float32": torch.float32, "bfloat16": torch.bfloat16,
                    "float16": torch.float16}[self.dtype]
        except KeyError:
            raise ValueError(f"unsupported dtype {self.dtype!r}") from None
