"""Load a Hugging Face model directory (config.json + *.safetensors), or a GGUF file
(engine/gguf.py, dequantized at load), into `CausalLM`, offline.

Every parameter of the model must be filled and every tensor in the checkpoint used (a few
known buffers excepted), with matching shapes, or loading fails naming the culprit."""
from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Callable, Iterator

import torch
from safetensors import safe_open

from .config import ModelConfig
from .gguf import find_gguf, open_gguf
from .model import CausalLM
from .kernels.rope import build_cos_sin_cache
from .moe import expert_target, stack_experts

# checkpoint name -> (our parameter, shard index within a fused parameter, or None)
_FUSED = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
          "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}
_IGNORED = re.compile(r".*rotary_emb\.inv_freq$")


def checkpoint_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.exists():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        missing = [n for n in names if not (model_dir / n).exists()]
        if missing:
            raise ValueError(f"{model_dir}: shards named in {index.name} are missing: {missing}")
        return [model_dir / n for n in names]
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise ValueError(f"{model_dir}: no *.safetensors weights found")
    return files


def checkpoint_tensors(model_dir: str | Path) -> Iterator[tuple[str, str, Callable[[], torch.Tensor]]]:
    """(file name, Hugging Face tensor name, a getter of the tensor) for every tensor of the
    checkpoint: *.safetensors, or a GGUF file's tensors dequantized to float32."""
    gguf_file = find_gguf(model_dir)
    if gguf_file is not None:
        for raw in open_gguf(gguf_file).raw_tensors():
            yield gguf_file.name, raw.name, lambda raw=raw: torch.from_numpy(raw.dequantize())
        return
    for f in checkpoint_files(Path(model_dir)):
        with safe_open(str(f), framework="pt") as sf:
            for key in sf.keys():
                if not _IGNORED.match(key):
                    yield f.name, key, lambda sf=sf, key=key: sf.get_tensor(key)


def _target(name: str) -> tuple[str, int | None]:
    """HF name -> (our name, shard). model.layers.0.self_attn.q_proj.weight -> qkv_proj."""
    name = name.removeprefix("model.")
    if (expert := expert_target(name)) is not None:     # an MoE expert's: shard (expert, part)
        return expert
    parts = name.split(".")
    for i, p in enumerate(parts):
        if p in _FUSED:
            fused, shard = _FUSED[p]
            return ".".join(parts[:i] + [fused] + parts[i + 1:]), shard
    return name, None


def load_model(config: ModelConfig, dtype: torch.dtype, device: str = "cpu",
               kernel_backend: str = "auto") -> CausalLM:
    with torch.device("meta"):
        model = CausalLM(config, kernel_backend)
    params = dict(model.named_parameters())
    tensors: dict[str, torch.Tensor] = {}
    shards: dict[str, dict[int, torch.Tensor]] = {}
    for source, key, get in checkpoint_tensors(config.model_dir):
        name, shard = _target(key)
        if name not in params:
            if name == "lm_head.weight" and config.tie_word_embeddings:
                continue
            raise ValueError(f"{source}: unexpected tensor {key!r} for {config.architecture}")
        t = get()
        if shard is None:
            tensors[name] = t
        else:
            shards.setdefault(name, {})[shard] = t
    for name, parts in shards.items():
        if ".experts." in name:
            tensors[name] = stack_experts(name, parts, config.moe.num_experts)
            continue
        n = 3 if "qkv" in name else 2
        if len(parts) != n:
            raise ValueError(f"checkpoint has {len(parts)} of {n} parts of {name!r}")
        tensors[name] = torch.cat([parts[i] for i in range(n)], dim=0)
    missing = sorted(set(params) - set(tensors))
    if missing:
        raise ValueError(f"checkpoint in {config.model_dir} lacks tensors: {missing[:8]}"
                         f"{' ...' if len(missing) > 8 else ''}")
    for name, p in params.items():
        if tuple(tensors[name].shape) != tuple(p.shape):
            raise ValueError(f"tensor {name!r}: checkpoint shape {tuple(tensors[name].shape)}, "
                             f"model expects {tuple(p.shape)}")
    model.to_empty(device=device).to(dtype)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(tensors[name])
        # buffers were on the meta device: rebuild the rotary table (fp32) where it lives now
        model.cos_sin = build_cos_sin_cache(config.head_dim, config.max_model_len + 1,
                                            config.rope_theta, config.rope_scaling, device)
    return model.eval().requires_grad_(False)
