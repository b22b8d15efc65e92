"""Weight-only quantized GEMMs with the dequantization fused: y = x @ dequant(W).T.

For small batches (decode), where a linear layer is bound by reading its weight: the weight
crosses memory in 8 or 4 bits and is widened to x's dtype in registers. Layouts are
engine/kernels/packing.py's:

  w8_matmul    q [N, K] int8 or float8_e4m3fn, scale [N] fp32:   y = (x @ q.T) * scale
  int4_matmul  packed [N, K/2] uint8 (even k low nibble), scale/min [N, K/g] fp16:
               y = x @ (q * scale[n, k//g] + min[n, k//g]).T

Grid: (M tiles, N tiles, K splits). At batch 1 an N-tiling alone leaves most SMs idle, so K
is split until there are about two programs per SM; partial sums then meet by atomic_add
in an fp32 buffer. The torch references (`*_reference`) dequantize then matmul in fp32.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._checks import FLOAT_DTYPES, check_shape, check_tensor, dot_precision, upcast_dot

BLOCK_M, BLOCK_N, BLOCK_K = 16, 64, 128


@triton.jit
def _wq_matmul_kernel(x_ptr, w_ptr, s_ptr, mn_ptr, y_ptr, M, N, K, stride_xm, stride_w,
                      stride_s, stride_ym, k_per_split,
                      INT4: tl.constexpr, GROUP: tl.constexpr, ATOMIC: tl.constexpr,
                      PREC: tl.constexpr, UPCAST: tl.constexpr,
                      BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    # Program (pm, pn, ps) computes y[pm tile, pn tile] over k in [ps*k_per_split, +k_per_split).
    # int8/fp8: acc = sum_k x[m,k] * q[n,k]; y = acc * s[n]
    # int4:     w[n,k] = ((byte[n, k//2] >> 4*(k%2)) & 15) * s[n, k//g] + min[n, k//g]
    pm, pn, ps = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    rm = pm * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = (pn * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    m_ok, n_ok = rm < M, rn < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    k_lo = ps * k_per_split
    for k0 in range(k_lo, tl.minimum(k_lo + k_per_split, K), BLOCK_K):
        rk = k0 + tl.arange(0, BLOCK_K)
        k_ok = rk < K
        x = tl.load(x_ptr + rm[:, None] * stride_xm + rk[None, :],
                    mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        if INT4:
            # each packed byte once (coalesced), both nibbles interleaved back into k order;
            # each group's scale and min once, broadcast over the group (BLOCK_K % GROUP == 0)
            rb = k0 // 2 + tl.arange(0, BLOCK_K // 2)
            byte = tl.load(w_ptr + rn[:, None] * stride_w + rb[None, :],
                           mask=n_ok[:, None] & (rb < K // 2)[None, :], other=0)
            q = tl.reshape(tl.join(byte & 15, byte >> 4), (BLOCK_N, BLOCK_K)).to(tl.float32)
            rg = k0 // GROUP + tl.arange(0, BLOCK_K // GROUP)
            gmask = n_ok[:, None] & (rg < K // GROUP)[None, :]
            g = rn[:, None] * stride_s + rg[None, :]
            s = tl.load(s_ptr + g, mask=gmask, other=0.0).to(tl.float32)
            mn = tl.load(mn_ptr + g, mask=gmask, other=0.0).to(tl.float32)
            w = tl.reshape(tl.reshape(q, (BLOCK_N, BLOCK_K // GROUP, GROUP)) * s[:, :, None]
                           + mn[:, :, None], (BLOCK_N, BLOCK_K))
        else:
            w = tl.load(w_ptr + rn[:, None] * stride_w + rk[None, :],
                        mask=n_ok[:, None] & k_ok[None, :], other=0.0)
        if UPCAST:     # the interpreter's bf16 dot and bf16 casts are wrong: fp32 there
            x, w = x.to(tl.float32), w.to(tl.float32)
        else:
            w = w.to(x.dtype)
        acc = tl.dot(x, tl.trans(w), acc, input_precision=PREC)
    if not INT4:
        acc = acc * tl.load(s_ptr + rn, mask=n_ok, other=0.0)[None, :]
    ptrs = y_ptr + rm[:, None] * stride_ym + rn[None, :]
    mask = m_ok[:, None] & n_ok[None, :]
    if ATOMIC:
        tl.atomic_add(ptrs, acc, mask=mask)
    else:
        tl.store(ptrs, acc.to(y_ptr.dtype.element_ty), mask=mask)


def _num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 1


def _launch(x, w, s, mn, n: int, k: int, int4: bool, group: int, k_splits: int | None):
    check_tensor("x", x, None, FLOAT_DTYPES)
    if x.shape[-1] != k:
        raise ValueError(f"x has {x.shape[-1]} features, the weight {k}")
    x2 = x.reshape(-1, k)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    m = x2.shape[0]
    out_shape = (*x.shape[:-1], n)
    if m == 0 or n == 0:
        return torch.zeros(out_shape, dtype=x.dtype, device=x.device)
    tiles = triton.cdiv(m, BLOCK_M) * triton.cdiv(n, BLOCK_N)
    k_blocks = triton.cdiv(k, BLOCK_K)
    splits = k_splits or max(1, min(k_blocks, 2 * _num_sms(x.device) // tiles))
    k_per_split = triton.cdiv(k_blocks, splits) * BLOCK_K
    splits = triton.cdiv(k, k_per_split)
    atomic = splits > 1
    y = (torch.zeros if atomic else torch.empty)(m, n, dtype=torch.float32 if atomic else x.dtype,
                                                 device=x.device)
    _wq_matmul_kernel[(triton.cdiv(m, BLOCK_M), triton.cdiv(n, BLOCK_N), splits)](
        x2, w, s, mn, y, m, n, k, x2.stride(0), w.stride(0), s.stride(0) if int4 else 0,
        y.stride(0), k_per_split, INT4=int4, GROUP=group, ATOMIC=atomic,
        PREC=dot_precision(x.dtype), UPCAST=upcast_dot(x.dtype),
        BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K)
    return y.to(x.dtype).view(out_shape)


def w8_matmul(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, *,
              k_splits: int | None = None) -> torch.Tensor:
    """x [..., K] @ (q [N, K] int8|float8_e4m3fn * scale [N] fp32).T -> [..., N] in x.dtype.
    `k_splits`: how many programs share K (default: enough for ~2 programs per SM)."""
    check_tensor("q", q, 2, (torch.int8, torch.float8_e4m3fn), x.device)
    n, k = q.shape
    check_tensor("scale", scale, 1, (torch.float32,), x.device)
    check_shape("scale", scale, (n,))
    return _launch(x, q, scale, scale, n, k, False, 1, k_splits)


def int4_matmul(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, mn: torch.Tensor,
                group: int, *, k_splits: int | None = None) -> torch.Tensor:
    """x [..., K] @ dequant(packed [N, K/2], scale/min [N, K/group] fp16).T -> [..., N]."""
    check_tensor("packed", packed, 2, (torch.uint8,), x.device)
    n, k = packed.shape[0], 2 * packed.shape[1]
    if k % group:
        raise ValueError(f"K={k} is not a multiple of the group size {group}")
    if BLOCK_K % group:
        raise ValueError(f"group size {group} must divide {BLOCK_K} (32, 64 or 128)")
    for name, t in (("scale", scale), ("min", mn)):
        check_tensor(name, t, 2, (torch.float16,), x.device)
        check_shape(name, t, (n, k // group))
    if scale.stride() != mn.stride():
        raise ValueError("scale and min must have the same strides")
    return _launch(x, packed, scale, mn, n, k, True, group, k_splits)


def w8_matmul_reference(x, q, scale):
    return (x.float() @ (q.float() * scale[:, None]).T).to(x.dtype)


def int4_matmul_reference(x, packed, scale, mn, group):
    from .reference import dequantize_int4
    w = dequantize_int4(packed, scale, mn, group)
    return (x.float() @ w.T).to(x.dtype)
