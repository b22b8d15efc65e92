"""Load a Hugging Face model directory (config.json + *.safetensors), or a GGUF file
(engine/gguf.py), into its family's CausalLM (engine/models), offline.

    build      the model on the meta device (nothing allocated or drawn)
    read       every checkpoint tensor under the model's own name (CausalLM.checkpoint_name),
               pre-quantized ones kept or dequantized (`_keep_quantized`)
    assemble   fused and stacked parameters from their shards (CausalLM.assemble)
    check      every parameter filled, with its shape; every checkpoint tensor used (a few
               known buffers excepted), or loading fails naming the culprit
    fill       the float tensors copied into the materialised model; the quantized ones
               installed as QuantLinear / QuantEmbedding layers (engine/quant)

Pre-quantized weights (GGUF Q8_0/Q4_0/Q4_1, a config.json's quantization_config: see
engine/quant/checkpoint.py) of the model's quantizable linears, the output head and the
embedding table (a scheme that holds tables) keep the stored codes and scales, unless
`quantization` is "none" (then everything is dequantized, exactly). Elsewhere (norms, MoE
experts, routers) and where a fused layer's parts are stored in different layouts, they are
dequantized."""
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
from .models import model_class
from .models.base import CausalLM
from .quant import get_scheme
from .quant.checkpoint import check_config, gguf_weight, hf_tensors
from .quant.linear import QuantEmbedding, QuantLinear
from .quant.scheme import QuantWeight

_IGNORED = re.compile(r".*rotary_emb\.inv_freq$")
Weight = torch.Tensor | QuantWeight


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


def checkpoint_tensors(model_dir: str | Path) -> Iterator[tuple[str, str, Callable[[], Weight]]]:
    """(file name, Hugging Face tensor name, a getter of the tensor) for every tensor of the
    checkpoint: *.safetensors or a GGUF file's tensors, float, or a scheme's weight where the
    checkpoint holds the tensor pre-quantized."""
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


def load_model(config: ModelConfig, dtype: torch.dtype, device: str = "cpu",
               kernel_backend: str = "auto", quantization: str = "auto") -> CausalLM:
    """`quantization`: "none" dequantizes pre-quantized weights; any method but "auto" must be
    the one the checkpoint's pre-quantized decoder layers hold (ValueError otherwise)."""
    with torch.device("meta"):
        model = model_class(config.architecture)(config, kernel_backend)
    tensors, shards = _read(model, quantization)
    tensors.update({name: model.assemble(name, parts) for name, parts in shards.items()})
    _check(model, tensors)
    _fill(model, tensors, dtype, device)
    return model.eval().requires_grad_(False)


def _read(model: CausalLM, quantization: str) -> tuple[dict[str, Weight], dict[str, dict]]:
    """Every checkpoint tensor by our name: whole ones, and the shards of fused ones."""
    config, params = model.config, dict(model.named_parameters())
    keep = _keep_quantized(model, quantization)
    tensors, shards = {}, {}
    for source, key, get in checkpoint_tensors(config.model_dir):
        if model.skips(key.removeprefix("model.")):
            continue
        name, shard = model.checkpoint_name(key.removeprefix("model."))
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
            if not keep(name, t):
                t = t.dequantize()
        if shard is None:
            tensors[name] = t
        else:
            shards.setdefault(name, {})[shard] = t
    return tensors, shards


def _keep_quantized(model: CausalLM, quantization: str) -> Callable[[str, QuantWeight], bool]:
    """Whether parameter `name`, stored pre-quantized, stays so: a quantizable linear's
    weight, the head's, or the embedding table where its scheme holds tables."""
    linears = {f"{path}.weight" for path, *_ in model.quantizable_linears()}

    def keep(name: str, qw: QuantWeight) -> bool:
        if quantization == "none":
            return False
        if name == "embed_tokens.weight":
            return get_scheme(qw.method).tables
        return name == "lm_head.weight" or name in linears
    return keep


def _check(model: CausalLM, tensors: dict[str, Weight]) -> None:
    params = dict(model.named_parameters())
    missing = sorted(set(params) - set(tensors))
    if missing:
        raise ValueError(f"checkpoint in {model.config.model_dir} lacks tensors: {missing[:8]}"
                         f"{' ...' if len(missing) > 8 else ''}")
    for name, p in params.items():
        if tuple(tensors[name].shape) != tuple(p.shape):
            raise ValueError(f"tensor {name!r}: checkpoint shape {tuple(tensors[name].shape)}, "
                             f"model expects {tuple(p.shape)}")


def _fill(model: CausalLM, tensors: dict[str, Weight], dtype: torch.dtype, device: str) -> None:
    """Materialise the model on `device` in `dtype` and copy the float tensors in; the
    quantized ones become their scheme's layers (out of the float model before it is
    materialised, so their float stand-ins are never allocated)."""
    quantized = {n.removesuffix(".weight"): t for n, t in tensors.items() if not isinstance(t, torch.Tensor)}
    for path in quantized:
        _set(model, path, nn.Identity())
    _materialise(model, device)
    model.to(dtype)
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
        model.cos_sin = model.rotary_table(device)


def _materialise(model: nn.Module, device: str) -> None:
    """`model.to_empty(device=device)` without its `torch.empty_like` of meta tensors, whose
    Python meta path imports torch's symbolic shapes and sympy (a second of start-up)."""
    for m in model.modules():
        for name, p in m._parameters.items():
            if p is not None and p.is_meta:
                m._parameters[name] = nn.Parameter(torch.empty(p.shape, dtype=p.dtype, device=device),
                                                   requires_grad=p.requires_grad)
        for name, b in m._buffers.items():
            if b is not None and b.is_meta:
                m._buffers[name] = torch.empty(b.shape, dtype=b.dtype, device=device)


def _set(model: nn.Module, path: str, module: nn.Module) -> None:
    parent, _, child = path.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, child, module)
