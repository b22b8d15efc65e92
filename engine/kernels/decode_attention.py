"""Paged decode attention: one query token per sequence over its paged KV, split-K.

    grid (B, H_kv, S): program (b, kvh, s) serves the G = H_q / H_kv query heads that share
    KV head kvh (so each K/V byte is read once) over context partition s:

      context of seq b: |--- part 0 ---|--- part 1 ---|-- part 2 --|          (ctx_len)
                         PARTITION       PARTITION      <= PARTITION
      S = cdiv(max_context_len, PARTITION); partitions past ctx_len exit at once.

    PARTITION is sized from the batch and max_context_len (FlashDecoding): small batches
    split the context finer so that B * H_kv * S programs still fill every SM; large batches
    keep long partitions (fewer partial results to reduce). See `auto_partition`.

    Each program writes its partition's normalized output o_s and (m_s, l_s) (log2-domain
    max and sum of exp2); `_paged_decode_reduce_kernel` combines them:
        w_s = l_s * 2^(m_s - max_s m_s),  out = sum_s w_s * o_s / sum_s w_s
    When S == 1 the first kernel writes `out` directly and no reduction runs.

CUDA graphs: nothing here reads device values on the host. S comes from `max_context_len`
(a host int: the engine's graphs pass their context-length bucket); when omitted it is block_tables.shape[1] * block_size, the most a block table
of that width can hold, which is also static. Sequences with ctx_len 0 (padding) get zeros.

An 8-bit cache (k_scales/v_scales given) is read by the same kernel, compiled with KV_SCALED
(_attention_tile applies the per-(block, KV head) scales).

A sliding window: the query (position ctx - 1) sees keys ctx - window .. ctx - 1, so each
program's key range is its partition cut to [ctx - window, ctx); partitions wholly below
it run no tile and write (m, l) = (-inf, 0), which the reduction weighs 0. Attention sinks
(one logit per query head, HAS_SINKS): partition 0's state starts at (m = sink, l = 1),
the sink a key of value zero, so it joins the denominator exactly once, in the reduction
as in the single-partition case.
"""
from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from ._attention_tile import _attend_tile
from ._checks import (check_out, check_paged_attention, check_shape, check_tensor,
                      check_window_sinks, dot_precision, scale_args, upcast_dot)

MAX_PARTITION, MIN_PARTITION = 512, 64
PROGRAMS_PER_SM = 4
# launch settings: best of a 24-point sweep (partition 128-512, block_n 32/64, 4/8 warps,
# 1/3 stages) on an H200, batch 16, 1k and 8k context
_LAUNCH = dict(block_n=64, num_warps=4, num_stages=3)
LOG2E = 1.4426950408889634


@triton.jit
def _paged_decode_attention_kernel(
        q_ptr, kc_ptr, vc_ptr, bt_ptr, ctx_ptr, out_ptr, ml_ptr, scale_log2,
        stride_qb, stride_qh, stride_cb, stride_co, stride_ch, stride_bt,
        stride_ob, stride_oh, stride_os, block_size, G, D, ks_ptr, vs_ptr, stride_sb,
        window, sinks_ptr, PARTITION: tl.constexpr, SPLIT: tl.constexpr, BLOCK_N: tl.constexpr,
        BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr, PREC: tl.constexpr, UPCAST: tl.constexpr,
        KV_SCALED: tl.constexpr, HAS_SINKS: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    kvh = tl.program_id(1)
    s = tl.program_id(2)
    ctx = tl.load(ctx_ptr + b)
    start = s * PARTITION
    if SPLIT and start >= ctx:
        return                                   # the reduction ignores partitions past ctx
    end = tl.minimum(start + PARTITION, ctx)
    lo = tl.maximum(start, ctx - window)         # window: a host int, 2^30 for none

    g = tl.arange(0, BLOCK_G)                    # rows: query heads kvh*G .. kvh*G+G-1
    gmask = g < G
    heads = kvh * G + g
    d = tl.arange(0, BLOCK_D)
    dmask = d < D
    qmask = gmask[:, None] & dmask[None, :]
    q = tl.load(q_ptr + b * stride_qb + heads[:, None] * stride_qh + d[None, :], mask=qmask, other=0.0)
    if UPCAST:
        q = q.to(tl.float32)

    m = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_G], tl.float32)
    if HAS_SINKS:                                # the sink: a key of logit sink, value 0
        sink = tl.load(sinks_ptr + heads, mask=gmask, other=0.0).to(tl.float32) * 1.4426950408889634
        m = tl.where(s == 0, sink, m)
        l = tl.where(s == 0, 1.0, l)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    head_off = kvh.to(tl.int64) * stride_ch
    for n0 in range(lo, end, BLOCK_N):
        m, l, acc = _attend_tile(q, m, l, acc, kc_ptr, vc_ptr, bt_ptr + b * stride_bt, n0, end, m,
                                 scale_log2, block_size, stride_cb, stride_co, head_off, d, dmask,
                                 ks_ptr + kvh, vs_ptr + kvh, stride_sb, 0, CAUSAL=False,
                                 WINDOWED=False, BLOCK_N=BLOCK_N, PREC=PREC, UPCAST=UPCAST,
                                 KV_SCALED=KV_SCALED)
    o = tl.where(l[:, None] > 0, acc / tl.maximum(l, 1e-30)[:, None], 0.0)
    o_ptrs = out_ptr + b * stride_ob + heads[:, None] * stride_oh + s * stride_os + d[None, :]
    tl.store(o_ptrs, o.to(out_ptr.dtype.element_ty), mask=qmask)
    if SPLIT:
        # ml: [B, H_q, S, 2] fp32 (contiguous) = (m_s, l_s) of row (b, head, s)
        n_heads = tl.num_programs(1) * G
        ml = ml_ptr + ((b * n_heads + heads) * tl.num_programs(2) + s) * 2
        tl.store(ml, m, mask=gmask)
        tl.store(ml + 1, l, mask=gmask)


@triton.jit
def _paged_decode_reduce_kernel(part_ptr, ml_ptr, ctx_ptr, out_ptr, stride_ob, stride_oh, D, HQ, S,
                                PARTITION: tl.constexpr, BLOCK_S: tl.constexpr,
                                BLOCK_D: tl.constexpr):
    # grid (B, H_q). part: [B, H_q, S, BLOCK_D] fp32, ml: [B, H_q, S, 2] fp32 (contiguous).
    # S is a runtime value (one compiled kernel per BLOCK_S, not per split count).
    b = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    ctx = tl.load(ctx_ptr + b)
    n = (ctx + PARTITION - 1) // PARTITION        # partitions that hold keys
    sp = tl.arange(0, BLOCK_S)
    smask = sp < n
    d = tl.arange(0, BLOCK_D)
    base = (b * HQ + h) * S
    m = tl.load(ml_ptr + (base + sp) * 2, mask=smask, other=float("-inf"))
    l = tl.load(ml_ptr + (base + sp) * 2 + 1, mask=smask, other=0.0)
    m_max = tl.where(n > 0, tl.max(m, axis=0), 0.0)
    w = tl.where(smask, l * tl.exp2(m - m_max), 0.0)                       # [S]
    o = tl.load(part_ptr + (base + sp)[:, None] * BLOCK_D + d[None, :], mask=smask[:, None], other=0.0)
    total = tl.sum(w, axis=0)
    res = tl.sum(w[:, None] * o, axis=0) / tl.where(total > 0, total, 1.0)
    tl.store(out_ptr + b * stride_ob + h * stride_oh + d, res.to(out_ptr.dtype.element_ty), mask=d < D)


def auto_partition(batch: int, num_kv_heads: int, max_context_len: int, num_sms: int) -> int:
    """Keys per split-K program: the largest power of two in [MIN, MAX]_PARTITION that still
    gives batch * num_kv_heads * splits >= PROGRAMS_PER_SM * num_sms programs for a context of
    max_context_len (batch 1, 8 KV heads, 8k context, 132 SMs: 128 keys, 64 splits)."""
    splits = triton.cdiv(PROGRAMS_PER_SM * num_sms, max(1, batch * num_kv_heads))
    want = triton.next_power_of_2(max(1, triton.cdiv(max_context_len, splits)))
    if want > max_context_len:
        want //= 2                                # never more than the context asks for
    return max(MIN_PARTITION, min(MAX_PARTITION, want))


@functools.cache
def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 8                                  # the interpreter: any small machine
    return torch.cuda.get_device_properties(device).multi_processor_count


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float,
                           *, max_context_len: int | None = None, partition_size: int | None = None,
                           out: torch.Tensor | None = None, k_scales: torch.Tensor | None = None,
                           v_scales: torch.Tensor | None = None, window: int | None = None,
                           sinks: torch.Tensor | None = None) -> torch.Tensor:
    """q [B, H_q, D] (the last position of each sequence) -> [B, H_q, D].
    k_scales, v_scales: [num_blocks, H_kv] fp32 when the cache is 8-bit (reference.py).
    window: keys each query sees (itself included; None: all); sinks: [H_q] fp32 logits
    that join every softmax's denominator (reference.py).

    max_context_len: a host int >= every context_lens entry (e.g. the model's max length);
    it fixes the number of partitions. Default block_tables.shape[1] * block_size. A context
    longer than it is silently truncated, so callers must keep that promise.
    partition_size: keys per split-K program, a power of two >= 16 (None: auto_partition).
    """
    b, hq, d, hkv, bs = _check(q, k_cache, v_cache, block_tables, context_lens, k_scales, v_scales)
    extra = check_window_sinks(window, sinks, hq, q)
    if max_context_len is None:
        max_context_len = block_tables.shape[1] * bs
    if partition_size is None:
        partition_size = auto_partition(b, hkv, max_context_len, _num_sms(q.device))
    if partition_size < 16 or partition_size & (partition_size - 1):
        raise ValueError(f"partition_size must be a power of two >= 16, got {partition_size}")
    if out is None:
        out = torch.empty_like(q)
    check_out("out", out, tuple(q.shape), q.dtype, q.device)
    if b == 0:
        return out
    g = hq // hkv
    block_d = triton.next_power_of_2(d)
    block_n = min(partition_size, _LAUNCH["block_n"] if d <= 128 else 32)
    splits = max(1, triton.cdiv(max_context_len, partition_size))
    common = dict(PARTITION=partition_size, BLOCK_N=block_n, BLOCK_G=max(16, triton.next_power_of_2(g)),
                  BLOCK_D=block_d, PREC=dot_precision(q.dtype), UPCAST=upcast_dot(q.dtype),
                  KV_SCALED=k_scales is not None, HAS_SINKS=sinks is not None,
                  num_warps=_LAUNCH["num_warps"], num_stages=_LAUNCH["num_stages"])
    scale_log2 = float(scale) * LOG2E
    cs = (k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_tables.stride(0))
    kv_scales = scale_args(k_cache, k_scales, v_scales)
    if splits == 1:
        _paged_decode_attention_kernel[(b, hkv, 1)](
            q, k_cache, v_cache, block_tables, context_lens, out, out, scale_log2,
            q.stride(0), q.stride(1), *cs, out.stride(0), out.stride(1), 0, bs, g, d, *kv_scales,
            *extra, SPLIT=False, **common)
        return out
    # partial outputs, padded to BLOCK_D so that (m, l) share their index arithmetic
    part = torch.empty((b, hq, splits, block_d), dtype=torch.float32, device=q.device)
    ml = torch.empty((b, hq, splits, 2), dtype=torch.float32, device=q.device)
    _paged_decode_attention_kernel[(b, hkv, splits)](
        q, k_cache, v_cache, block_tables, context_lens, part, ml, scale_log2,
        q.stride(0), q.stride(1), *cs, part.stride(0), part.stride(1), part.stride(2), bs, g, d,
        *kv_scales, *extra, SPLIT=True, **common)
    _paged_decode_reduce_kernel[(b, hq)](
        part, ml, context_lens, out, out.stride(0), out.stride(1), d, hq, splits,
        PARTITION=partition_size, BLOCK_S=triton.next_power_of_2(splits), BLOCK_D=block_d)
    return out


def _check(q, k_cache, v_cache, block_tables, context_lens, k_scales, v_scales):
    bs, hkv = check_paged_attention(q, k_cache, v_cache, block_tables, k_scales, v_scales)
    b, hq, d = q.shape
    if block_tables.shape[0] != b:
        raise ValueError(f"block_tables has {block_tables.shape[0]} rows for {b} sequences")
    check_tensor("context_lens", context_lens, 1, (torch.int32,), q.device)
    check_shape("context_lens", context_lens, (b,))
    return b, hq, d, hkv, bs
