"""silu_and_mul: the SwiGLU gate of a Llama MLP; gelu_tanh_and_mul: Gemma's GeGLU gate;
gpt_oss_swiglu: GPT-OSS's clamped SwiGLU."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._checks import FLOAT_DTYPES, check_out, check_tensor


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, stride_x, stride_o, I, BLOCK: tl.constexpr):
    # grid (rows, cdiv(I, BLOCK)); row = [gate (I) | up (I)].
    # Rounded like the reference: silu(gate) is rounded to the input dtype before the product.
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < I
    g = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(x_ptr + row * stride_x + I + cols, mask=mask, other=0.0).to(tl.float32)
    s = (g / (1.0 + tl.exp(-g))).to(x_ptr.dtype.element_ty).to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols, (s * u).to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _gelu_tanh_and_mul_kernel(x_ptr, out_ptr, stride_x, stride_o, I, BLOCK: tl.constexpr):
    # as _silu_and_mul_kernel, with gelu_tanh(g) = g/2 * (1 + tanh(sqrt(2/pi) (g + 0.044715 g^3)))
    # and tanh(z) = sign(z) (1 - e^(-2|z|)) / (1 + e^(-2|z|)) (no overflow)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < I
    g = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(x_ptr + row * stride_x + I + cols, mask=mask, other=0.0).to(tl.float32)
    z = 0.7978845608028654 * (g + 0.044715 * g * g * g)
    e = tl.exp(-2.0 * tl.abs(z))
    t = (1.0 - e) / (1.0 + e)
    t = tl.where(z < 0, -t, t)
    s = (0.5 * g * (1.0 + t)).to(x_ptr.dtype.element_ty).to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols, (s * u).to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul(x: torch.Tensor, *, out: torch.Tensor | None = None) -> torch.Tensor:
    """x: [..., 2I] = cat(gate, up) -> silu(gate) * up: [..., I]."""
    return _gated(_silu_and_mul_kernel, x, out)


def gelu_tanh_and_mul(x: torch.Tensor, *, out: torch.Tensor | None = None) -> torch.Tensor:
    """x: [..., 2I] = cat(gate, up) -> gelu_tanh(gate) * up: [..., I]."""
    return _gated(_gelu_tanh_and_mul_kernel, x, out)


def _gated(kernel, x: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
    check_tensor("x", x, None, FLOAT_DTYPES)
    if x.shape[-1] % 2:
        raise ValueError(f"x's last dim must be even (gate | up), got {x.shape[-1]}")
    i = x.shape[-1] // 2
    shape = tuple(x.shape[:-1]) + (i,)
    if out is None:
        out = torch.empty(shape, dtype=x.dtype, device=x.device)
    check_out("out", out, shape, x.dtype, x.device)
    try:
        x2, o2 = x.view(-1, 2 * i), out.view(-1, i)
    except RuntimeError:
        raise ValueError("x and out must be viewable as rows (contiguous leading dims)") from None
    block = min(1024, triton.next_power_of_2(max(i, 1)))
    if x2.shape[0] > 0 and i > 0:
        kernel[(x2.shape[0], triton.cdiv(i, block))](
            x2, o2, x2.stride(0), o2.stride(0), i, BLOCK=block)
    return out


@triton.jit
def _gpt_oss_swiglu_kernel(x_ptr, out_ptr, stride_x, stride_o, I, alpha, limit, BLOCK: tl.constexpr):
    # grid (rows, cdiv(I, BLOCK)); row = [gate (I) | up (I)]; fp32 throughout, one rounding.
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < I
    g = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(x_ptr + row * stride_x + I + cols, mask=mask, other=0.0).to(tl.float32)
    g = tl.minimum(g, limit)
    u = tl.minimum(tl.maximum(u, -limit), limit)
    y = (u + 1.0) * (g / (1.0 + tl.exp(-alpha * g)))
    tl.store(out_ptr + row * stride_o + cols, y.to(out_ptr.dtype.element_ty), mask=mask)


def gpt_oss_swiglu(x: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    """x: [T, 2I] = cat(gate, up) -> (clamp(up, -limit, limit) + 1) * g * sigmoid(alpha g),
    g = min(gate, limit): [T, I] (reference.gpt_oss_swiglu)."""
    check_tensor("x", x, 2, FLOAT_DTYPES)
    if x.shape[-1] % 2:
        raise ValueError(f"x's last dim must be even (gate | up), got {x.shape[-1]}")
    t, i = x.shape[0], x.shape[1] // 2
    x = x if x.stride(-1) == 1 else x.contiguous()
    out = torch.empty(t, i, dtype=x.dtype, device=x.device)
    block = min(1024, triton.next_power_of_2(max(i, 1)))
    if t > 0 and i > 0:
        _gpt_oss_swiglu_kernel[(t, triton.cdiv(i, block))](
            x, out, x.stride(0), out.stride(0), i, float(alpha), float(limit), BLOCK=block)
    return out
