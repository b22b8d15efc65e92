"""fp8 / fp8_tensor: float8_e4m3fn codes with a scale per output channel or per tensor.

    w ~ q * s,   s = amax / 448 (per channel, or of the whole tensor)

Read as stored: a config.json `quantization_config` with quant_method "fp8" (vLLM /
transformers: `weight` float8_e4m3fn beside `weight_scale` or `weight_scale_inv`, both
meaning w = q * scale; per tensor ([] / [1]) or per channel ([N] / [N, 1]); block-wise scales
are refused), and compressed-tensors "float-quantized" fp8 per tensor or channel. Activation
settings (input_scale, dynamic per token) are ignored: the layers run weight-only.

Kernel (engine.kernels.fp8_linear): on CUDA the Triton weight-only kernel up to 16 rows and
torch._scaled_mm above (x quantized per row, or per tensor); on CPU the reference (fp8
saves memory there, not time).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

import engine.kernels as K
from engine.kernels import reference

from .int8 import check_2d
from .scheme import Packed, QuantScheme, QuantWeight

FP8_MAX = 448.0                      # largest finite float8_e4m3fn


@dataclass
class Fp8Weight(QuantWeight):
    q: torch.Tensor                  # [N, K] float8_e4m3fn
    scale: torch.Tensor              # [N] (per channel) or [1] (per tensor) float32

    @property
    def method(self) -> str:
        return "fp8" if self.scale.numel() > 1 else "fp8_tensor"

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.q.shape)

    def dequantize(self) -> torch.Tensor:
        return reference.dequantize_fp8(self.q, self.scale)

    @classmethod
    def cat(cls, parts: list["Fp8Weight"]) -> "Fp8Weight":
        """Per-tensor scales that differ become per-channel ones (exact: each row keeps its
        scale)."""
        scales = [p.scale for p in parts]
        if all(s.numel() == 1 for s in scales) and all(torch.equal(s, scales[0]) for s in scales):
            return cls(torch.cat([p.q for p in parts]), scales[0])
        return cls(torch.cat([p.q for p in parts]),
                   torch.cat([s.expand(p.q.shape[0]) for s, p in zip(scales, parts)]))


def quantize_fp8(w: torch.Tensor, per_channel: bool = True) -> Fp8Weight:
    w = check_2d(w)
    amax = w.abs().amax(dim=1) if per_channel else w.abs().amax().reshape(1)
    scale = amax / FP8_MAX
    s = scale.clamp(min=torch.finfo(torch.float32).tiny)
    q = (w / (s[:, None] if per_channel else s)).clamp(-FP8_MAX, FP8_MAX)
    return Fp8Weight(q.to(torch.float8_e4m3fn), scale)


class Fp8Packed(Packed):
    def __init__(self, qw: Fp8Weight, backend: str):
        super().__init__(qw, backend)
        self.register_buffer("qweight", qw.q)
        self.register_buffer("scale", qw.scale.float())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return K.fp8_linear(x, self.qweight, self.scale, backend=self.backend)

    def quantized(self) -> Fp8Weight:
        return Fp8Weight(self.qweight, self.scale)


class Fp8(QuantScheme):
    name, per_channel = "fp8", True
    hf_siblings = (".weight_scale", ".weight_scale_inv", ".input_scale")

    def quantize(self, w: torch.Tensor) -> Fp8Weight:
        return quantize_fp8(w, self.per_channel)

    def pack(self, qw: Fp8Weight, backend: str, keep_scales: bool = True) -> Packed:
        return Fp8Packed(qw, backend)

    def reads_compressed_tensors(self, fmt: str | None, w: dict) -> bool:
        return (fmt == "float-quantized" and w.get("type") == "float" and w.get("num_bits") == 8
                and w.get("strategy") == ("channel" if self.per_channel else "tensor"))

    def reads_quant_method(self, method: str | None, qc: dict, where) -> bool:
        if method != "fp8":
            return False
        if qc.get("weight_block_size"):
            raise ValueError(f"{where}: block-wise fp8 (weight_block_size {qc['weight_block_size']}) "
                             "is not supported: per-tensor and per-channel scales only")
        return True

    def hf_weight(self, key: str, have: set[str], get: Callable[[str], torch.Tensor]):
        if not key.endswith(".weight"):
            return None
        p = key.removesuffix(".weight")
        scale = next((p + s for s in (".weight_scale", ".weight_scale_inv") if p + s in have), None)
        if scale is None:
            return None
        return key, lambda: _hf_fp8(key, get(key), get(scale))


class Fp8Tensor(Fp8):
    name, per_channel = "fp8_tensor", False


def _hf_fp8(name: str, q: torch.Tensor, scale: torch.Tensor) -> Fp8Weight:
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
