"""int8: a weight's int8 codes with a scale per output channel, symmetric.

    w ~ q * s[n]      q in [-127, 127], s = amax(|w[n]|) / 127, computed in float32, rounded
                      half to even

Kernel (engine.kernels.int8_linear, by the model's backend): on CUDA the Triton weight-only
kernel up to 16 rows (decode) and dequantize-then-matmul above; on CPU cpu.c's kernel
(backend cpu) or torch's `_weight_int8pack_mm`, both on bfloat16 activations and returning
bfloat16 (torch's CPU int8/int4 kernels are fast only for bfloat16: measured 8-25x slower in
float32), and the reference where torch's kernel is wrong (K % 16 != 0). Each takes one path
whatever M is, so a prompt prefilled in chunks computes as one prefilled whole.

`Int8Weight` also carries codes with a scale per group of 32 values (group=32: GGUF Q8_0,
the int8_g32 scheme of int8_g32.py, which quantizes with `quantize_int8(w, 32)` too).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

import engine.kernels as K
from engine.kernels import reference

from .scheme import Packed, QuantScheme, QuantWeight


@dataclass
class Int8Weight(QuantWeight):
    q: torch.Tensor                  # [N, K] int8
    scale: torch.Tensor              # [N] float32, or [N, K/group] float16 (GGUF Q8_0)
    group: int = 0                   # 0: per output channel

    @property
    def method(self) -> str:
        return f"int8_g{self.group}" if self.group else "int8"

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.q.shape)

    def dequantize(self) -> torch.Tensor:
        return reference.dequantize_int8(self.q, self.scale, self.group)


def check_2d(w: torch.Tensor) -> torch.Tensor:
    """`w` as a float32 [out, in] weight; ValueError for anything else."""
    if w.dim() != 2 or not w.is_floating_point():
        raise ValueError(f"weight must be a 2-D float tensor [out, in], got {tuple(w.shape)} {w.dtype}")
    return w.float()


def quantize_int8(w: torch.Tensor, group: int = 0) -> Int8Weight:
    """Per output channel (group 0), or per `group` values along K with a float16 scale
    (GGUF Q8_0 at group 32; codes computed against the rounded scale)."""
    w = check_2d(w)
    if group:
        n, k = w.shape
        if k % group:
            raise ValueError(f"in features {k} are not a multiple of the int8 group size {group}")
        wg = w.view(n, k // group, group)
        scale = (wg.abs().amax(dim=-1) / 127.0).half()
        s32 = scale.float().clamp(min=torch.finfo(torch.float16).tiny)
        q = torch.round(wg / s32[..., None]).clamp(-127, 127).view(n, k)
        return Int8Weight(q.to(torch.int8), scale, group)
    scale = w.abs().amax(dim=1) / 127.0
    q = torch.round(w / scale.clamp(min=torch.finfo(torch.float32).tiny)[:, None])
    return Int8Weight(q.clamp(-127, 127).to(torch.int8), scale)


class Int8Packed(Packed):
    """Codes [N, K] and per-channel scales: bfloat16 on CPU (the kernels there take the
    activation dtype), float32 elsewhere."""

    def __init__(self, qw: Int8Weight, backend: str):
        super().__init__(qw, backend)
        self.register_buffer("qweight", qw.q)
        self.register_buffer("scale", qw.scale.bfloat16() if qw.q.device.type == "cpu" else qw.scale.float())

    @property
    def input_dtype(self) -> torch.dtype | None:
        cpu = self.qweight.device.type == "cpu" and self.backend != "triton"
        return torch.bfloat16 if cpu and self.qweight.shape[1] % 16 == 0 else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return K.int8_linear(x, self.qweight, self.scale, backend=self.backend)

    def quantized(self) -> Int8Weight:
        return Int8Weight(self.qweight, self.scale.float())


class Int8Table(Packed):
    """An embedding table of int8 rows with a float32 scale each (its tied head is an
    Int8Packed of the same codes: the kernel takes bfloat16 scales on CPU)."""

    def __init__(self, qw: Int8Weight, backend: str):
        super().__init__(qw, backend)
        self.register_buffer("qweight", qw.q)
        self.register_buffer("scale", qw.scale.float())

    def lookup(self, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        return (self.qweight[ids].float() * self.scale[ids].float()[..., None]).to(dtype)

    def quantized(self) -> Int8Weight:
        return Int8Weight(self.qweight, self.scale)


class Int8(QuantScheme):
    name, tables = "int8", True

    def quantize(self, w: torch.Tensor) -> Int8Weight:
        return quantize_int8(w)

    def pack(self, qw: Int8Weight, backend: str, keep_scales: bool = True) -> Packed:
        return Int8Packed(qw, backend)

    def table(self, qw: Int8Weight, backend: str) -> Packed:
        return Int8Table(qw, backend)

    def tied_head(self, table: Packed) -> Packed:
        return Int8Packed(table.quantized(), table.backend)
