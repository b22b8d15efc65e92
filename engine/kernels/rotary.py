"""Neox-style (rotate-half) rotary embedding applied to q and k from a cos/sin cache.

The cache's width R is the rotary dimension: the first R values of each head rotate (halves
R/2 apart), the last D - R pass through unchanged (partial rotary, GLM-4.5 / MiniMax-M2):

    head  [ x1 (R/2) | x2 (R/2) | pass (D - R) ]  ->  [ x1 cos - x2 sin | x2 cos + x1 sin | pass ]
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._checks import FLOAT_DTYPES, check_out, check_shape, check_tensor
from .rope import build_cos_sin_cache  # noqa: F401  (re-exported: the cache this kernel reads)


@triton.jit
def _cos_sin(cs_ptr, p, stride_cs, i, HALF):
    """cos_sin_cache[p] = [cos_0 .. cos_{D/2-1} | sin_0 .. sin_{D/2-1}] at columns i."""
    cos = tl.load(cs_ptr + p * stride_cs + i, mask=i < HALF, other=0.0)
    sin = tl.load(cs_ptr + p * stride_cs + HALF + i, mask=i < HALF, other=0.0)
    return cos, sin


@triton.jit
def _rotated(x_ptr, mask, cos, sin, HALF):
    """x = [x1 | x2] at x_ptr (+ HALF) -> (x1*cos - x2*sin, x2*cos + x1*sin) in fp32."""
    x1 = tl.load(x_ptr, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(x_ptr + HALF, mask=mask, other=0.0).to(tl.float32)
    return x1 * cos - x2 * sin, x2 * cos + x1 * sin


@triton.jit
def _store_rotated(x_ptr, o_ptr, mask, cos, sin, HALF):
    r1, r2 = _rotated(x_ptr, mask, cos, sin, HALF)
    tl.store(o_ptr, r1.to(o_ptr.dtype.element_ty), mask=mask)
    tl.store(o_ptr + HALF, r2.to(o_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _copy_pass(x_ptr, o_ptr, mask_h, ROT, PASS, BLOCK_PASS: tl.constexpr):
    """o[ROT + j] = x[ROT + j] for j < PASS (the heads of mask_h): partial rotary's
    pass-through columns. x_ptr / o_ptr point at each head's first value."""
    j = tl.arange(0, BLOCK_PASS)[None, :]
    m = mask_h & (j < PASS)
    x = tl.load(x_ptr + ROT + j, mask=m, other=0.0)
    tl.store(o_ptr + ROT + j, x.to(o_ptr.dtype.element_ty), mask=m)


@triton.jit
def _rotate_q(pos_ptr, q_ptr, cs_ptr, qo_ptr, stride_qt, stride_qh, stride_qot, stride_qoh,
              stride_cs, HQ, HALF, BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr):
    """This program's token t and heads h (columns i): q_out[t, h] = rot(q[t, h]); returns
    (t, h, i, cos, sin) for the kernel's k."""
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)[:, None]
    i = tl.arange(0, BLOCK_HALF)[None, :]
    cos, sin = _cos_sin(cs_ptr, tl.load(pos_ptr + t).to(tl.int64), stride_cs, i, HALF)
    _store_rotated(q_ptr + t * stride_qt + h * stride_qh + i, qo_ptr + t * stride_qot + h * stride_qoh + i,
                   (h < HQ) & (i < HALF), cos, sin, HALF)
    return t, h, i, cos, sin


@triton.jit
def _rotary_embedding_kernel(pos_ptr, q_ptr, k_ptr, cs_ptr, qo_ptr, ko_ptr,
                             stride_qt, stride_qh, stride_kt, stride_kh,
                             stride_qot, stride_qoh, stride_kot, stride_koh, stride_cs,
                             HQ, HK, HALF, PASS,
                             BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr,
                             BLOCK_PASS: tl.constexpr, HAS_PASS: tl.constexpr):
    # grid (T, cdiv(max(HQ, HK), BLOCK_H)). For token t at position p and every head:
    #   x = [x1 | x2 | pass]  ->  [x1*cos - x2*sin | x2*cos + x1*sin | pass]   (fp32, rounded once)
    t, h, i, cos, sin = _rotate_q(pos_ptr, q_ptr, cs_ptr, qo_ptr, stride_qt, stride_qh, stride_qot,
                                  stride_qoh, stride_cs, HQ, HALF, BLOCK_H, BLOCK_HALF)
    _store_rotated(k_ptr + t * stride_kt + h * stride_kh + i, ko_ptr + t * stride_kot + h * stride_koh + i,
                   (h < HK) & (i < HALF), cos, sin, HALF)
    if HAS_PASS:
        _copy_pass(q_ptr + t * stride_qt + h * stride_qh, qo_ptr + t * stride_qot + h * stride_qoh,
                   h < HQ, 2 * HALF, PASS, BLOCK_PASS)
        _copy_pass(k_ptr + t * stride_kt + h * stride_kh, ko_ptr + t * stride_kot + h * stride_koh,
                   h < HK, 2 * HALF, PASS, BLOCK_PASS)


def check_positions(positions: torch.Tensor, cos_sin_cache: torch.Tensor, t: int, d: int, dev) -> int:
    """positions [t] int32/int64 and a float32 [max_pos, R] cos/sin cache on `dev`, R even
    and at most head_dim `d`; returns R, the rotary dimension."""
    check_tensor("positions", positions, 1, (torch.int32, torch.int64), dev)
    check_shape("positions", positions, (t,))
    check_tensor("cos_sin_cache", cos_sin_cache, 2, (torch.float32,), dev)
    r = cos_sin_cache.shape[1]
    if r % 2 or not 0 < r <= d:
        raise ValueError(f"cos_sin_cache rows have {r} values: the rotary dimension must be even "
                         f"and at most head_dim {d}")
    return r


def pass_args(d: int, r: int) -> dict:
    """The launch arguments of the pass-through columns D - R (partial rotary)."""
    return dict(PASS=d - r, BLOCK_PASS=triton.next_power_of_2(max(d - r, 1)), HAS_PASS=d > r)


def rotary_embedding(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                     cos_sin_cache: torch.Tensor, *, q_out: torch.Tensor | None = None,
                     k_out: torch.Tensor | None = None):
    """positions [T] int; q [T, H_q, D]; k [T, H_kv, D]; cos_sin_cache [max_pos, R] fp32
    (R <= D: the rotary dimension, the rest passed through). Returns (q_out, k_out); passing q_out=q, k_out=k rotates in place. Positions must be
    < max_pos (not checked on device: no host sync)."""
    check_tensor("q", q, 3, FLOAT_DTYPES)
    dev = q.device
    t, hq, d = q.shape
    check_tensor("k", k, 3, (q.dtype,), dev)
    if k.shape[0] != t or k.shape[2] != d:
        raise ValueError(f"k has shape {tuple(k.shape)}; expected ({t}, H_kv, {d}) to match q")
    hk = k.shape[1]
    r = check_positions(positions, cos_sin_cache, t, d, dev)
    if q_out is None:
        q_out = torch.empty_like(q)
    if k_out is None:
        k_out = torch.empty_like(k)
    check_out("q_out", q_out, tuple(q.shape), q.dtype, dev)
    check_out("k_out", k_out, tuple(k.shape), k.dtype, dev)
    if t == 0:
        return q_out, k_out
    block_h = min(16, triton.next_power_of_2(max(hq, hk)))
    grid = (t, triton.cdiv(max(hq, hk), block_h))
    _rotary_embedding_kernel[grid](
        positions, q, k, cos_sin_cache, q_out, k_out,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1),
        q_out.stride(0), q_out.stride(1), k_out.stride(0), k_out.stride(1), cos_sin_cache.stride(0),
        hq, hk, r // 2, BLOCK_H=block_h, BLOCK_HALF=triton.next_power_of_2(r // 2), **pass_args(d, r))
    return q_out, k_out
