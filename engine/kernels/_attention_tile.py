"""The inner step shared by the paged attention kernels: one tile of BLOCK_N keys, read
through the block table, folded into a running (max, sum, acc) online softmax.

    key token j of a sequence lives at
        blk  = block_table[j // block_size]
        addr = blk * stride_cb + (j % block_size) * stride_co + kv_head * stride_ch + d
    computed in int64: blk * stride_cb passes 2^31 once a layer's pool holds 2^31 elements.

    scores are kept in the log2 domain (scale * log2(e) folded in) so exp2 replaces exp.

    An 8-bit cache (KV_SCALED; layout in reference.py): K and V hold codes, key j stands for
    code * scale[blk, kv_head]. The codes are converted exactly to q's dtype for the dots and
    each key's scale is applied in fp32 to what the dots produce: its scores (K) and its
    probabilities (V), one scalar per (block, KV head) read alongside the block table.

    A sliding window (WINDOWED, prefill): key j is visible to the row at position p iff
    p - window < j <= p. A tile may then hold no key some row sees; its max stays -inf and
    the update uses 0 in its place, so that row's state is unchanged rather than NaN.
    Attention sinks need nothing here: the kernels start each row's state at (m = sink,
    l = 1, acc = 0), the sink a key of logit `sink` and value zero.
"""
import triton
import triton.language as tl


@triton.jit
def _attend_tile(q, m, l, acc, kc_ptr, vc_ptr, bt_row_ptr, n0, key_end, qpos,
                 scale_log2, block_size, stride_cb, stride_co, head_off, d, dmask,
                 ks_ptr, vs_ptr, stride_sb, window,
                 CAUSAL: tl.constexpr, WINDOWED: tl.constexpr, BLOCK_N: tl.constexpr, PREC: tl.constexpr,
                 UPCAST: tl.constexpr, KV_SCALED: tl.constexpr):
    # ks_ptr, vs_ptr: the scales of this KV head (scales + kv_head), read when KV_SCALED
    tok = n0 + tl.arange(0, BLOCK_N)                                     # [N] key positions
    tmask = tok < key_end
    blk = tl.load(bt_row_ptr + tok // block_size, mask=tmask, other=0).to(tl.int64)
    row = blk * stride_cb + (tok % block_size).to(tl.int64) * stride_co + head_off
    kv_mask = tmask[:, None] & dmask[None, :]
    k = tl.load(kc_ptr + row[:, None] + d[None, :], mask=kv_mask, other=0.0)   # [N, D]
    v = tl.load(vc_ptr + row[:, None] + d[None, :], mask=kv_mask, other=0.0)
    if KV_SCALED:
        k = k.to(q.dtype)
        v = v.to(q.dtype)
    elif UPCAST:
        k = k.to(tl.float32)
        v = v.to(tl.float32)
    s = tl.dot(q, tl.trans(k), input_precision=PREC) * scale_log2             # [M, N] fp32
    if KV_SCALED:
        s = s * tl.load(ks_ptr + blk * stride_sb, mask=tmask, other=0.0)[None, :]
    visible = tmask[None, :]
    if CAUSAL:
        visible = visible & (tok[None, :] <= qpos[:, None])
    if WINDOWED:
        visible = visible & (tok[None, :] > qpos[:, None] - window)
    s = tl.where(visible, s, float("-inf"))
    m_new = tl.maximum(m, tl.max(s, axis=1))
    if WINDOWED:
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
    else:
        m_use = m_new
    alpha = tl.exp2(m - m_use)
    p = tl.exp2(s - m_use[:, None])
    l = l * alpha + tl.sum(p, axis=1)
    if KV_SCALED:
        pv = p * tl.load(vs_ptr + blk * stride_sb, mask=tmask, other=0.0)[None, :]
    else:
        pv = p
    acc = acc * alpha[:, None] + tl.dot(pv.to(v.dtype), v, input_precision=PREC)
    return m_new, l, acc
