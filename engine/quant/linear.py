"""QuantLinear: a drop-in for the model's nn.Linear layers with a quantized weight, and
`quantize_model`, the seam that swaps them in after loading.

Where each method runs (x: [M, K] activations, M = tokens in the step):

              CPU                                         CUDA
  int8        M <= 16: aten._weight_int8pack_mm (bf16 x)   M <= 16: Triton w8_matmul
              else: dequantize, F.linear                   else: dequantize, F.linear
  int4_gN     aten._weight_int4pack_mm_for_cpu (bf16 x)    M <= 16: Triton int4_matmul
                                                           else: dequantize, F.linear
  fp8         dequantize, F.linear (saves memory only)     M <= 16: Triton w8_matmul
                                                           else: torch._scaled_mm, x quantized
                                                           per token (per tensor for fp8_tensor)

torch's CPU int8/int4 kernels are fast only for bfloat16 activations (float32 ones take a
slow generic path: measured 8-25x slower), so x is rounded to bfloat16 for them.
The CPU int4 kernel wants its own packed layout (`_convert_weight_to_int4pack_for_cpu`) and
scale/zero pairs; on CPU that is the only copy kept (layers with N % 16 != 0, which it
refuses, keep the plain layout and dequantize).
"""
from __future__ import annotations

import torch
from torch import nn

from engine.config import QUANTIZATIONS as METHODS

from .quantize import (FP8_MAX, Int4Weight, dequantize_int4, quantize_fp8, quantize_int4, quantize_int8,
                       unpack_int4)

SMALL_M = 16                    # up to this many rows: the weight-only kernels


def check_method(name: str) -> str:
    if name not in METHODS:
        raise ValueError(f"unknown quantization {name!r}: expected one of {METHODS}")
    return name


class QuantLinear(nn.Module):
    """y = x @ W.T (+ bias) with W held quantized. Build with `from_float` or `from_quantized`."""

    def __init__(self, method: str, in_features: int, out_features: int,
                 bias: torch.Tensor | None, device: torch.device):
        super().__init__()
        self.method, self.in_features, self.out_features = method, in_features, out_features
        self.on_cpu = torch.device(device).type == "cpu"
        # torch's CPU int4 kernel needs N % 16 == 0; other shapes keep the plain layout
        self.cpu_int4 = self.on_cpu and method.startswith("int4") and out_features % 16 == 0
        self.group = int(method.split("_g")[1]) if method.startswith("int4") else 0
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)

    @classmethod
    def from_float(cls, method: str, weight: torch.Tensor, bias: torch.Tensor | None = None):
        n, k = weight.shape
        if method == "int8":
            return cls.from_quantized(method, quantize_int8(weight), bias)
        if method.startswith("int4"):
            return cls.from_quantized(method, quantize_int4(weight, int(method.split("_g")[1])), bias)
        if method in ("fp8", "fp8_tensor"):
            return cls.from_quantized(method, quantize_fp8(weight, method == "fp8"), bias)
        raise ValueError(f"cannot quantize to {method!r}")

    @classmethod
    def from_quantized(cls, method: str, qw, bias: torch.Tensor | None = None) -> "QuantLinear":
        """From an Int8Weight / Int4Weight / Fp8Weight (on the device the layer runs on)."""
        if method.startswith("int4"):
            n, k = qw.shape
            dev = qw.packed.device
        else:
            n, k = qw.q.shape
            dev = qw.q.device
        self = cls(method, k, n, bias, dev)
        if method == "int8":
            self.register_buffer("qweight", qw.q)
            self.register_buffer("scale", qw.scale.float())
            if self.on_cpu:     # the CPU kernel takes scales in the activation dtype
                self.scale = self.scale.bfloat16()
        elif method.startswith("int4"):
            if self.group != qw.group:
                raise ValueError(f"{method} layer given group-{qw.group} weights")
            if self.cpu_int4:
                codes = unpack_int4(qw.packed)
                self.register_buffer("qweight", torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 1))
                # torch's int4 dequantization is (q - 8) * scale + zero
                zero = qw.min.float() + 8 * qw.scale.float()
                sz = torch.stack((qw.scale.float().T, zero.T), dim=-1).contiguous()
                self.register_buffer("scales_and_zeros", sz.bfloat16())   # [K/g, N, 2]
            else:
                self.register_buffer("qweight", qw.packed)
                self.register_buffer("scale", qw.scale)
                self.register_buffer("min", qw.min)
        else:
            self.register_buffer("qweight", qw.q)
            self.register_buffer("scale", qw.scale.float())
        return self

    def extra_repr(self) -> str:
        return f"{self.method}, in={self.in_features}, out={self.out_features}"

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The [N, K] weight this layer multiplies by (off the CPU int4 layout: not kept)."""
        if self.method == "int8":
            w = self.qweight.float() * self.scale.float()[:, None]
        elif self.method.startswith("int4"):
            if self.cpu_int4:
                eye = torch.eye(self.in_features, dtype=torch.bfloat16)
                w = torch.ops.aten._weight_int4pack_mm_for_cpu(
                    eye, self.qweight, self.group, self.scales_and_zeros).float().T
            else:
                w = dequantize_int4(Int4Weight(self.qweight, self.scale, self.min, self.group))
        else:
            w = self.qweight.float() * (self.scale[:, None] if self.method == "fp8" else self.scale)
        return w.to(dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, self.in_features)
        y = self._matmul(x2).to(x.dtype)
        if self.bias is not None:
            y = y + self.bias
        return y.view(*shape[:-1], self.out_features)

    def _matmul(self, x: torch.Tensor) -> torch.Tensor:
        m = x.shape[0]
        if self.on_cpu:
            if self.method == "int8" and m <= SMALL_M:
                return torch.ops.aten._weight_int8pack_mm(x.bfloat16(), self.qweight, self.scale)
            if self.cpu_int4:
                return torch.ops.aten._weight_int4pack_mm_for_cpu(
                    x.bfloat16(), self.qweight, self.group, self.scales_and_zeros)
            return nn.functional.linear(x, self.dequantize(x.dtype))
        from engine.kernels import quant_matmul as qm
        if m <= SMALL_M:
            if self.method.startswith("int4"):
                return qm.int4_matmul(x, self.qweight, self.scale, self.min, self.group)
            return qm.w8_matmul(x, self.qweight, self._channel_scale())
        if self.method.startswith("fp8"):
            return scaled_mm_fp8(x, self.qweight, self.scale, self.method == "fp8")
        return nn.functional.linear(x, self.dequantize(x.dtype))

    def _channel_scale(self) -> torch.Tensor:
        s = self.scale
        return s.expand(self.out_features).contiguous() if s.numel() == 1 and self.out_features > 1 else s


class QuantEmbedding(nn.Module):
    """nn.Embedding over an int8 table with a scale per row."""

    def __init__(self, qw, dtype: torch.dtype):
        super().__init__()
        self.dtype = dtype
        self.register_buffer("qweight", qw.q)
        self.register_buffer("scale", qw.scale.float())

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return (self.qweight[ids].float() * self.scale[ids, None]).to(self.dtype)


def scaled_mm_fp8(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, rowwise: bool) -> torch.Tensor:
    """x @ (q * scale).T through torch._scaled_mm, x quantized to e4m3 on the fly (per row when
    the weight has per-channel scales, per tensor otherwise)."""
    xf = x.float()
    if rowwise:
        sx = xf.abs().amax(dim=1, keepdim=True).clamp(min=1e-12) / FP8_MAX      # [M, 1]
        sw = scale.view(1, -1)                                                 # [1, N]
    else:
        sx = xf.abs().amax().clamp(min=1e-12) / FP8_MAX
        sw = scale.reshape(())
    xq = (xf / sx).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    out_dtype = x.dtype if x.dtype != torch.float32 else torch.bfloat16
    return torch._scaled_mm(xq, q.t(), scale_a=sx, scale_b=sw, out_dtype=out_dtype)


_LINEARS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")


def quantize_model(model: nn.Module, method: str) -> nn.Module:
    """Replace every decoder linear layer of a loaded CausalLM by a QuantLinear of `method`, in
    place; the float weights are dropped. The output head becomes int8 under every method
    (SmolLM2-135M: an fp8 head and embedding cost +3.0% perplexity, int8 ones 0.5%; llama.cpp
    keeps its output in 8 bits too) and the embedding table int8 with a scale per row, shared
    with a tied head (a lookup dequantizes the rows it reads). Norms stay as they are. 'none'
    leaves the model untouched."""
    if check_method(method) == "none":
        return model
    emb = model.embed_tokens.weight.data
    q8 = quantize_int8(emb)
    if model.lm_head is not None:
        model.lm_head = QuantLinear.from_float("int8", model.lm_head.weight.data)
    else:                       # tied: one int8 table (per-row scales) for lookups and logits
        model.lm_head = QuantLinear.from_quantized("int8", q8)
    model.embed_tokens = QuantEmbedding(q8, emb.dtype)
    for layer in model.layers:
        for parent in (layer.self_attn, layer.mlp):
            for name in _LINEARS:
                lin = getattr(parent, name, None)
                if isinstance(lin, nn.Linear):
                    setattr(parent, name, QuantLinear.from_float(
                        method, lin.weight.data, None if lin.bias is None else lin.bias.data))
    return model


def weight_bytes(model: nn.Module) -> int:
    """Bytes of a model's weights as held (parameters and persistent buffers, each once)."""
    seen, total = set(), 0
    for t in model.state_dict().values():
        if t.data_ptr() not in seen:
            seen.add(t.data_ptr())
            total += t.nbytes
    return total
