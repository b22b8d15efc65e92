"""Torch references for every kernel in this package.

These are the CPU path of the engine and the oracle the Triton kernels are tested against.
They favour clarity over speed. Layouts (shared with the Triton kernels):

    k_cache, v_cache : [num_blocks, block_size, num_kv_heads, head_dim]   (one layer)
    slot             : block_id * block_size + offset_in_block
    block_tables     : [num_seqs, max_blocks_per_seq] int32, row b lists seq b's blocks in order
    context_lens     : [num_seqs] int32, tokens of seq b in the cache *including* this step's
    cu_seqlens_q     : [num_seqs + 1] int32, query rows of seq b are cu[b]:cu[b+1]

Query row i of seq b (q_len = cu[b+1]-cu[b]) sits at position context_len - q_len + i and
attends causally to cache positions 0..that position; with a sliding window W only to the
last W of them (p - W < k <= p). Attention sinks add one logit per query head to every
softmax's denominator.

An 8-bit cache (float8_e4m3fn or int8) comes with scales [num_blocks, num_kv_heads] fp32 for
K and for V: element (block, offset, head, :) stands for q * scale[block, head]. The scale of
a (block, head) is its amax / QMAX over the tokens written so far: set when the block's first
slot is written and raised (the block's earlier entries requantized) when a later token
exceeds it. No calibration; a block that is never rewritten keeps its first quantization.
The Triton path reads and writes the same cache: kv_cache.write_kv_cache_quant keeps these
codes and scales bit for bit, and both paged attention kernels apply the scales per tile.

K shift: an 8-bit cache may store K minus a constant `k_shift` [num_kv_heads, head_dim] fp32
per layer (engine.kv_calibration: the mean K of a fixed calibration prompt). Attention needs
no correction: every key a query sees carries the same shift m, so its logits all move by
the same q.m, which softmax ignores (not so with attention sinks, whose logit does not move:
such models get no shift). It matters for fp8, whose error is relative to each value: some
of SmolLM2's K channels sit on a large offset that the error then scales with (measured
with and without it: bench/RESULTS.md, "KV cache quantization accuracy").
"""
from __future__ import annotations

import torch


def write_kv_cache(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                   slot_mapping: torch.Tensor) -> None:
    """Scatter k/v [T, H_kv, D] into their slots; slot < 0 means "skip this token"."""
    nb, bs, h, d = k_cache.shape
    slots = slot_mapping.long()
    if bool((slots < 0).any()):
        keep = slots >= 0
        slots, k, v = slots[keep], k[keep], v[keep]
    k_cache.view(nb * bs, h, d).index_copy_(0, slots, k.to(k_cache.dtype))
    v_cache.view(nb * bs, h, d).index_copy_(0, slots, v.to(v_cache.dtype))


KV_QMAX = {torch.float8_e4m3fn: 448.0, torch.int8: 127.0}


def _to_code(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x already divided by its scale -> the cache's 8-bit code."""
    qmax = KV_QMAX[dtype]
    x = x.clamp(-qmax, qmax)
    return (torch.round(x) if dtype == torch.int8 else x).to(dtype)


def _raw(t: torch.Tensor) -> torch.Tensor:
    """An 8-bit tensor as int8 bytes: torch's CPU indexing ops have no float8 kernels."""
    return t.view(torch.int8)


def _rows(cache: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """cache[idx] for any cache dtype (index_select: half the cost of indexing on CPU)."""
    rows = (_raw(cache) if cache.element_size() == 1 else cache).index_select(0, idx.flatten())
    return rows.view(*idx.shape, *cache.shape[1:]).view(cache.dtype)


def write_kv_cache_quant(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                         v_cache: torch.Tensor, k_scales: torch.Tensor, v_scales: torch.Tensor,
                         slot_mapping: torch.Tensor, k_shift: torch.Tensor | None = None) -> None:
    """write_kv_cache into an 8-bit cache, keeping each (block, head)'s scale (see above);
    `k_shift` [H_kv, D] fp32 is subtracted from K first (the K shift above)."""
    nb, bs, h, d = k_cache.shape
    if k_shift is not None:
        k = k.float() - k_shift
    slots = slot_mapping.long()
    keep = slots >= 0
    if not bool(keep.all()):
        slots, k, v = slots[keep], k[keep], v[keep]
    if slots.numel() == 0:
        return
    blocks, inv = torch.unique(slots // bs, return_inverse=True)
    fresh = torch.zeros(len(blocks), dtype=torch.bool, device=slots.device)
    fresh[inv[slots % bs == 0]] = True               # first slot written: the block is new
    for x, cache, scales in ((k, k_cache, k_scales), (v, v_cache, v_scales)):
        amax = torch.zeros(len(blocks), h, device=x.device).scatter_reduce_(
            0, inv[:, None].expand(-1, h), x.float().abs().amax(-1), "amax")
        old = torch.where(fresh[:, None], 0.0, scales[blocks])
        new = torch.maximum(old, amax / KV_QMAX[cache.dtype])
        grow = (new > old) & (old > 0)
        if bool(grow.any()):                         # requantize what the block already holds
            ratio = torch.where(grow, old / new, 1.0)[:, None, :, None]
            _raw(cache)[blocks] = _raw(_to_code(_rows(cache, blocks).float() * ratio, cache.dtype))
        scales[blocks] = new
        s = new.clamp(min=torch.finfo(torch.float32).tiny)[inv]      # [T, H]
        _raw(cache).view(nb * bs, h, d).index_copy_(
            0, slots, _raw(_to_code(x.float() / s[..., None], cache.dtype)))


def _gather(cache: torch.Tensor, block_table: torch.Tensor, length: int,
            scales: torch.Tensor | None = None) -> torch.Tensor:
    """[length, H_kv, D] of one sequence, read through its block table (dequantized to fp32
    when the cache has scales)."""
    bs = cache.shape[1]
    nblk = (length + bs - 1) // bs
    ids = block_table[:nblk].long()
    blocks = _rows(cache, ids)
    if scales is not None:
        blocks = blocks.float() * scales[ids][:, None, :, None]
    return blocks.flatten(0, 1)[:length]


def _visible(qpos: torch.Tensor, L: int, window: int | None) -> torch.Tensor:
    """[q, L] bool: key k is visible to the query at position p iff p - window < k <= p
    (transformers' sliding_window_overlay: the query and the window - 1 keys before it)."""
    k = torch.arange(L, device=qpos.device).unsqueeze(0)
    mask = k <= qpos
    return mask if window is None else mask & (k > qpos - window)


def _softmax_attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, visible: torch.Tensor,
                    scale: float, sinks: torch.Tensor) -> torch.Tensor:
    """Attention whose softmax has one more logit per head, `sinks` [H_q] (GPT-OSS): softmax
    over [scores, sink], the sink's column then dropped, so each row's weights sum to < 1.
    q [H_q, M, D], k/v [H_kv, L, D] fp32, visible [.., M, L] -> [H_q, M, D]."""
    hq, hkv = q.shape[0], k.shape[0]
    k, v = k.repeat_interleave(hq // hkv, 0), v.repeat_interleave(hq // hkv, 0)
    s = torch.matmul(q, k.transpose(-1, -2)) * scale                  # [H_q, M, L]
    s = s.masked_fill(~visible, float("-inf"))
    sink = sinks.float().view(hq, 1, 1).expand(hq, s.shape[1], 1)
    p = torch.cat((s, sink), -1).softmax(-1)[..., :-1]
    return torch.matmul(p, v)


def paged_prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            block_tables: torch.Tensor, cu_seqlens_q: torch.Tensor,
                            context_lens: torch.Tensor, scale: float,
                            k_scales: torch.Tensor | None = None,
                            v_scales: torch.Tensor | None = None, window: int | None = None,
                            sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Causal attention of a ragged batch of query chunks over paged KV. q: [T, H_q, D].
    `window`: each query sees only its last `window` positions (itself included; None: all);
    `sinks`: [H_q] fp32 logits joining every softmax's denominator (_softmax_attend)."""
    out = torch.empty_like(q)
    hq, hkv = q.shape[1], k_cache.shape[2]
    cu = cu_seqlens_q.tolist()
    lens = context_lens.tolist()
    for b in range(len(lens)):
        s, e, L = cu[b], cu[b + 1], lens[b]
        if e == s:
            continue
        qb = q[s:e].float().transpose(0, 1)                       # [H_q, q_len, D]
        kb = _gather(k_cache, block_tables[b], L, k_scales).float().transpose(0, 1)  # [H_kv, L, D]
        vb = _gather(v_cache, block_tables[b], L, v_scales).float().transpose(0, 1)
        qpos = torch.arange(L - (e - s), L, device=q.device).unsqueeze(1)  # [q_len, 1]
        mask = _visible(qpos, L, window)                                  # [q_len, L]
        if sinks is not None:
            o = _softmax_attend(qb, kb, vb, mask, scale, sinks)
        else:
            o = torch.nn.functional.scaled_dot_product_attention(
                qb, kb, vb, attn_mask=mask, scale=scale, enable_gqa=hq != hkv)
        out[s:e] = o.transpose(0, 1).to(q.dtype)
    return out


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, context_lens: torch.Tensor,
                           scale: float, k_scales: torch.Tensor | None = None,
                           v_scales: torch.Tensor | None = None, window: int | None = None,
                           sinks: torch.Tensor | None = None) -> torch.Tensor:
    """One query token per sequence (the last position). q: [B, H_q, D] -> [B, H_q, D].
    `window`, `sinks`: as in paged_prefill_attention.

    Batched: every sequence's blocks are gathered into a padded [B, M*bs] context and the
    positions past each context length are masked (no mask when every sequence fills it: one
    sequence, the common CPU case), so the whole batch is a few tensor ops. Two matmuls and a
    softmax: on CPU at decode shapes they cost half of scaled_dot_product_attention's call."""
    B, hq, D = q.shape
    bs, hkv = k_cache.shape[1], k_cache.shape[2]
    lens = context_lens.tolist()
    L = max(lens)
    nblk = (L + bs - 1) // bs
    if nblk == 0:
        return torch.zeros_like(q)
    idx = block_tables[:, :nblk].long()
    k, v = _rows(k_cache, idx), _rows(v_cache, idx)               # [B, M, bs, H_kv, D]
    if k_scales is not None:
        k = k.float() * k_scales[idx][:, :, None, :, None]
        v = v.float() * v_scales[idx][:, :, None, :, None]
    k = k.flatten(1, 2)[:, :L].float().permute(0, 2, 3, 1)        # [B, H_kv, D, L]
    v = v.flatten(1, 2)[:, :L].float().transpose(1, 2)            # [B, H_kv, L, D]
    # query heads grouped by their KV head: [B, H_kv, H_q/H_kv, D]
    s = torch.matmul(q.view(B, hkv, hq // hkv, D).float(), k).mul_(scale)   # [B, H_kv, G, L]
    if min(lens) < L or (window is not None and L > window):
        pos, ctx = torch.arange(L, device=q.device), context_lens.unsqueeze(1)
        valid = pos < ctx                                                      # [B, L]
        if window is not None:
            valid &= pos >= ctx - window
        s.masked_fill_(~valid[:, None, None, :], float("-inf"))
    if sinks is not None:
        sink = sinks.float().view(1, hkv, hq // hkv, 1).expand(B, -1, -1, 1)
        p = torch.cat((s, sink), -1).softmax(-1)[..., :-1]
    else:
        p = s.softmax(-1)
    out = torch.matmul(p, v).reshape(B, hq, D)
    if min(lens) == 0:
        out[context_lens == 0] = 0.0                              # padding rows (CUDA graphs)
    return out.to(q.dtype)


def write_latent_cache(latent: torch.Tensor, cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """MLA's cache write: latent rows [T, D] (the normalised compressed KV, then the rotated
    rotary key) into their slots of cache [num_blocks, block_size, D]; slot < 0: skipped."""
    nb, bs, d = cache.shape
    slots = slot_mapping.long()
    if bool((slots < 0).any()):
        latent, slots = latent[slots >= 0], slots[slots >= 0]
    cache.view(nb * bs, d).index_copy_(0, slots, latent.to(cache.dtype))


def paged_mla_decode_attention(q: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor,
                               context_lens: torch.Tensor, scale: float, v_dim: int) -> torch.Tensor:
    """Multi-head latent attention for one query token per sequence, in the latent space (the
    weight-absorbed form): every head attends the same cached rows. q [B, H, D] (each head's
    query already multiplied into the latent, then its rotary part), kv_cache [num_blocks,
    block_size, D] -> [B, H, v_dim]: softmax(q . rows * scale) @ rows[:, :v_dim], fp32."""
    B, H, D = q.shape
    bs = kv_cache.shape[1]
    lens = context_lens.tolist()
    L = max(lens)
    nblk = (L + bs - 1) // bs
    if nblk == 0:
        return q.new_zeros(B, H, v_dim)
    rows = kv_cache[block_tables[:, :nblk].long()].flatten(1, 2)[:, :L].float()   # [B, L, D]
    s = torch.matmul(q.float(), rows.transpose(1, 2)).mul_(scale)                 # [B, H, L]
    if min(lens) < L:
        valid = torch.arange(L, device=q.device) < context_lens.unsqueeze(1)
        s.masked_fill_(~valid[:, None, :], float("-inf"))
    out = torch.matmul(s.softmax(-1), rows[..., :v_dim])
    if min(lens) == 0:
        out[context_lens == 0] = 0.0                              # padding rows (CUDA graphs)
    return out.to(q.dtype)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None):
    """RMSNorm in fp32, as Hugging Face Llama computes it. With `residual`, first adds it and
    returns (normed, x + residual) so the caller keeps the new residual stream."""
    if residual is not None:
        x = x + residual
        residual = x
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True).add_(eps))
    out = weight * (h if h.dtype == x.dtype else h.to(x.dtype))
    return out if residual is None else (out, residual)


def rope_rows(positions: torch.Tensor, cos_sin_cache: torch.Tensor):
    """(cos, sin) [T, 1, R] fp32 of each position, for x * cos + roll(x, R/2) * sin: Neox-style
    (rotate-half) rotation, sin negated in its first half (R: the table's width, the rotary
    dimension). A forward pass gathers them once and every layer reuses them."""
    d2 = cos_sin_cache.shape[-1] // 2
    cs = cos_sin_cache[positions.long()]
    cos, sin = cs[:, :d2], cs[:, d2:]
    return torch.cat((cos, cos), -1).unsqueeze(1), torch.cat((-sin, sin), -1).unsqueeze(1)


def rotary_embedding(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                     cos_sin_cache: torch.Tensor, rows=None):
    """Neox-style (rotate-half) rotary embedding, as Llama/Qwen/Mistral/GLM/MiniMax use it.
    q: [T, H_q, D], k: [T, H_kv, D], cos_sin_cache: [max_pos, R] = cat(cos[:R/2], sin[:R/2])
    in fp32, R <= D the rotary dimension: the first R values of each head are rotated (halves
    R/2 apart), the other D - R passed through (partial rotary: GLM-4.5, MiniMax-M2);
    `rows`: rope_rows(positions, cos_sin_cache) when the caller has them. Returns new (q, k)."""
    cos, sin = rows or rope_rows(positions, cos_sin_cache)
    r = cos.shape[-1]
    d2 = r // 2

    def rot(x):
        xf = x[..., :r].float()
        out = (xf * cos + xf.roll(d2, -1) * sin).to(x.dtype)
        return out if r == x.shape[-1] else torch.cat((out, x[..., r:]), -1)
    return rot(q), rot(k)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x: [T, 2I] = cat(gate, up) -> silu(gate) * up: [T, I]."""
    i = x.shape[-1] // 2
    return torch.nn.functional.silu(x[..., :i]) * x[..., i:]


def gelu_tanh_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x: [T, 2I] = cat(gate, up) -> gelu_tanh(gate) * up: [T, I] (GeGLU, Gemma's MLP; the
    tanh approximation, transformers' gelu_pytorch_tanh)."""
    i = x.shape[-1] // 2
    return torch.nn.functional.gelu(x[..., :i], approximate="tanh") * x[..., i:]


def gpt_oss_swiglu(x: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    """x: [T, 2I] = cat(gate, up) -> GPT-OSS's clamped SwiGLU [T, I]: the gate clamped above
    at `limit`, up to [-limit, limit], then (up + 1) * gate * sigmoid(alpha * gate), in the
    order transformers' GptOssExperts computes it."""
    i = x.shape[-1] // 2
    gate, up = x[..., :i].clamp(max=limit), x[..., i:].clamp(-limit, limit)
    return (up + 1) * (gate * torch.sigmoid(gate * alpha))


def moe_by_expert(x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                  num_experts: int, expert) -> torch.Tensor:
    """Mixture-of-experts MLP one expert at a time (as transformers computes it): expert e's
    tokens gathered, `expert(e, their rows)` computed, scaled by the routing weight and summed
    per token in fp32. x [T, H]; topk_weights / topk_ids [T, k]."""
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    for e in range(num_experts):
        tok, slot = torch.nonzero(topk_ids == e, as_tuple=True)
        if tok.numel() == 0:
            continue
        y = expert(e, x[tok]) * topk_weights[tok, slot, None].float()
        out.index_add_(0, tok, y)
    return out.to(x.dtype)


def fused_moe(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor, w13_bias: torch.Tensor | None = None,
              w2_bias: torch.Tensor | None = None, swiglu: tuple[float, float] | None = None
              ) -> torch.Tensor:
    """moe_by_expert over stacked weights: w13 [E, 2I, H] = cat(gate, up); w2 [E, H, I];
    optional biases w13_bias [E, 2I], w2_bias [E, H] (GPT-OSS), added before the activation
    and before the routing weight; `swiglu` (alpha, limit): gpt_oss_swiglu instead of
    silu_and_mul."""
    linear = torch.nn.functional.linear

    def expert(e: int, xs: torch.Tensor) -> torch.Tensor:
        h = linear(xs, w13[e], None if w13_bias is None else w13_bias[e])
        h = silu_and_mul(h) if swiglu is None else gpt_oss_swiglu(h, *swiglu)
        return linear(h, w2[e], None if w2_bias is None else w2_bias[e])
    return moe_by_expert(x, topk_weights, topk_ids, w13.shape[0], expert)


def dequantize_int8(q: torch.Tensor, scale: torch.Tensor, group: int = 0) -> torch.Tensor:
    """int8 codes [N, K] times a scale per output channel [N] (group 0) or per `group` values
    along K [N, K/group] -> float32 [N, K]."""
    if group:
        n, k = q.shape
        return (q.float().view(n, k // group, group) * scale.float()[..., None]).view(n, k)
    return q.float() * scale.float()[:, None]


def dequantize_int4(packed: torch.Tensor, scale: torch.Tensor, mn: torch.Tensor, group: int) -> torch.Tensor:
    """Codes packed two to a byte [N, K/2] (packing.py) times scale plus min [N, K/group]."""
    from .packing import unpack_int4
    n, k = packed.shape[0], 2 * packed.shape[1]
    q = unpack_int4(packed).float().view(n, k // group, group)
    return (q * scale.float()[..., None] + mn.float()[..., None]).view(n, k)


def dequantize_fp8(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """float8 codes [N, K] times a scale per output channel [N] or per tensor [1]."""
    return q.float() * (scale[:, None] if scale.numel() > 1 else scale)


def dequantized_linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x @ w.T with the float32 weight `w` rounded to x's dtype first: every quantized
    matmul's reference."""
    return torch.nn.functional.linear(x, w.to(x.dtype))


# The rotary cache builder is shared by both paths; its torch implementation lives in rope.py.
from .rope import build_cos_sin_cache  # noqa: E402,F401
