"""Rotary embedding fused with the KV-cache write: one launch per layer rotates q (to q_out)
and k, and writes the rotated k and v straight into their paged-cache slots (the rotated k is
never written anywhere else: attention reads K from the cache)."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._checks import FLOAT_DTYPES, check_out, check_shape, check_tensor
from .rotary import _copy_pass, _rotate_q, _rotated, check_positions, pass_args


@triton.jit
def _rotary_write_kv_kernel(pos_ptr, q_ptr, k_ptr, v_ptr, cs_ptr, qo_ptr, kc_ptr, vc_ptr, slot_ptr,
                            stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh,
                            stride_qot, stride_qoh, stride_cs, stride_cb, stride_co, stride_ch,
                            block_size, HQ, HK, HALF, PASS,
                            BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr,
                            BLOCK_PASS: tl.constexpr, HAS_PASS: tl.constexpr):
    # grid (T, cdiv(max(HQ, HK), BLOCK_H)). Token t at position p, heads h of this program:
    #   q_out[t, h] = rot(q[t, h])                       rot(x) = [x1*cos - x2*sin | x2*cos + x1*sin]
    #   cache[slot] = rot(k[t, h]), v[t, h]              (slot < 0: padding, nothing written)
    #   slot = block * block_size + offset -> block * stride_cb + offset * stride_co (int64)
    t, h, i, cos, sin = _rotate_q(pos_ptr, q_ptr, cs_ptr, qo_ptr, stride_qt, stride_qh, stride_qot,
                                  stride_qoh, stride_cs, HQ, HALF, BLOCK_H, BLOCK_HALF)

    slot = tl.load(slot_ptr + t).to(tl.int64)
    # (slot >= 0) broadcast to the heads: the interpreter rejects a scalar mask term
    mh = (h < HK) & (h * 0 + slot >= 0)                # [BLOCK_H, 1]
    mk = mh & (i < HALF)
    slot = tl.maximum(slot, 0)
    dst = (slot // block_size) * stride_cb + (slot % block_size) * stride_co + h * stride_ch + i
    kr1, kr2 = _rotated(k_ptr + t * stride_kt + h * stride_kh + i, mk, cos, sin, HALF)
    # k rounds to its own dtype first, as rotary_embedding then write_kv_cache would
    tl.store(kc_ptr + dst, kr1.to(k_ptr.dtype.element_ty).to(kc_ptr.dtype.element_ty), mask=mk)
    tl.store(kc_ptr + dst + HALF, kr2.to(k_ptr.dtype.element_ty).to(kc_ptr.dtype.element_ty), mask=mk)
    v1 = tl.load(v_ptr + t * stride_vt + h * stride_vh + i, mask=mk, other=0.0)
    v2 = tl.load(v_ptr + t * stride_vt + h * stride_vh + HALF + i, mask=mk, other=0.0)
    tl.store(vc_ptr + dst, v1.to(vc_ptr.dtype.element_ty), mask=mk)
    tl.store(vc_ptr + dst + HALF, v2.to(vc_ptr.dtype.element_ty), mask=mk)
    if HAS_PASS:    # partial rotary: columns 2*HALF.. of q, k and v are copied as they are
        _copy_pass(q_ptr + t * stride_qt + h * stride_qh, qo_ptr + t * stride_qot + h * stride_qoh,
                   h < HQ, 2 * HALF, PASS, BLOCK_PASS)
        head = (slot // block_size) * stride_cb + (slot % block_size) * stride_co + h * stride_ch
        _copy_pass(k_ptr + t * stride_kt + h * stride_kh, kc_ptr + head, mh, 2 * HALF, PASS, BLOCK_PASS)
        _copy_pass(v_ptr + t * stride_vt + h * stride_vh, vc_ptr + head, mh, 2 * HALF, PASS, BLOCK_PASS)


def rotary_embedding_write_kv(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                              v: torch.Tensor, cos_sin_cache: torch.Tensor, k_cache: torch.Tensor,
                              v_cache: torch.Tensor, slot_mapping: torch.Tensor, *,
                              q_out: torch.Tensor | None = None) -> torch.Tensor:
    """positions [T]; q [T, H_q, D]; k, v [T, H_kv, D]; cos_sin_cache [max_pos, R] fp32 (R <= D
    the rotary dimension: partial rotary passes the rest of q and k through);
    caches [num_blocks, block_size, H_kv, D]; slot_mapping [T] (< 0: skip). Returns q_out
    (rotated q). Slots must be distinct; positions < max_pos (not checked on device)."""
    check_tensor("q", q, 3, FLOAT_DTYPES)
    dev = q.device
    t, hq, d = q.shape
    check_tensor("k_cache", k_cache, 4, FLOAT_DTYPES, dev)
    nb, bs, hk, dk = k_cache.shape
    if dk != d:
        raise ValueError(f"head_dim must be equal in q ({d}) and the cache ({dk})")
    check_tensor("v_cache", v_cache, 4, (k_cache.dtype,), dev)
    check_shape("v_cache", v_cache, k_cache.shape)
    if v_cache.stride() != k_cache.stride():
        raise ValueError(f"v_cache strides {v_cache.stride()} differ from k_cache's {k_cache.stride()}")
    for name, x in (("k", k), ("v", v)):
        check_tensor(name, x, 3, (q.dtype,), dev)
        check_shape(name, x, (t, hk, d))
    r = check_positions(positions, cos_sin_cache, t, d, dev)
    check_tensor("slot_mapping", slot_mapping, 1, (torch.int32, torch.int64), dev)
    check_shape("slot_mapping", slot_mapping, (t,))
    if q_out is None:
        q_out = torch.empty_like(q)
    check_out("q_out", q_out, tuple(q.shape), q.dtype, dev)
    if t == 0:
        return q_out
    block_h = min(16, triton.next_power_of_2(max(hq, hk)))
    _rotary_write_kv_kernel[(t, triton.cdiv(max(hq, hk), block_h))](
        positions, q, k, v, cos_sin_cache, q_out, k_cache, v_cache, slot_mapping,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        q_out.stride(0), q_out.stride(1), cos_sin_cache.stride(0),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), bs, hq, hk, r // 2,
        BLOCK_H=block_h, BLOCK_HALF=triton.next_power_of_2(r // 2), **pass_args(d, r))
    return q_out
