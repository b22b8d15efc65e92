"""write_kv_cache: scatter this step's K/V rows into their paged-cache slots."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._checks import FLOAT_DTYPES, check_shape, check_tensor


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


def write_kv_cache(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                   slot_mapping: torch.Tensor) -> None:
    """k, v: [T, H_kv, D]; caches [num_blocks, block_size, H_kv, D]; slot_mapping [T] int32/64.
    Slots must be distinct (two tokens into one slot race)."""
    check_tensor("k_cache", k_cache, 4, FLOAT_DTYPES)
    dev = k_cache.device
    nb, bs, h, d = k_cache.shape
    check_tensor("v_cache", v_cache, 4, (k_cache.dtype,), dev)
    check_shape("v_cache", v_cache, k_cache.shape)
    if v_cache.stride() != k_cache.stride():
        raise ValueError(f"v_cache strides {v_cache.stride()} differ from k_cache's {k_cache.stride()}")
    check_tensor("k", k, 3, FLOAT_DTYPES, dev)
    t = k.shape[0]
    check_shape("k", k, (t, h, d))
    check_tensor("v", v, 3, FLOAT_DTYPES, dev)
    check_shape("v", v, (t, h, d))
    check_tensor("slot_mapping", slot_mapping, 1, (torch.int32, torch.int64), dev)
    check_shape("slot_mapping", slot_mapping, (t,))
    if t == 0:
        return
    _write_kv_cache_kernel[(t,)](
        k, v, k_cache, v_cache, slot_mapping,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        bs, h, d,
        BLOCK_H=triton.next_power_of_2(h), BLOCK_D=triton.next_power_of_2(d))
