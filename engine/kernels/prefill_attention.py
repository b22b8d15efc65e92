"""Paged prefill attention: causal flash attention (FlashAttention-2's loop) for a ragged batch
of query chunks whose keys are the request's cached prefix plus the chunk itself, all read
through the block table. Prefix-cache hits and chunked prefill are the same case: a chunk
of q_len rows whose context (L keys) is longer than the chunk.

    grid (H_kv, B, cdiv(max_q_len, TOK)). GQA is packed into the rows of a tile: with
    G = H_q / H_kv, a tile of BLOCK_M rows holds TOK = BLOCK_M // G tokens x G heads,
        row r -> token tile*TOK + r // G, query head kvh*G + r % G
    so every K/V tile read from the cache serves all G heads.

    seq b:  keys  0 ............................................. L-1
            query rows sit at positions L-q_len .. L-1 (the chunk is the tail)
    key j is visible to a row at position p iff j <= p. Key tiles wholly below the tile's
    first position need no mask (first loop); the rest (up to its last position) are masked;
    key tiles past its last position are never read (causal block skipping).

    Tiles run in reverse along the grid's slowest axis: the last tiles of a chunk see the
    most keys, so the longest programs start first and the short ones fill the tail.

Per-row state is FlashAttention-2's online softmax in the log2 domain (see _attention_tile):
running max m, running sum l, unnormalised acc; one division at the end.

Launch: on CUDA, chunks of at least TUNE_MIN_Q tokens pick their tile sizes and pipelining
with triton.autotune (keyed on G, head dim and dtype; tuned once per process on the first such
call); shorter chunks, and the interpreter, use _LAUNCH.

An 8-bit cache (k_scales/v_scales given) is read by the same kernel, compiled with KV_SCALED
(_attention_tile applies the per-(block, KV head) scales).

A sliding window (WINDOWED): key j is visible to a row at position p iff p - window < j <= p.
A tile's keys then start at its first row's window, first_pos - window + 1 (rounded down to
a key tile), and every key tile is masked (no tile is visible to all rows for certain).
Attention sinks (HAS_SINKS): each row's state starts at (m = sink of its head, l = 1), the
sink a key of value zero.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._attention_tile import _attend_tile
from ._checks import (check_out, check_paged_attention, check_shape, check_tensor,
                      check_window_sinks, dot_precision, interpreting, scale_args, upcast_dot)
from .decode_attention import LOG2E

# untuned launch: short chunks (launch-bound) and the interpreter
_LAUNCH = dict(BLOCK_M=64, BLOCK_N=64, num_warps=4, num_stages=3)
TUNE_MIN_Q = 256
MAX_GQA_GROUP = 64          # every tile holds at least one token's G heads
# candidates for D <= 128 in 16-bit; the ones that do not fit in shared memory fail to
# compile and the autotuner drops them
_CONFIGS = [triton.Config(dict(BLOCK_M=m, BLOCK_N=n), num_warps=w, num_stages=s)
            for m, n, w, s in ((128, 64, 8, 3), (128, 64, 4, 3), (128, 128, 8, 2), (64, 64, 4, 3),
                               (128, 32, 4, 4))]


@triton.jit
def _paged_prefill_attention_kernel(
        q_ptr, kc_ptr, vc_ptr, bt_ptr, cu_ptr, ctx_ptr, out_ptr, scale_log2,
        stride_qt, stride_qh, stride_cb, stride_co, stride_ch, stride_bt,
        stride_ot, stride_oh, block_size, D, ks_ptr, vs_ptr, stride_sb, window, sinks_ptr,
        G: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
        PREC: tl.constexpr, UPCAST: tl.constexpr, KV_SCALED: tl.constexpr,
        WINDOWED: tl.constexpr, HAS_SINKS: tl.constexpr):
    TOK = BLOCK_M // G                               # tokens per tile
    kvh = tl.program_id(0)
    b = tl.program_id(1).to(tl.int64)
    tile = tl.num_programs(2) - 1 - tl.program_id(2)  # longest tiles first
    q_start = tl.load(cu_ptr + b)
    q_len = tl.load(cu_ptr + b + 1) - q_start
    if tile * TOK >= q_len:
        return
    L = tl.load(ctx_ptr + b)

    r = tl.arange(0, BLOCK_M)
    tok = tile * TOK + r // G                      # token index within the chunk
    rmask = (r < TOK * G) & (tok < q_len)
    heads = kvh * G + r % G
    d = tl.arange(0, BLOCK_D)
    dmask = d < D
    qmask = rmask[:, None] & dmask[None, :]
    q_rows = (q_start + tok).to(tl.int64)
    q = tl.load(q_ptr + q_rows[:, None] * stride_qt + heads[:, None] * stride_qh + d[None, :],
                mask=qmask, other=0.0)
    if UPCAST:
        q = q.to(tl.float32)
    # position of each row; padding rows get L - 1 so that no row sees only -inf
    qpos = tl.where(rmask, L - q_len + tok, L - 1)

    first_pos = L - q_len + tile * TOK
    last_pos = tl.minimum(first_pos + TOK - 1, L - 1)
    if WINDOWED:                                             # keys from the first row's window
        lo = tl.maximum(first_pos - window + 1, 0) // BLOCK_N * BLOCK_N
        full_end = lo
    else:
        lo = 0
        full_end = (first_pos + 1) // BLOCK_N * BLOCK_N      # keys [0, full_end) visible to all
    m = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_M], tl.float32)
    if HAS_SINKS:                                            # the sink: logit sink, value 0
        m = tl.load(sinks_ptr + heads).to(tl.float32) * 1.4426950408889634
        l = tl.full([BLOCK_M], 1.0, tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    bt_row = bt_ptr + b * stride_bt
    head_off = kvh.to(tl.int64) * stride_ch
    ks_row, vs_row = ks_ptr + kvh, vs_ptr + kvh
    for n0 in range(lo, full_end, BLOCK_N):
        m, l, acc = _attend_tile(q, m, l, acc, kc_ptr, vc_ptr, bt_row, n0, full_end, qpos,
                                 scale_log2, block_size, stride_cb, stride_co, head_off, d, dmask,
                                 ks_row, vs_row, stride_sb, window, CAUSAL=False, WINDOWED=False,
                                 BLOCK_N=BLOCK_N, PREC=PREC, UPCAST=UPCAST, KV_SCALED=KV_SCALED)
    for n0 in range(full_end, last_pos + 1, BLOCK_N):
        m, l, acc = _attend_tile(q, m, l, acc, kc_ptr, vc_ptr, bt_row, n0, last_pos + 1, qpos,
                                 scale_log2, block_size, stride_cb, stride_co, head_off, d, dmask,
                                 ks_row, vs_row, stride_sb, window, CAUSAL=True,
                                 WINDOWED=WINDOWED, BLOCK_N=BLOCK_N, PREC=PREC, UPCAST=UPCAST,
                                 KV_SCALED=KV_SCALED)
    o = acc / l[:, None]
    tl.store(out_ptr + q_rows[:, None] * stride_ot + heads[:, None] * stride_oh + d[None, :],
             o.to(out_ptr.dtype.element_ty), mask=qmask)


_tuned_kernel = triton.autotune(_CONFIGS, key=["G", "D"])(_paged_prefill_attention_kernel)


def paged_prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            block_tables: torch.Tensor, cu_seqlens_q: torch.Tensor,
                            context_lens: torch.Tensor, scale: float, *, max_q_len: int | None = None,
                            out: torch.Tensor | None = None, k_scales: torch.Tensor | None = None,
                            v_scales: torch.Tensor | None = None, window: int | None = None,
                            sinks: torch.Tensor | None = None) -> torch.Tensor:
    """q [T, H_q, D] -> [T, H_q, D]. The chunk's own K/V must already be in the cache.
    k_scales, v_scales: [num_blocks, H_kv] fp32 when the cache is 8-bit (reference.py).
    window: keys each query sees (itself included; None: all); sinks: [H_q] fp32 logits
    that join every softmax's denominator (reference.py).

    max_q_len: a host int >= every chunk length (the scheduler knows it); when omitted it is
    read from cu_seqlens_q, which syncs with the device. Requires context_lens[b] >= q_len[b].
    """
    bs, hkv = check_paged_attention(q, k_cache, v_cache, block_tables, k_scales, v_scales)
    dev = q.device
    t, hq, d = q.shape
    nseq = block_tables.shape[0]
    check_tensor("cu_seqlens_q", cu_seqlens_q, 1, (torch.int32,), dev)
    check_shape("cu_seqlens_q", cu_seqlens_q, (nseq + 1,))
    check_tensor("context_lens", context_lens, 1, (torch.int32,), dev)
    check_shape("context_lens", context_lens, (nseq,))
    extra = check_window_sinks(window, sinks, hq, q)
    g = hq // hkv
    if g > MAX_GQA_GROUP:
        raise ValueError(f"{hq} query heads per {hkv} KV heads: at most {MAX_GQA_GROUP} per KV head")
    if out is None:
        out = torch.empty_like(q)
    check_out("out", out, tuple(q.shape), q.dtype, dev)
    if t == 0 or nseq == 0:
        return out
    if max_q_len is None:
        max_q_len = int((cu_seqlens_q[1:] - cu_seqlens_q[:-1]).max())
    args = (q, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens, out, float(scale) * LOG2E,
            q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
            block_tables.stride(0), out.stride(0), out.stride(1), bs, d,
            *scale_args(k_cache, k_scales, v_scales), *extra)
    consts = dict(G=g, BLOCK_D=triton.next_power_of_2(d), PREC=dot_precision(q.dtype),
                  UPCAST=upcast_dot(q.dtype), KV_SCALED=k_scales is not None,
                  WINDOWED=window is not None, HAS_SINKS=sinks is not None)

    def grid(meta):
        return hkv, nseq, triton.cdiv(max_q_len, meta["BLOCK_M"] // g)

    if q.is_cuda and not interpreting() and max_q_len >= TUNE_MIN_Q and d <= 128:
        _tuned_kernel[grid](*args, **consts)
    else:
        launch = dict(_LAUNCH, BLOCK_N=_LAUNCH["BLOCK_N"] if d <= 128 else 32)
        _paged_prefill_attention_kernel[grid](*args, **consts, **launch)
    return out
