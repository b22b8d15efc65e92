"""Weight quantizers and their exact inverses (the torch references every kernel is tested
against). A weight is [N, K] (out features, in features), as nn.Linear stores it.

  int8  per output channel, symmetric:   w ~ q * s[n]              q in [-127, 127], s = amax/127
  int8_g32  per group of 32 along K (GGUF Q8_0): w ~ q * s[n, k//32], s float16
  int4  per group of g along K, asymmetric (GGUF Q4_1 / AWQ style):
                                          w ~ q * s[n, k//g] + m[n, k//g]
                                          q in [0, 15], s = (max - min)/15, m = min
        codes packed two to a byte along K: byte j of a row = q[2j] | q[2j+1] << 4
        s and m are stored in float16 (4 + 32/g bits a weight: 5 at g32, 4.25 at g128)
  fp8   e4m3, per output channel or per tensor: w ~ q * s,  s = amax/448

All quantizers compute in float32 and round half to even (torch.round)."""
from __future__ import annotations

from dataclasses import dataclass

import torch

FP8_MAX = 448.0                      # largest finite float8_e4m3fn
INT4_GROUPS = (32, 128)


@dataclass
class Int8Weight:
    q: torch.Tensor                  # [N, K] int8
    scale: torch.Tensor              # [N] float32, or [N, K/group] float16 (GGUF Q8_0)
    group: int = 0                   # 0: per output channel

    @property
    def method(self) -> str:
        return f"int8_g{self.group}" if self.group else "int8"


@dataclass
class Int4Weight:
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


@dataclass
class Fp8Weight:
    q: torch.Tensor                  # [N, K] float8_e4m3fn
    scale: torch.Tensor              # [N] (per channel) or [1] (per tensor) float32

    @property
    def method(self) -> str:
        return "fp8" if self.scale.numel() > 1 else "fp8_tensor"


def _check_2d(w: torch.Tensor) -> torch.Tensor:
    if w.dim() != 2 or not w.is_floating_point():
        raise ValueError(f"weight must be a 2-D float tensor [out, in], got {tuple(w.shape)} {w.dtype}")
    return w.float()


def quantize_int8(w: torch.Tensor, group: int = 0) -> Int8Weight:
    """Per output channel (group 0), or per `group` values along K with a float16 scale
    (GGUF Q8_0 at group 32; codes computed against the rounded scale)."""
    w = _check_2d(w)
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


def dequantize_int8(qw: Int8Weight) -> torch.Tensor:
    if qw.group:
        n, k = qw.q.shape
        return (qw.q.float().view(n, k // qw.group, qw.group) * qw.scale.float()[..., None]).view(n, k)
    return qw.q.float() * qw.scale[:, None]


def int4_codes(w: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Unpacked codes [N, K] int32 in 0..15, scale and min [N, K/g] float16. The codes are
    computed against the float16-rounded scale and min, the ones dequantization uses."""
    w = _check_2d(w)
    n, k = w.shape
    if group not in INT4_GROUPS:
        raise ValueError(f"int4 group size must be one of {INT4_GROUPS}, got {group}")
    if k % group:
        raise ValueError(f"in features {k} are not a multiple of the int4 group size {group}")
    wg = w.view(n, k // group, group)
    lo, hi = wg.amin(dim=-1), wg.amax(dim=-1)
    scale = ((hi - lo) / 15.0).half()
    mn = lo.half()
    s32 = scale.float().clamp(min=torch.finfo(torch.float16).tiny)
    q = torch.round((wg - mn.float()[..., None]) / s32[..., None]).clamp(0, 15)
    return q.view(n, k).to(torch.int32), scale, mn


def pack_int4(codes: torch.Tensor) -> torch.Tensor:
    """[N, K] codes 0..15 -> [N, K/2] uint8, even k in the low nibble."""
    c = codes.to(torch.uint8)
    return c[:, 0::2] | (c[:, 1::2] << 4)


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """[N, K/2] uint8 -> [N, K] int32 codes."""
    lo, hi = packed & 0xF, packed >> 4
    return torch.stack((lo, hi), dim=-1).flatten(1).to(torch.int32)


def quantize_int4(w: torch.Tensor, group: int = 32) -> Int4Weight:
    codes, scale, mn = int4_codes(w, group)
    return Int4Weight(pack_int4(codes), scale, mn, group)


def dequantize_int4(qw: Int4Weight) -> torch.Tensor:
    n, k = qw.shape
    q = unpack_int4(qw.packed).float().view(n, k // qw.group, qw.group)
    return (q * qw.scale.float()[..., None] + qw.min.float()[..., None]).view(n, k)


def quantize_fp8(w: torch.Tensor, per_channel: bool = True) -> Fp8Weight:
    w = _check_2d(w)
    amax = w.abs().amax(dim=1) if per_channel else w.abs().amax().reshape(1)
    scale = amax / FP8_MAX
    s = scale.clamp(min=torch.finfo(torch.float32).tiny)
    q = (w / (s[:, None] if per_channel else s)).clamp(-FP8_MAX, FP8_MAX)
    return Fp8Weight(q.to(torch.float8_e4m3fn), scale)


def dequantize_fp8(qw: Fp8Weight) -> torch.Tensor:
    s = qw.scale[:, None] if qw.scale.numel() > 1 else qw.scale
    return qw.q.float() * s


QuantWeight = Int8Weight | Int4Weight | Fp8Weight


def dequantize(qw: QuantWeight) -> torch.Tensor:
    """The float32 [N, K] weight any of the three layouts stands for."""
    if isinstance(qw, Int8Weight):
        return dequantize_int8(qw)
    return dequantize_int4(qw) if isinstance(qw, Int4Weight) else dequantize_fp8(qw)


def cat_rows(parts: list[QuantWeight]) -> QuantWeight:
    """Weights of one layout stacked along N (the fused qkv / gate_up projections). Per-tensor
    fp8 scales that differ become per-channel ones (exact: each row keeps its scale)."""
    first = parts[0]
    if isinstance(first, Int4Weight):
        return Int4Weight(torch.cat([p.packed for p in parts]), torch.cat([p.scale for p in parts]),
                          torch.cat([p.min for p in parts]), first.group)
    if isinstance(first, Int8Weight):
        return Int8Weight(torch.cat([p.q for p in parts]), torch.cat([p.scale for p in parts]),
                          first.group)
    scales = [p.scale for p in parts]
    if all(s.numel() == 1 for s in scales) and all(torch.equal(s, scales[0]) for s in scales):
        return Fp8Weight(torch.cat([p.q for p in parts]), scales[0])
    return Fp8Weight(torch.cat([p.q for p in parts]),
                     torch.cat([s.expand(p.q.shape[0]) for s, p in zip(scales, parts)]))
