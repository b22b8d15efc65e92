"""int4_g32 / int4_g128: 4-bit codes per group of g values along K, asymmetric (GGUF Q4_1 /
AWQ style), and the checkpoints stored that way.

    w ~ q * s[n, k // g] + m[n, k // g]     q in [0, 15], s = (max - min) / 15, m = min
    codes packed two to a byte along K: byte j of a row = q[2j] | q[2j+1] << 4
    s and m in float16 (4 + 32/g bits a weight: 5 at g32, 4.25 at g128)

Read as stored (no requantization):
  GGUF Q4_0   block of 32: float16 d, 16 bytes of nibbles; w = d * (q - 8): scale d, min -8 d
              (exact: a power-of-two multiple)
  GGUF Q4_1   block of 32: float16 d, float16 m, nibbles; w = d * q + m
              (a GGUF block's byte j holds element j in its low nibble, element j + 16 in its
              high one; the packing here puts elements 2j, 2j+1 in a byte, so the nibbles move)
  compressed-tensors "pack-quantized", int 4-bit, symmetric, strategy "group" (32 or 128):
              `weight_packed` int32 [N, K/8] (value + 8 in nibble i of word i // 8, low nibbles
              first), `weight_scale` [N, K/g], `weight_shape`; w = scale * value -> min =
              -8 scale (the words' little-endian bytes are the packed bytes here, unchanged)

Layouts: on CPU (N % 16 == 0) torch's int4 kernel in its own packed layout with bfloat16
(scale, zero) pairs (zero = min + 8 s: it computes (q - 8) * scale + zero), bfloat16 x and
out; with the cpu kernel backend (and cpu.c built with AVX-512) cpu_int4.c's layout instead
(`Int4Cpu`: the codes in GGUF's runs of 32, the float16 scale and min as stored; float32 x,
weights and out: no bfloat16 rounding anywhere), which the whole-step decode of
engine/models/decode_plan.py reads too; elsewhere the codes as packed above, the Triton
kernel up to 16 rows (engine.kernels).
"""
from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch

import engine.kernels as K
from engine.kernels import packing as P
from engine.kernels import reference

from .int8 import check_2d
from .scheme import Packed, QuantScheme, QuantWeight

GROUPS = (32, 128)


@dataclass
class Int4Weight(QuantWeight):
    packed: torch.Tensor             # [N, K/2] uint8, low nibble = even k
    scale: torch.Tensor              # [N, K/g] float16
    min: torch.Tensor                # [N, K/g] float16
    group: int

    @property
    def shape(self) -> tuple[int, int]:
        return self.packed.shape[0], self.packed.shape[1] * 2

    @property
    def method(self) -> str:
        return f"int4_g{self.group}"

    def dequantize(self) -> torch.Tensor:
        return reference.dequantize_int4(self.packed, self.scale, self.min, self.group)


def int4_codes(w: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Unpacked codes [N, K] int32 in 0..15, scale and min [N, K/g] float16. The codes are
    computed against the float16-rounded scale and min, the ones dequantization uses."""
    w = check_2d(w)
    n, k = w.shape
    if group not in GROUPS:
        raise ValueError(f"int4 group size must be one of {GROUPS}, got {group}")
    if k % group:
        raise ValueError(f"in features {k} are not a multiple of the int4 group size {group}")
    wg = w.view(n, k // group, group)
    lo, hi = wg.amin(dim=-1), wg.amax(dim=-1)
    scale = ((hi - lo) / 15.0).half()
    mn = lo.half()
    s32 = scale.float().clamp(min=torch.finfo(torch.float16).tiny)
    q = torch.round((wg - mn.float()[..., None]) / s32[..., None]).clamp(0, 15)
    return q.view(n, k).to(torch.int32), scale, mn


def quantize_int4(w: torch.Tensor, group: int = 32) -> Int4Weight:
    codes, scale, mn = int4_codes(w, group)
    return Int4Weight(P.pack_int4(codes), scale, mn, group)


class Int4Int4Pack(Packed):
    """torch's CPU int4 layout and its bfloat16 (scale, zero) pairs; the float16 scale and
    min kept too unless `keep_scales=False` (then read back from the pairs)."""

    def __init__(self, qw: Int4Weight, backend: str, keep_scales: bool):
        super().__init__(qw, backend)
        s = qw.scale.float()
        packed, sz = P.to_int4pack(P.unpack_int4(qw.packed), s, qw.min.float() + 8 * s)
        self.register_buffer("qweight", packed)
        self.register_buffer("scales_and_zeros", sz)                 # [K/g, N, 2] bfloat16
        self.register_buffer("scale", qw.scale if keep_scales else None)
        self.register_buffer("min", qw.min if keep_scales else None)
        self.group = qw.group

    @property
    def input_dtype(self) -> torch.dtype | None:
        return torch.bfloat16

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return K.int4pack_linear(x, self.qweight, self.group, self.scales_and_zeros)

    def quantized(self) -> Int4Weight:
        n, k = self.shape
        scale, mn = self.scale, self.min
        if scale is None:
            sz = self.scales_and_zeros.float()
            scale, mn = sz[..., 0].T, sz[..., 1].T - 8 * sz[..., 0].T
        if P.int4pack_block() and n % P.int4pack_block() == 0:      # from the bytes: fast
            codes = P.int4pack_all_codes(self.qweight, n, k)
        else:                                                       # through the kernel
            codes = P.int4pack_codes(self.qweight, n, k)
        return Int4Weight(P.pack_int4(codes), scale, mn, self.group)


class Int4Cpu(Packed):
    """cpu_int4.c's layout: codes [N, K/2] in runs of 32 (packing.to_q4_runs), float16 scale
    and min [N, K/g] as stored; float32 x and out (input_dtype None: the op before writes
    float32, nothing is rounded to bfloat16)."""

    def __init__(self, qw: Int4Weight, backend: str):
        super().__init__(qw, backend)
        self.register_buffer("qweight", P.to_q4_runs(P.unpack_int4(qw.packed)).contiguous())
        self.register_buffer("scale", qw.scale.half().contiguous())
        self.register_buffer("min", qw.min.half().contiguous())
        self.group = qw.group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return K.int4cpu_linear(x, self.qweight, self.scale, self.min, self.group)

    def quantized(self) -> Int4Weight:
        return Int4Weight(P.pack_int4(P.from_q4_runs(self.qweight)), self.scale, self.min, self.group)


class Int4Plain(Packed):
    """The codes packed two to a byte, float16 scale and min: the Triton kernel's layout."""

    def __init__(self, qw: Int4Weight, backend: str):
        super().__init__(qw, backend)
        self.register_buffer("qweight", qw.packed)
        self.register_buffer("scale", qw.scale)
        self.register_buffer("min", qw.min)
        self.group = qw.group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return K.int4_linear(x, self.qweight, self.scale, self.min, self.group, backend=self.backend)

    def quantized(self) -> Int4Weight:
        return Int4Weight(self.qweight, self.scale, self.min, self.group)


class Int4(QuantScheme):
    group: int
    hf_siblings = (".weight_scale", ".weight_shape")

    def quantize(self, w: torch.Tensor) -> Int4Weight:
        return quantize_int4(w, self.group)

    def pack(self, qw: Int4Weight, backend: str, keep_scales: bool = True) -> Packed:
        if qw.group != self.group:
            raise ValueError(f"{self.name} layer given group-{qw.group} weights")
        if qw.packed.device.type == "cpu" and backend == "cpu" and K.cpu.has_int4():
            return Int4Cpu(qw, backend)
        # torch's CPU int4 kernel needs N % 16 == 0; the float16 scale and min are kept where
        # a model settled on the cpu backend later repacks to Int4Cpu (the kernel's bfloat16
        # pairs round them)
        if qw.packed.device.type == "cpu" and backend != "triton" and qw.shape[0] % 16 == 0:
            return Int4Int4Pack(qw, backend, keep_scales or (backend == "auto" and K.cpu.has_int4()))
        return Int4Plain(qw, backend)

    def repack(self, packed: Packed, backend: str) -> Packed:
        if (backend == "cpu" and not isinstance(packed, Int4Cpu) and packed.qweight.device.type == "cpu"
                and K.cpu.has_int4()):
            return Int4Cpu(packed.quantized(), backend)
        return super().repack(packed, backend)

    def reads_compressed_tensors(self, fmt: str | None, w: dict) -> bool:
        return (fmt == "pack-quantized" and w.get("type") == "int" and w.get("num_bits") == 4
                and w.get("strategy") == "group" and w.get("group_size") == self.group
                and w.get("symmetric", True) and not w.get("actorder"))

    def hf_weight(self, key: str, have: set[str], get: Callable[[str], torch.Tensor]):
        if not key.endswith(".weight_packed"):
            return None
        p = key.removesuffix(".weight_packed")
        if p + ".weight_zero_point" in have or p + ".weight_g_idx" in have:
            raise ValueError(f"{key}: asymmetric or act-order int4 is not supported")
        return p + ".weight", lambda: _ct_packed(p, get(key), get(p + ".weight_scale"),
                                                 get(p + ".weight_shape"))


class Int4G32(Int4):
    name, group = "int4_g32", 32
    gguf_types = ("Q4_0", "Q4_1")

    def from_gguf(self, raw) -> Int4Weight:
        n, k = raw.shape
        b = torch.from_numpy(np.array(raw.data, dtype=np.uint8)).view(n, k // 32, -1)

        def f16(lo: int) -> torch.Tensor:
            return b[..., lo:lo + 2].contiguous().view(torch.float16).squeeze(-1)     # [N, K/32]
        qs = b[..., -16:]
        codes = torch.cat((qs & 15, qs >> 4), dim=-1).reshape(n, k)
        d = f16(0)
        if raw.type_name == "Q4_1":
            return Int4Weight(P.pack_int4(codes), d, f16(2), 32)
        mn = -8 * d
        if not torch.isfinite(mn).all():
            raise ValueError(f"{raw.name}: a Q4_0 scale times -8 overflows float16")
        return Int4Weight(P.pack_int4(codes), d, mn, 32)


class Int4G128(Int4):
    name, group = "int4_g128", 128


def _ct_packed(prefix: str, packed: torch.Tensor, scale: torch.Tensor, shape: torch.Tensor) -> Int4Weight:
    n, k = (int(v) for v in shape.tolist())
    if packed.dtype != torch.int32 or tuple(packed.shape) != (n, k // 8) or k % 8:
        raise ValueError(f"{prefix}.weight_packed: expected int32 [{n}, {k // 8}], got "
                         f"{tuple(packed.shape)} {packed.dtype}")
    if scale.dim() != 2 or scale.shape[0] != n or k % scale.shape[1]:
        raise ValueError(f"{prefix}.weight_scale: shape {tuple(scale.shape)} does not group [{n}, {k}]")
    group = k // scale.shape[1]
    if group not in GROUPS:
        raise ValueError(f"{prefix}: int4 group size {group} is not supported (32 or 128)")
    if sys.byteorder != "little":
        raise ValueError("pack-quantized weights are read on little-endian hosts only")
    return Int4Weight(packed.contiguous().view(torch.uint8), scale, -8 * scale, group)
