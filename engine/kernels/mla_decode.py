"""Paged MLA decode attention (DeepSeek-V3's weight-absorbed form), split-K, in Triton.

The cache holds one latent row per token, shared by every head (reference.py):

    kv_cache[blk, off, :] = | c_kv: V = v_dim values | k_rope: D - V values |
                              key = the whole row, value = c_kv

Every head reads the same rows, so a program serves BLOCK_H heads at once and each K/V tile
it loads feeds BLOCK_H rows of both dots: with 16 heads a loaded byte does 16x the work it
would in per-head attention. That reuse is what MLA decode is about on a GPU. The latent part
of a tile is loaded once and is both the key (with the rotary part) and the value:

    grid (B, cdiv(H, BLOCK_H), S): program (b, hg, s), heads hg*BLOCK_H .. +BLOCK_H-1,
    context partition s (PARTITION keys; partitions past ctx_len exit at once)

      scores [BLOCK_H, BLOCK_N] = q_lat [BLOCK_H, BV] . c_kv^T + q_rope [BLOCK_H, BR] . k_rope^T
      acc    [BLOCK_H, BV]     += p . c_kv                           (online softmax, log2)

    BV = next_pow2(V), BR = next_pow2(D - V) (masked): 512 + 64 for DeepSeek-V3, where one
    power-of-two block over all 576 would have been 1024 wide.

Split-K and its reduction are decode_attention.py's (FlashDecoding): with S > 1 each program
writes its normalized partial output and (m, l), and `_paged_decode_reduce_kernel` combines
them; with S == 1 the output is written directly. S comes from host ints only
(max_context_len, or the block table's width), so the launch can be captured in a CUDA graph.

Launch settings (_LAUNCH) follow what Triton MLA decode kernels commonly use (16 heads, 32
keys a tile at D = 576); they have not been swept on a GPU here.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._checks import FLOAT_DTYPES, check_out, check_shape, check_tensor, dot_precision, upcast_dot
from .decode_attention import LOG2E, _num_sms, _paged_decode_reduce_kernel, auto_partition

_LAUNCH = dict(block_h=16, num_warps=4, num_stages=2)


def _block_n(block_v: int, dtype: torch.dtype) -> int:
    """Keys per tile: as many as keep a latent tile [BLOCK_N, BLOCK_V] within 32 KB of shared
    memory per stage (bf16 at 512: 32 keys; fp32: 16), between 16 (tl.dot) and 64."""
    return max(16, min(64, 32768 // (block_v * dtype.itemsize)))


@triton.jit
def _paged_mla_decode_kernel(
        q_ptr, kv_ptr, bt_ptr, ctx_ptr, out_ptr, ml_ptr, scale_log2,
        stride_qb, stride_qh, stride_cb, stride_co, stride_bt, stride_ob, stride_oh, stride_os,
        block_size, H, D, V,
        PARTITION: tl.constexpr, SPLIT: tl.constexpr, BLOCK_N: tl.constexpr,
        BLOCK_H: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_R: tl.constexpr,
        PREC: tl.constexpr, UPCAST: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    hg = tl.program_id(1)
    s = tl.program_id(2)
    ctx = tl.load(ctx_ptr + b)
    start = s * PARTITION
    if SPLIT and start >= ctx:
        return                                   # the reduction ignores partitions past ctx
    end = tl.minimum(start + PARTITION, ctx)

    heads = hg * BLOCK_H + tl.arange(0, BLOCK_H)
    hmask = heads < H
    dv = tl.arange(0, BLOCK_V)                   # latent columns 0 .. V-1
    vmask = dv < V
    dr = V + tl.arange(0, BLOCK_R)               # rotary columns V .. D-1
    rmask = dr < D
    q_row = q_ptr + b * stride_qb + heads[:, None] * stride_qh
    q_lat = tl.load(q_row + dv[None, :], mask=hmask[:, None] & vmask[None, :], other=0.0)
    q_rope = tl.load(q_row + dr[None, :], mask=hmask[:, None] & rmask[None, :], other=0.0)
    if UPCAST:
        q_lat = q_lat.to(tl.float32)
        q_rope = q_rope.to(tl.float32)

    m = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_V], tl.float32)
    bt_row = bt_ptr + b * stride_bt
    for n0 in range(start, end, BLOCK_N):
        tok = n0 + tl.arange(0, BLOCK_N)
        tmask = tok < end
        # int64: blk * stride_cb passes 2^31 once a layer's pool holds 2^31 elements
        blk = tl.load(bt_row + tok // block_size, mask=tmask, other=0).to(tl.int64)
        row = kv_ptr + blk * stride_cb + (tok % block_size).to(tl.int64) * stride_co
        c_kv = tl.load(row[:, None] + dv[None, :], mask=tmask[:, None] & vmask[None, :], other=0.0)
        k_rope = tl.load(row[:, None] + dr[None, :], mask=tmask[:, None] & rmask[None, :], other=0.0)
        if UPCAST:
            c_kv = c_kv.to(tl.float32)
            k_rope = k_rope.to(tl.float32)
        sc = tl.dot(q_lat, tl.trans(c_kv), input_precision=PREC)
        sc += tl.dot(q_rope, tl.trans(k_rope), input_precision=PREC)       # [H, N] fp32
        sc = tl.where(tmask[None, :], sc * scale_log2, float("-inf"))
        m_new = tl.maximum(m, tl.max(sc, axis=1))
        alpha = tl.exp2(m - m_new)
        p = tl.exp2(sc - m_new[:, None])
        l = l * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(c_kv.dtype), c_kv, input_precision=PREC)
        m = m_new
    o = tl.where(l[:, None] > 0, acc / tl.maximum(l, 1e-30)[:, None], 0.0)
    o_ptrs = out_ptr + b * stride_ob + heads[:, None] * stride_oh + s * stride_os + dv[None, :]
    tl.store(o_ptrs, o.to(out_ptr.dtype.element_ty), mask=hmask[:, None] & vmask[None, :])
    if SPLIT:
        # ml: [B, H, S, 2] fp32 (contiguous) = (m_s, l_s) of row (b, head, s)
        ml = ml_ptr + ((b * H + heads) * tl.num_programs(2) + s) * 2
        tl.store(ml, m, mask=hmask)
        tl.store(ml + 1, l, mask=hmask)


def paged_mla_decode_attention(q: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor,
                               context_lens: torch.Tensor, scale: float, v_dim: int, *,
                               max_context_len: int | None = None,
                               partition_size: int | None = None,
                               out: torch.Tensor | None = None) -> torch.Tensor:
    """q [B, H, D] (latent query, then rotary query, per head), kv_cache [blocks, bs, D] of
    q's dtype -> [B, H, v_dim] in q's dtype (reference.paged_mla_decode_attention).

    max_context_len: a host int >= every context_lens entry; it fixes the number of
    partitions. Default block_tables.shape[1] * block_size. A longer context is silently
    truncated, so callers must keep that promise (as in decode_attention.py).
    partition_size: keys per split-K program, a power of two >= 16 (None: auto_partition).
    """
    b, h, d, bs = _check(q, kv_cache, block_tables, context_lens, v_dim)
    if max_context_len is None:
        max_context_len = block_tables.shape[1] * bs
    block_h = _LAUNCH["block_h"]                  # >= 16: tl.dot's smallest M
    groups = triton.cdiv(h, block_h)
    if partition_size is None:
        partition_size = auto_partition(b, groups, max_context_len, _num_sms(q.device))
    if partition_size < 16 or partition_size & (partition_size - 1):
        raise ValueError(f"partition_size must be a power of two >= 16, got {partition_size}")
    if out is None:
        out = torch.empty(b, h, v_dim, dtype=q.dtype, device=q.device)
    check_out("out", out, (b, h, v_dim), q.dtype, q.device)
    if b == 0:
        return out
    block_v = max(16, triton.next_power_of_2(v_dim))
    splits = max(1, triton.cdiv(max_context_len, partition_size))
    common = dict(PARTITION=partition_size, BLOCK_N=min(partition_size, _block_n(block_v, q.dtype)),
                  BLOCK_H=block_h, BLOCK_V=block_v,
                  BLOCK_R=max(16, triton.next_power_of_2(max(1, d - v_dim))),
                  PREC=dot_precision(q.dtype), UPCAST=upcast_dot(q.dtype),
                  num_warps=_LAUNCH["num_warps"], num_stages=_LAUNCH["num_stages"])
    args = (float(scale) * LOG2E, q.stride(0), q.stride(1), kv_cache.stride(0), kv_cache.stride(1),
            block_tables.stride(0))
    if splits == 1:
        _paged_mla_decode_kernel[(b, groups, 1)](
            q, kv_cache, block_tables, context_lens, out, out, *args,
            out.stride(0), out.stride(1), 0, bs, h, d, v_dim, SPLIT=False, **common)
        return out
    # partial outputs, padded to BLOCK_V: the layout _paged_decode_reduce_kernel reads
    part = torch.empty((b, h, splits, block_v), dtype=torch.float32, device=q.device)
    ml = torch.empty((b, h, splits, 2), dtype=torch.float32, device=q.device)
    _paged_mla_decode_kernel[(b, groups, splits)](
        q, kv_cache, block_tables, context_lens, part, ml, *args,
        part.stride(0), part.stride(1), part.stride(2), bs, h, d, v_dim, SPLIT=True, **common)
    _paged_decode_reduce_kernel[(b, h)](
        part, ml, context_lens, out, out.stride(0), out.stride(1), v_dim, h, splits,
        PARTITION=partition_size, BLOCK_S=triton.next_power_of_2(splits), BLOCK_D=block_v)
    return out


def _check(q, kv_cache, block_tables, context_lens, v_dim):
    """ValueError naming the argument for every layout the kernel does not take."""
    check_tensor("q", q, 3, FLOAT_DTYPES)
    b, h, d = q.shape
    check_tensor("kv_cache", kv_cache, 3, (q.dtype,), q.device)
    if kv_cache.shape[2] != d:
        raise ValueError(f"kv_cache row width {kv_cache.shape[2]} != q's {d} "
                         "(kv_lora_rank + qk_rope_head_dim)")
    if not 0 < v_dim <= d:
        raise ValueError(f"v_dim {v_dim} must be in 1..{d} (the kv_lora_rank part of a row)")
    check_tensor("block_tables", block_tables, 2, (torch.int32,), q.device)
    if block_tables.shape[0] != b:
        raise ValueError(f"block_tables has {block_tables.shape[0]} rows for {b} requests")
    check_tensor("context_lens", context_lens, 1, (torch.int32,), q.device)
    check_shape("context_lens", context_lens, (b,))
    return b, h, d, kv_cache.shape[1]
