"""Load a Hugging Face model directory (config.json + *.safetensors), or a GGUF file
(engine/gguf.py), into `CausalLM`, offline.

Every parameter of the model must be filled and every tensor in the checkpoint used (a few
known buffers excepted), with matching shapes, or loading fails naming the culprit.

Pre-quantized weights (GGUF Q8_0/Q4_0/Q4_1, a config.json's quantization_config: see
engine/quant/checkpoint.py) of the decoder's linear layers, the output head and the embedding
table (int8 only) become QuantLinear / QuantEmbedding with the stored codes and scales, unless
`quantization` is "none" (then everything is dequantized, exactly). Elsewhere (norms, MoE
experts) and where a fused layer's parts are stored in different layouts, they are dequantized."""
from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Callable, Iterator

import torch
from safetensors import safe_open
from torch import nn

from .config import ModelConfig
from .gguf import find_gguf, open_gguf
from .model import CausalLM
from .kernels.rope import build_cos_sin_cache
from .moe import expert_target, stack_experts
from .quant import get_scheme
from .quant.checkpoint import check_config, gguf_weight, hf_tensors
from .quant.linear import QuantEmbedding, QuantLinear
from .quant.scheme import QuantWeight

# checkpoint name -> (our parameter, shard index within a fused parameter, or None)
_FUSED = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
          "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}
_IGNORED = re.compile(r".*rotary_emb\.inv_freq$")
_KEPT = re.compile(r"(layers\.\d+\.(self_attn|mlp)\.(qkv_proj|o_proj|gate_up_proj|down_proj)"
                   r"|lm_head|embed_tokens)\.weight")


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


def checkpoint_tensors(model_dir: str | Path) -> Iterator[
        tuple[str, str, Callable[[], torch.Tensor | QuantWeight]]]:
    """(file name, Hugging Face tensor name, a getter of the tensor) for every tensor of the
    checkpoint: *.safetensors or a GGUF file's tensors, float, or a quantize.py layout where
    the checkpoint holds the tensor pre-quantized."""
    gguf_file = find_gguf(model_dir)
    if gguf_file is not None:
        for raw in open_gguf(gguf_file).raw_tensors():
            yield gguf_file.name, raw.name, lambda raw=raw: (
                gguf_weight(raw) or torch.from_numpy(raw.dequantize()))
        return
    d = Path(model_dir)
    config = d / "config.json"
    scheme = check_config(json.loads(config.read_text()), config) if config.exists() else None
    for f in checkpoint_files(d):
        with safe_open(str(f), framework="pt") as sf:
            keys = [k for k in sf.keys() if not _IGNORED.match(k)]
            if scheme is None:
                items = ((k, lambda k=k: sf.get_tensor(k)) for k in keys)
            else:
                items = hf_tensors(keys, sf.get_tensor)
            for key, get in items:
                yield f.name, key, get


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
               kernel_backend: str = "auto", quantization: str = "auto") -> CausalLM:
    """`quantization`: "none" dequantizes pre-quantized weights; any method but "auto" must be
    the one the checkpoint's pre-quantized decoder layers hold (ValueError otherwise)."""
    with torch.device("meta"):
        model = CausalLM(config, kernel_backend)
    params = dict(model.named_parameters())
    tensors: dict[str, torch.Tensor | QuantWeight] = {}
    shards: dict[str, dict[int, torch.Tensor | QuantWeight]] = {}
    for source, key, get in checkpoint_tensors(config.model_dir):
        name, shard = _target(key)
        if name not in params:
            if name == "lm_head.weight" and config.tie_word_embeddings:
                continue
            raise ValueError(f"{source}: unexpected tensor {key!r} for {config.architecture}")
        t = get()
        if not isinstance(t, torch.Tensor):
            if quantization not in ("auto", "none") and name.startswith("layers.") \
                    and t.method != quantization:
                raise ValueError(f"{source}: {key} is stored pre-quantized as {t.method}; "
                                 f"quantization {quantization!r} disagrees (leave it unset, or "
                                 f"'none' to dequantize)")
            if quantization == "none" or not _KEPT.fullmatch(name) or (
                    name == "embed_tokens.weight" and not get_scheme(t.method).tables):
                t = t.dequantize()
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
        parts = [parts[i] for i in range(n)]
        methods = {"float" if isinstance(p, torch.Tensor) else p.method for p in parts}
        if len(methods) > 1:       # stored in different layouts: the fused layer is float
            parts = [p if isinstance(p, torch.Tensor) else p.dequantize() for p in parts]
        tensors[name] = torch.cat(parts) if isinstance(parts[0], torch.Tensor) else type(parts[0]).cat(parts)
    missing = sorted(set(params) - set(tensors))
    if missing:
        raise ValueError(f"checkpoint in {config.model_dir} lacks tensors: {missing[:8]}"
                         f"{' ...' if len(missing) > 8 else ''}")
    for name, p in params.items():
        shape = tensors[name].shape
        if tuple(shape) != tuple(p.shape):
            raise ValueError(f"tensor {name!r}: checkpoint shape {tuple(shape)}, "
                             f"model expects {tuple(p.shape)}")
    # pre-quantized modules: out of the float model before it is materialised
    quantized = {n.removesuffix(".weight"): t for n, t in tensors.items() if not isinstance(t, torch.Tensor)}
    for path in quantized:
        _set(model, path, nn.Identity())
    model.to_empty(device=device).to(dtype)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(tensors[name])
        for path, qw in quantized.items():
            qw, backend = qw.to(device), model.backend
            if path == "embed_tokens":
                model.embed_tokens = QuantEmbedding(qw, dtype, backend)
                if model.lm_head is None:       # tied: the head reads the same codes
                    model.lm_head = model.embed_tokens.tied_head()
            else:
                bias = tensors.get(path + ".bias")
                _set(model, path, QuantLinear.of(qw, None if bias is None else bias.to(device, dtype),
                                                 head=path == "lm_head", backend=backend))
        # buffers were on the meta device: rebuild the rotary table (fp32) where it lives now
        model.cos_sin = build_cos_sin_cache(config.head_dim, config.max_model_len + 1,
                                            config.rope_theta, config.rope_scaling, device)
    return model.eval().requires_grad_(False)


def _set(model: nn.Module, path: str, module: nn.Module) -> None:
    parent, _, child = path.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, child, module)
