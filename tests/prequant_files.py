"""Pre-quantized Hugging Face checkpoints written by the tests from a float one, in the layouts
vLLM and transformers read: quant_method "fp8" (e4m3 weights, a per-tensor or per-channel
scale) and compressed-tensors ("pack-quantized" int4 group-wise, packed by the
compressed_tensors package's own packer; "float-quantized" fp8 per channel). The decoder's
linear layers are quantized; embeddings, norms and the head stay float."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
FP8_MAX = 448.0


def _is_linear(name: str) -> bool:
    return name.endswith(".weight") and name.split(".")[-2] in LINEARS


def write_quantized(src: Path, out: Path, scheme: str, *, group: int = 32,
                    scale_name: str = "weight_scale", scale_dtype=torch.float16) -> Path:
    """scheme: fp8_tensor | fp8_channel (quant_method "fp8", scales named `scale_name`) |
    ct_int4 (compressed-tensors pack-quantized, symmetric, `group`) | ct_fp8 (compressed-tensors
    float-quantized, per channel)."""
    shutil.copytree(src, out)
    tensors = {k: v.float() for k, v in load_file(str(src / "model.safetensors")).items()}
    written = {}
    for name, w in tensors.items():
        if not _is_linear(name):
            written[name] = w
            continue
        prefix = name.removesuffix(".weight")
        if scheme in ("fp8_tensor", "fp8_channel", "ct_fp8"):
            amax = w.abs().amax() if scheme == "fp8_tensor" else w.abs().amax(dim=1, keepdim=True)
            scale = amax / FP8_MAX
            written[name] = (w / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
            written[f"{prefix}.{scale_name}"] = scale.float()
        elif scheme == "ct_int4":
            from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32
            n, k = w.shape
            wg = w.view(n, k // group, group)
            scale = (wg.abs().amax(dim=-1) / 7.5).to(scale_dtype)
            q = torch.round(wg / scale.float()[..., None]).clamp(-8, 7).view(n, k).to(torch.int8)
            written[f"{prefix}.weight_packed"] = pack_to_int32(q, 4)
            written[f"{prefix}.weight_scale"] = scale
            written[f"{prefix}.weight_shape"] = torch.tensor([n, k])
        else:
            raise ValueError(scheme)
    save_file(written, str(out / "model.safetensors"))
    c = json.loads((src / "config.json").read_text())
    if scheme.startswith("fp8"):
        c["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "dynamic"}
    else:
        weights = ({"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group",
                    "group_size": group, "dynamic": False, "actorder": None}
                   if scheme == "ct_int4" else
                   {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "channel",
                    "dynamic": False})
        fmt = "pack-quantized" if scheme == "ct_int4" else "float-quantized"
        c["quantization_config"] = {
            "quant_method": "compressed-tensors", "format": fmt, "quantization_status": "compressed",
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights, "format": fmt,
                                          "input_activations": None, "output_activations": None}},
            "ignore": ["lm_head"], "kv_cache_scheme": None}
    (out / "config.json").write_text(json.dumps(c, indent=2))
    return out


def stored_definition(d: Path, prefix: str) -> torch.Tensor:
    """The float32 weight a module's stored tensors stand for, by the layout's definition."""
    t = load_file(str(d / "model.safetensors"))
    if f"{prefix}.weight_packed" in t:
        from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32
        n, k = t[f"{prefix}.weight_shape"].tolist()
        q = unpack_from_int32(t[f"{prefix}.weight_packed"], 4, torch.Size([n, k])).float()
        s = t[f"{prefix}.weight_scale"].float()
        return (q.view(n, s.shape[1], -1) * s[..., None]).view(n, k)
    w = t[f"{prefix}.weight"].float()
    s = t.get(f"{prefix}.weight_scale", t.get(f"{prefix}.weight_scale_inv"))
    return w * (s.reshape(-1, 1) if s.numel() > 1 else s)
