"""rms_norm, optionally fused with the residual add that precedes it in a Llama block."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._checks import FLOAT_DTYPES, check_out, check_tensor


@triton.jit
def _rms_norm_kernel(x_ptr, r_ptr, w_ptr, out_ptr, rout_ptr,
                     stride_x, stride_r, stride_o, stride_ro, N, eps,
                     HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr):
    # One program per row. Rounding follows the reference step by step:
    #   x = (x + r) in x.dtype  ->  h = fp32(x) * rsqrt(mean(h^2) + eps)
    #   out = w * h.to(x.dtype)  (product in fp32, rounded once to out.dtype)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < N
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(r_ptr + row * stride_r + cols, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x_ptr.dtype.element_ty)
        tl.store(rout_ptr + row * stride_ro + cols, x, mask=mask)
    h = x.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(h * h, axis=0) / N + eps)
    hn = (h * rstd).to(x_ptr.dtype.element_ty).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols, (w * hn).to(out_ptr.dtype.element_ty), mask=mask)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None, *, out: torch.Tensor | None = None,
             residual_out: torch.Tensor | None = None):
    """x: [..., N], weight [N]. Returns out, or (out, x + residual) when `residual` is given.
    `out` / `residual_out` may alias `x` / `residual` (each row is read before it is written).
    out.dtype is torch.result_type(weight, x), like the reference's `weight * h`."""
    check_tensor("x", x, None, FLOAT_DTYPES)
    n = x.shape[-1]
    check_tensor("weight", weight, 1, FLOAT_DTYPES, x.device)
    if weight.shape[0] != n:
        raise ValueError(f"weight has {weight.shape[0]} elements, x rows have {n}")
    # x may be a per-head view into fused q/k/v rows ([T, H, N], Qwen3's and GLM's q/k norm),
    # which no [M, N] view covers: read a copy (only out / residual_out must be views)
    x2 = _rows("x", x if _viewable(x) else x.contiguous())
    m = x2.shape[0]
    out_dtype = torch.result_type(weight, x)
    if out is None:
        out = torch.empty(x.shape, dtype=out_dtype, device=x.device)
    check_out("out", out, tuple(x.shape), out_dtype, x.device)
    o2 = _rows("out", out)
    r2 = ro2 = x2
    if residual is not None:
        check_out("residual", residual, tuple(x.shape), x.dtype, x.device)
        if residual_out is None:
            residual_out = torch.empty_like(x)
        check_out("residual_out", residual_out, tuple(x.shape), x.dtype, x.device)
        r2, ro2 = residual.reshape(-1, n), _rows("residual_out", residual_out)
    block = triton.next_power_of_2(n)
    if m > 0:
        _rms_norm_kernel[(m,)](x2, r2, weight.contiguous(), o2, ro2,
                               x2.stride(0), r2.stride(0), o2.stride(0), ro2.stride(0), n, float(eps),
                               HAS_RESIDUAL=residual is not None, BLOCK=block,
                               num_warps=min(16, max(1, block // 256)))
    return out if residual is None else (out, residual_out)


def _viewable(t: torch.Tensor) -> bool:
    try:
        t.view(-1, t.shape[-1])
        return True
    except RuntimeError:
        return False


def _rows(name: str, t: torch.Tensor) -> torch.Tensor:
    """[..., N] as a [M, N] view (no copy: a copy would lose writes to out/residual_out)."""
    try:
        return t.view(-1, t.shape[-1])
    except RuntimeError:
        raise ValueError(f"{name} with strides {t.stride()} cannot be viewed as rows") from None
