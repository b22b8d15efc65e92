"""Pre-quantized checkpoints read into the quantize.py layouts as stored, codes and scales
unchanged (no requantization):

  GGUF Q8_0   block of 32: float16 d, 32 int8 q;          w = d * q      -> Int8Weight, group 32
  GGUF Q4_0   block of 32: float16 d, 16 bytes of nibbles; w = d * (q - 8) -> Int4Weight g32,
              scale d, min -8 d (exact: a power-of-two multiple)
  GGUF Q4_1   block of 32: float16 d, float16 m, nibbles;  w = d * q + m  -> Int4Weight g32
              (a GGUF block's byte j holds element j in its low nibble, element j + 16 in its
              high one; quantize.py packs elements 2j, 2j+1 to a byte, so the nibbles move)
  Hugging Face config.json `quantization_config`:
    quant_method "fp8" (vLLM / transformers): `weight` float8_e4m3fn with `weight_scale` or
              `weight_scale_inv` (w = q * scale, either name), per tensor ([] / [1]) or per
              output channel ([N] / [N, 1]) -> Fp8Weight; block-wise scales are refused
    quant_method "compressed-tensors" (llm-compressor):
      format "pack-quantized", int 4-bit, symmetric, strategy "group" (32 or 128):
              `weight_packed` int32 [N, K/8] (value + 8 in nibble i of word i // 8, low
              nibbles first), `weight_scale` [N, K/g], `weight_shape`; w = scale * value
              -> Int4Weight, min = -8 scale (the words' little-endian bytes are quantize.py's
              packed bytes, unchanged)
      format "float-quantized", float 8-bit, strategy "tensor" or "channel": as fp8 above
  Activation quantization settings (input_scale, dynamic per-token) are ignored: the layers
  run weight-only, activations in the model dtype.
"""
from __future__ import annotations

import sys
from typing import Callable, Iterator

import numpy as np
import torch

from .quantize import Fp8Weight, Int4Weight, Int8Weight, QuantWeight, pack_int4

GGUF_KEPT = ("Q8_0", "Q4_0", "Q4_1")
_SIBLINGS = (".weight_scale", ".weight_scale_inv", ".weight_shape", ".input_scale")


def gguf_weight(raw) -> QuantWeight | None:
    """A GGUF RawTensor of a kept type as an Int8Weight / Int4Weight; None for any other."""
    if raw.type_name not in GGUF_KEPT or len(raw.shape) != 2:
        return None
    n, k = raw.shape
    b = torch.from_numpy(np.array(raw.data, dtype=np.uint8)).view(n, k // 32, -1)

    def f16(lo: int) -> torch.Tensor:
        return b[..., lo:lo + 2].contiguous().view(torch.float16).squeeze(-1)     # [N, K/32]

    if raw.type_name == "Q8_0":
        return Int8Weight(b[..., 2:].contiguous().view(torch.int8).reshape(n, k), f16(0), 32)
    qs = b[..., -16:]
    codes = torch.cat((qs & 15, qs >> 4), dim=-1).reshape(n, k)
    d = f16(0)
    if raw.type_name == "Q4_1":
        return Int4Weight(pack_int4(codes), d, f16(2), 32)
    mn = -8 * d
    if not torch.isfinite(mn).all():
        raise ValueError(f"{raw.name}: a Q4_0 scale times -8 overflows float16")
    return Int4Weight(pack_int4(codes), d, mn, 32)


def check_config(config: dict, where) -> str | None:
    """The scheme a config.json's quantization_config names ("fp8" or "compressed-tensors"),
    None without one; anything this module cannot read exactly is a ValueError naming it."""
    qc = config.get("quantization_config")
    if not qc:
        return None
    method = qc.get("quant_method")
    if method == "fp8":
        if qc.get("weight_block_size"):
            raise ValueError(f"{where}: block-wise fp8 (weight_block_size "
                             f"{qc['weight_block_size']}) is not supported: per-tensor and "
                             "per-channel scales only")
        return method
    if method != "compressed-tensors":
        raise ValueError(f"{where}: unsupported quantization_config quant_method {method!r}: "
                         "supported are fp8 and compressed-tensors")
    for name, group in (qc.get("config_groups") or {}).items():
        w = group.get("weights") or {}
        fmt = group.get("format") or qc.get("format")
        int4 = (fmt == "pack-quantized" and w.get("type") == "int" and w.get("num_bits") == 4
                and w.get("strategy") == "group" and w.get("group_size") in (32, 128)
                and w.get("symmetric", True) and not w.get("actorder"))
        fp8 = (fmt == "float-quantized" and w.get("type") == "float" and w.get("num_bits") == 8
               and w.get("strategy") in ("tensor", "channel"))
        if not (int4 or fp8):
            raise ValueError(
                f"{where}: compressed-tensors group {name!r} (format {fmt!r}, weights {w}) is not "
                "supported: pack-quantized symmetric int4 with group 32 or 128 (no actorder), "
                "or float-quantized fp8 per tensor or channel")
    return method


def hf_tensors(keys: list[str], get: Callable[[str], torch.Tensor]
               ) -> Iterator[tuple[str, Callable[[], torch.Tensor | QuantWeight]]]:
    """(name, getter) for every weight of a pre-quantized safetensors checkpoint: a module's
    quantized weight and its scales become one `<module>.weight` whose getter returns the
    layout; other tensors pass through."""
    have = set(keys)
    for key in keys:
        prefix = key.rpartition(".")[0]
        if key.endswith(".weight_packed"):
            if prefix + ".weight_zero_point" in have or prefix + ".weight_g_idx" in have:
                raise ValueError(f"{key}: asymmetric or act-order int4 is not supported")
            yield prefix + ".weight", lambda p=prefix: _int4_packed(
                p, get(p + ".weight_packed"), get(p + ".weight_scale"), get(p + ".weight_shape"))
        elif key.endswith(".weight") and (prefix + ".weight_scale" in have
                                          or prefix + ".weight_scale_inv" in have):
            scale = prefix + (".weight_scale" if prefix + ".weight_scale" in have else ".weight_scale_inv")
            yield key, lambda k=key, s=scale: _fp8(k, get(k), get(s))
        elif not key.endswith(_SIBLINGS):
            yield key, lambda k=key: get(k)


def _fp8(name: str, q: torch.Tensor, scale: torch.Tensor) -> Fp8Weight:
    if q.dtype != torch.float8_e4m3fn or q.dim() != 2:
        raise ValueError(f"{name}: expected a 2-D float8_e4m3fn weight beside its scale, got "
                         f"{tuple(q.shape)} {q.dtype}")
    s = scale.float()
    if s.numel() == 1:
        return Fp8Weight(q, s.reshape(1))
    if s.numel() == q.shape[0] and s.shape in ((q.shape[0],), (q.shape[0], 1)):
        return Fp8Weight(q, s.reshape(-1))
    raise ValueError(f"{name}: fp8 scale of shape {tuple(scale.shape)} for a weight of "
                     f"{tuple(q.shape)}: per-tensor and per-channel scales only")


def _int4_packed(prefix: str, packed: torch.Tensor, scale: torch.Tensor, shape: torch.Tensor) -> Int4Weight:
    n, k = (int(v) for v in shape.tolist())
    if packed.dtype != torch.int32 or tuple(packed.shape) != (n, k // 8) or k % 8:
        raise ValueError(f"{prefix}.weight_packed: expected int32 [{n}, {k // 8}], got "
                         f"{tuple(packed.shape)} {packed.dtype}")
    if scale.dim() != 2 or scale.shape[0] != n or k % scale.shape[1]:
        raise ValueError(f"{prefix}.weight_scale: shape {tuple(scale.shape)} does not group [{n}, {k}]")
    group = k // scale.shape[1]
    if group not in (32, 128):
        raise ValueError(f"{prefix}: int4 group size {group} is not supported (32 or 128)")
    if sys.byteorder != "little":
        raise ValueError("pack-quantized weights are read on little-endian hosts only")
    return Int4Weight(packed.contiguous().view(torch.uint8), scale, -8 * scale, group)
