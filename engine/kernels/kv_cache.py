"""write_kv_cache: scatter this step's K/V rows into their paged-cache slots.
write_kv_cache_quant: the same into an 8-bit cache, keeping each (block, KV head)'s scale
exactly as reference.write_kv_cache_quant does (codes and scales equal bit for bit), K
minus its layer's K shift when one is given."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._checks import FLOAT_DTYPES, KV8_DTYPES, check_kv_scales, check_shape, check_tensor
from .reference import KV_QMAX

TINY = tl.constexpr(torch.finfo(torch.float32).tiny)
ROUND_MAGIC = tl.constexpr(12582912.0)   # 1.5 * 2^23: (x + M) - M rounds |x| < 2^22 half to even


@triton.jit
def _write_kv_cache_kernel(k_ptr, v_ptr, kc_ptr, vc_ptr, slot_ptr,
                           stride_kt, stride_kh, stride_vt, stride_vh,
                           stride_cb, stride_co, stride_ch,
                           block_size, H, D,
                           BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
    # One program per token t: copies k[t] / v[t] ([H, D]) to cache[block, offset]
    #   slot = block * block_size + offset            (slot < 0: padding token, skipped)
    #   addr = block * stride_cb + offset * stride_co + h * stride_ch + d   (int64: the pool
    #          of one layer can hold more than 2^31 elements)
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    if slot < 0:
        return
    blk = slot // block_size
    off = slot % block_size
    h = tl.arange(0, BLOCK_H)[:, None]
    d = tl.arange(0, BLOCK_D)[None, :]
    mask = (h < H) & (d < D)
    kv = tl.load(k_ptr + t * stride_kt + h * stride_kh + d, mask=mask)
    vv = tl.load(v_ptr + t * stride_vt + h * stride_vh + d, mask=mask)
    dst = blk * stride_cb + off * stride_co + h * stride_ch + d
    tl.store(kc_ptr + dst, kv.to(kc_ptr.dtype.element_ty), mask=mask)
    tl.store(vc_ptr + dst, vv.to(vc_ptr.dtype.element_ty), mask=mask)


def _check_write(k, v, k_cache, v_cache, slot_mapping, cache_dtypes) -> None:
    """The arguments both writes take: caches [num_blocks, block_size, H_kv, D] alike (dtype
    one of `cache_dtypes`, same strides), k and v [T, H_kv, D] float, slot_mapping [T]."""
    check_tensor("k_cache", k_cache, 4, cache_dtypes)
    dev = k_cache.device
    _, _, h, d = k_cache.shape
    check_tensor("v_cache", v_cache, 4, (k_cache.dtype,), dev)
    check_shape("v_cache", v_cache, k_cache.shape)
    if v_cache.stride() != k_cache.stride():
        raise ValueError(f"v_cache strides {v_cache.stride()} differ from k_cache's {k_cache.stride()}")
    check_tensor("k", k, 3, FLOAT_DTYPES, dev)
    t = k.shape[0]
    for name, x in (("k", k), ("v", v)):
        check_tensor(name, x, 3, FLOAT_DTYPES, dev)
        check_shape(name, x, (t, h, d))
    check_tensor("slot_mapping", slot_mapping, 1, (torch.int32, torch.int64), dev)
    check_shape("slot_mapping", slot_mapping, (t,))


def write_kv_cache(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                   slot_mapping: torch.Tensor) -> None:
    """k, v: [T, H_kv, D]; caches [num_blocks, block_size, H_kv, D]; slot_mapping [T] int32/64.
    Slots must be distinct (two tokens into one slot race)."""
    _check_write(k, v, k_cache, v_cache, slot_mapping, FLOAT_DTYPES)
    _, bs, h, d = k_cache.shape
    t = k.shape[0]
    if t == 0:
        return
    _write_kv_cache_kernel[(t,)](
        k, v, k_cache, v_cache, slot_mapping,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        bs, h, d,
        BLOCK_H=triton.next_power_of_2(h), BLOCK_D=triton.next_power_of_2(d))


@triton.jit
def _to_code(x, QMAX: tl.constexpr, IS_INT: tl.constexpr):
    """x already divided by its scale -> the code's value in fp32 (reference._to_code):
    clamped to +-QMAX and rounded half to even, to an integer (int8) or to the e4m3 grid
    (quantum 2^(e-3) at exponent e, 2^-9 below 2^-6), so the final cast is exact. The
    rounding is done here because libdevice's rint has no interpreter version and the
    interpreter's fp32 -> fp8 cast does not round to nearest even (GPUs' does)."""
    x = tl.minimum(tl.maximum(x, -QMAX), QMAX)
    if IS_INT:
        return (x + ROUND_MAGIC) - ROUND_MAGIC
    bits = x.to(tl.int32, bitcast=True)
    e = tl.maximum(((bits >> 23) & 0xFF) - 127, -6)
    quantum = ((e + 124) << 23).to(tl.float32, bitcast=True)            # 2^(e-3)
    r = (tl.abs(x) + ROUND_MAGIC * quantum) - ROUND_MAGIC * quantum
    return tl.where(bits < 0, -r, r)                                      # -0.0 stays -0.0


@triton.jit
def _write_block_head(x_ptr, stride_xt, stride_xh, cache_ptr, scale_ptr, shift_ptr, toks, offs,
                      tmask, fresh, blk, h, stride_cb, stride_co, stride_ch, stride_sb,
                      block_size, D, QMAX: tl.constexpr, IS_INT: tl.constexpr,
                      HAS_SHIFT: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr):
    # x[toks, h] (this call's tokens of block blk, at offsets offs; minus shift[h] with
    # HAS_SHIFT) -> codes, and the scale:
    #   old = 0 if the block is fresh else scale[blk, h];  new = max(old, amax / QMAX)
    #   new > old > 0: the block's other slots are requantized, code * (old / new)
    #   the tokens: code(x / max(new, tiny))
    d = tl.arange(0, BLOCK_D)
    dmask = d[None, :] < D
    x = tl.load(x_ptr + toks[:, None] * stride_xt + h * stride_xh + d[None, :],
                mask=tmask[:, None] & dmask, other=0.0).to(tl.float32)
    if HAS_SHIFT:           # padding rows stay 0: they must not count in amax
        m = tl.load(shift_ptr + h * D + d[None, :], mask=dmask, other=0.0)
        x = tl.where(tmask[:, None], x - m, 0.0)
    amax = tl.max(tl.max(tl.abs(x), axis=1), axis=0)
    sptr = scale_ptr + blk * stride_sb + h
    old = tl.where(fresh, 0.0, tl.load(sptr))
    new = tl.maximum(old, tl.math.div_rn(amax, QMAX))
    base = cache_ptr + blk * stride_cb + h * stride_ch + d[None, :]
    if (new > old) & (old > 0):
        # slots this call does not write (the two stores below never touch one address)
        s = tl.arange(0, BLOCK_S)
        written = tl.max(((s[:, None] == offs[None, :]) & tmask[None, :]).to(tl.int32), axis=1)
        smask = ((s < block_size) & (written == 0))[:, None] & dmask
        held = tl.load(base + s[:, None] * stride_co, mask=smask, other=0.0).to(tl.float32)
        requant = _to_code(held * tl.math.div_rn(old, new), QMAX, IS_INT)
        tl.store(base + s[:, None] * stride_co, requant.to(cache_ptr.dtype.element_ty), mask=smask)
    tl.debug_barrier()      # every warp has read `old` before one of them overwrites it
    tl.store(sptr, new)
    codes = _to_code(tl.math.div_rn(x, tl.maximum(new, TINY)), QMAX, IS_INT)
    tl.store(base + offs[:, None] * stride_co, codes.to(cache_ptr.dtype.element_ty),
             mask=tmask[:, None] & dmask)


@triton.jit
def _write_kv_cache_quant_kernel(k_ptr, v_ptr, kc_ptr, vc_ptr, ks_ptr, vs_ptr, shift_ptr, slot_ptr,
                                 order_ptr, start_ptr, count_ptr,
                                 stride_kt, stride_kh, stride_vt, stride_vh,
                                 stride_cb, stride_co, stride_ch, stride_sb, block_size, D,
                                 QMAX: tl.constexpr, IS_INT: tl.constexpr, HAS_SHIFT: tl.constexpr,
                                 BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr):
    # grid (runs, H_kv): run r = the count[r] tokens order[start[r]:][:count[r]] of this call
    # that land in one block (at most block_size of them: slots are distinct)
    r = tl.program_id(0)
    h = tl.program_id(1)
    i = tl.arange(0, BLOCK_S)
    tmask = i < tl.load(count_ptr + r)
    toks = tl.load(order_ptr + tl.load(start_ptr + r) + i, mask=tmask, other=0).to(tl.int64)
    slots = tl.load(slot_ptr + toks, mask=tmask, other=0).to(tl.int64)
    blk = tl.max(tl.where(tmask, slots // block_size, 0), axis=0)
    offs = slots % block_size
    fresh = tl.max(((offs == 0) & tmask).to(tl.int32), axis=0) > 0   # its first slot: new block
    _write_block_head(k_ptr, stride_kt, stride_kh, kc_ptr, ks_ptr, shift_ptr, toks, offs, tmask,
                      fresh, blk, h, stride_cb, stride_co, stride_ch, stride_sb, block_size, D,
                      QMAX, IS_INT, HAS_SHIFT, BLOCK_S, BLOCK_D)
    _write_block_head(v_ptr, stride_vt, stride_vh, vc_ptr, vs_ptr, shift_ptr, toks, offs, tmask,
                      fresh, blk, h, stride_cb, stride_co, stride_ch, stride_sb, block_size, D,
                      QMAX, IS_INT, False, BLOCK_S, BLOCK_D)


def write_kv_cache_quant(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                         v_cache: torch.Tensor, k_scales: torch.Tensor, v_scales: torch.Tensor,
                         slot_mapping: torch.Tensor, k_shift: torch.Tensor | None = None) -> None:
    """write_kv_cache into an 8-bit cache (float8_e4m3fn or int8) with scales [num_blocks, H_kv]
    fp32 (reference.py), K minus `k_shift` [H_kv, D] contiguous fp32 when given. The host groups this call's tokens by block (a device sync: the
    8-bit cache runs without CUDA graphs); one program per (block, KV head) then sets the
    scale, requantizes what the block holds when the scale grows, and writes the codes.
    Slots must be distinct."""
    _check_write(k, v, k_cache, v_cache, slot_mapping, KV8_DTYPES)
    check_kv_scales(k_cache, k_scales, v_scales)
    _, bs, h, d = k_cache.shape
    if k_shift is not None:
        check_tensor("k_shift", k_shift, 2, (torch.float32,), k_cache.device)
        check_shape("k_shift", k_shift, (h, d))
        if not k_shift.is_contiguous():
            raise ValueError("k_shift must be contiguous")
    toks = torch.nonzero(slot_mapping >= 0).flatten()
    if toks.numel() == 0:
        return
    blocks, inv, counts = torch.unique(slot_mapping[toks].long() // bs, return_inverse=True,
                                       return_counts=True)
    order = toks[torch.argsort(inv, stable=True)]
    starts = counts.cumsum(0) - counts
    _write_kv_cache_quant_kernel[(blocks.numel(), h)](
        k, v, k_cache, v_cache, k_scales, v_scales, k_scales if k_shift is None else k_shift,
        slot_mapping, order, starts, counts,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), k_scales.stride(0), bs, d,
        QMAX=KV_QMAX[k_cache.dtype], IS_INT=k_cache.dtype == torch.int8,
        HAS_SHIFT=k_shift is not None, BLOCK_S=triton.next_power_of_2(bs), BLOCK_D=triton.next_power_of_2(d))
