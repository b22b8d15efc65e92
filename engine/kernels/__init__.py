"""Kernels used by the model: Triton on CUDA; on CPU the C kernels (cpu.c) or the torch references.

Every op here dispatches on the `backend` its caller passes ("auto": Triton for CUDA tensors,
the torch reference otherwise; "torch" or "triton" force one; "cpu": the C kernels of cpu.c
for the ops they cover (norm, rotary + cache write, decode attention, SiLU) on float32
weights and caches, the torch reference for the rest). A CPU model asked for "auto" resolves
to "cpu" where the kernels build (CausalLM.bind_kv_cache). There is no process-wide
setting: each engine's model carries its own backend (EngineOptions.kernel_backend, checked
against engine.config.KERNEL_BACKENDS where the options are built) and hands it to every op,
so two engines in one process never change each other's kernels.
The Triton kernels live in their own modules (imported on first use, so the CPU path never
imports triton, and TRITON_INTERPRET set before that first use still takes effect);
`reference.py` holds the torch oracle for each.

Both paged attention ops take `window=` (a layer's sliding window: each query sees its last
`window` positions, itself included) and `sinks=` ([H_q] fp32 logits joining every softmax's
denominator, GPT-OSS) on every path: Triton, the torch reference and the C decode kernel.

The public ops keep reference.py's signatures. Keyword-only extras the Triton wrappers take
(`out=`, `max_context_len=`, ...) are accepted on both paths: the torch path writes its result
into `out` when given and ignores the launch hints.
"""
from __future__ import annotations

import importlib

import torch

from . import cpu, packing, reference
from .rope import build_cos_sin_cache

__all__ = ["use_triton", "write_kv_cache", "paged_prefill_attention", "paged_decode_attention",
           "rope_decode_attention",
           "rms_norm", "rope_rows", "rotary_embedding", "rotary_embedding_write_kv", "silu_and_mul",
           "build_cos_sin_cache"]


def use_triton(t: torch.Tensor, backend: str = "auto") -> bool:
    """The decision every op makes, from the backend and the device of its first tensor."""
    if backend == "auto":
        return t.is_cuda
    return backend == "triton"


def use_cpu(backend: str) -> bool:
    """The C kernels take this op: backend "cpu", which a model settles on only for a float32
    model with a float32 KV cache on CPU (CausalLM.bind_kv_cache), so every weight, residual
    and cache its ops see is one the kernels take (they raise on anything else)."""
    return backend == "cpu"


def _triton_op(module: str, name: str):
    try:
        return getattr(importlib.import_module(f"{__name__}.{module}"), name)
    except ModuleNotFoundError as e:     # a CPU install without the gpu extra
        if e.name != "triton":
            raise
        raise ModuleNotFoundError("the Triton kernels need triton, which is not installed: "
                                  "pip install 'pdserve[gpu]'", name="triton") from None


def _into(out: torch.Tensor | None, result: torch.Tensor) -> torch.Tensor:
    if out is None:
        return result
    out.copy_(result)
    return out


def write_kv_cache(k, v, k_cache, v_cache, slot_mapping, *, k_scales=None, v_scales=None,
                   k_shift=None, backend: str = "auto") -> None:
    """`k_scales`/`v_scales` [num_blocks, H_kv] fp32: the cache is 8-bit (see reference.py);
    `k_shift` [H_kv, D] fp32 (8-bit only): subtracted from K before it is quantized."""
    if use_triton(k_cache, backend):
        if k_scales is not None:
            return _triton_op("kv_cache", "write_kv_cache_quant")(k, v, k_cache, v_cache, k_scales,
                                                                  v_scales, slot_mapping, k_shift)
        return _triton_op("kv_cache", "write_kv_cache")(k, v, k_cache, v_cache, slot_mapping)
    if k_scales is not None:
        return reference.write_kv_cache_quant(k, v, k_cache, v_cache, k_scales, v_scales,
                                              slot_mapping, k_shift)
    return reference.write_kv_cache(k, v, k_cache, v_cache, slot_mapping)


def paged_prefill_attention(q, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens, scale,
                            *, max_q_len: int | None = None, out=None, k_scales=None,
                            v_scales=None, window: int | None = None, sinks=None,
                            backend: str = "auto"):
    """`window`: each query sees its last `window` positions, itself included (None: all);
    `sinks`: [H_q] fp32 logits that join every softmax's denominator (reference.py)."""
    if use_triton(q, backend):
        return _triton_op("prefill_attention", "paged_prefill_attention")(
            q, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens, scale,
            max_q_len=max_q_len, out=out, k_scales=k_scales, v_scales=v_scales, window=window,
            sinks=sinks)
    if use_cpu(backend) and sinks is None and k_scales is None:
        return _into(out, _flash_prefill(q, k_cache, v_cache, block_tables, cu_seqlens_q,
                                         context_lens, scale, window))
    return _into(out, reference.paged_prefill_attention(q, k_cache, v_cache, block_tables,
                                                        cu_seqlens_q, context_lens, scale,
                                                        k_scales, v_scales, window, sinks))


def _flash_prefill(q, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens, scale, window):
    """The cpu backend's prefill attention: reference.paged_prefill_attention's arithmetic
    through torch's blocked CPU kernel (`_scaled_dot_product_flash_attention_for_cpu`: online
    softmax over key blocks, never the [q, L] score matrix; it takes 4-D inputs, the
    reference's 3-D ones fall to the materialising math path: 69% of a 1k-token prefill).
    A chunk that starts the sequence is plain causal (is_causal: the blocks above the diagonal
    are skipped); a chunk after a prefix, or a window, passes the reference's bool mask."""
    F = torch.nn.functional
    out = torch.empty_like(q)
    hq, hkv = q.shape[1], k_cache.shape[2]
    cu, lens = cu_seqlens_q.tolist(), context_lens.tolist()
    for b, L in enumerate(lens):
        s, e = cu[b], cu[b + 1]
        if e == s:
            continue
        qb = q[s:e].transpose(0, 1).unsqueeze(0)                                  # [1, Hq, n, D]
        kb = reference._gather(k_cache, block_tables[b], L).transpose(0, 1).unsqueeze(0)
        vb = reference._gather(v_cache, block_tables[b], L).transpose(0, 1).unsqueeze(0)
        if e - s == L and window is None:
            o = F.scaled_dot_product_attention(qb, kb, vb, is_causal=True, scale=scale,
                                               enable_gqa=hq != hkv)
        else:
            mask = reference._visible(torch.arange(L - (e - s), L).unsqueeze(1), L, window)
            o = F.scaled_dot_product_attention(qb, kb, vb, attn_mask=mask, scale=scale,
                                               enable_gqa=hq != hkv)
        out[s:e] = o[0].transpose(0, 1)
    return out


def paged_decode_attention(q, k_cache, v_cache, block_tables, context_lens, scale,
                           *, max_context_len: int | None = None, out=None, k_scales=None,
                           v_scales=None, window: int | None = None, sinks=None, out_dtype=None,
                           backend: str = "auto"):
    """`out_dtype`: the dtype the caller's next op takes (the C kernels write it directly;
    elsewhere a hint, ignored). `window`, `sinks`: as in paged_prefill_attention (the C
    kernel takes both)."""
    if use_triton(q, backend):
        return _triton_op("decode_attention", "paged_decode_attention")(
            q, k_cache, v_cache, block_tables, context_lens, scale,
            max_context_len=max_context_len, out=out, k_scales=k_scales, v_scales=v_scales,
            window=window, sinks=sinks)
    if out is None and k_scales is None and use_cpu(backend):
        return cpu.decode_attention(q, k_cache, v_cache, block_tables, context_lens, scale,
                                    out_dtype, window=window, sinks=sinks)
    return _into(out, reference.paged_decode_attention(q, k_cache, v_cache, block_tables,
                                                       context_lens, scale, k_scales, v_scales,
                                                       window, sinks))


def rope_decode_attention(positions, q, k, v, cos_sin_cache, k_cache, v_cache, slot_mapping,
                          block_tables, context_lens, scale, *, max_context_len: int | None = None,
                          k_scales=None, v_scales=None, k_shift=None, rows=None,
                          window: int | None = None, sinks=None, out_dtype=None,
                          backend: str = "auto"):
    """A decode step's attention (one query per sequence): rotary_embedding_write_kv, then
    paged_decode_attention of the rotated q. One C call on the cpu backend (cpu.c's two
    kernels in one: the same results); the two ops elsewhere."""
    if k_scales is None and use_cpu(backend):
        return cpu.rope_decode_attention(positions, q, k, v, cos_sin_cache, k_cache, v_cache,
                                         slot_mapping, block_tables, context_lens, scale,
                                         out_dtype, window=window, sinks=sinks)
    scales = dict(k_scales=k_scales, v_scales=v_scales, backend=backend)
    q = rotary_embedding_write_kv(positions, q, k, v, cos_sin_cache, k_cache, v_cache, slot_mapping,
                                  rows=rows, k_shift=k_shift, **scales)
    return paged_decode_attention(q, k_cache, v_cache, block_tables, context_lens, scale,
                                  max_context_len=max_context_len, window=window, sinks=sinks,
                                  out_dtype=out_dtype, **scales)


def write_latent_cache(latent, cache, slot_mapping, *, backend: str = "auto") -> None:
    """MLA: latent rows [T, D] into cache [num_blocks, block_size, D] (slot < 0: skipped)."""
    reference.write_latent_cache(latent, cache, slot_mapping)


def paged_mla_decode_attention(q, kv_cache, block_tables, context_lens, scale, v_dim, *,
                               max_context_len: int | None = None, out_dtype=None,
                               backend: str = "auto"):
    """MLA decode in the latent space: q [B, H, D] against every head's shared cached rows
    kv_cache [num_blocks, block_size, D] -> [B, H, v_dim] (reference.py; mla_decode.py on
    Triton, cpu_mla.c on the C path)."""
    if use_triton(q, backend):
        return _triton_op("mla_decode", "paged_mla_decode_attention")(
            q, kv_cache, block_tables, context_lens, scale, v_dim, max_context_len=max_context_len)
    if use_cpu(backend):
        return cpu.mla_decode_attention(q, kv_cache, block_tables, context_lens, scale, v_dim, out_dtype)
    return reference.paged_mla_decode_attention(q, kv_cache, block_tables, context_lens, scale, v_dim)


def rms_norm(x, weight, eps, residual=None, *, out=None, residual_out=None, out_dtype=None,
             backend: str = "auto"):
    """`out_dtype`: as in paged_decode_attention."""
    if use_triton(x, backend):
        return _triton_op("norm", "rms_norm")(x, weight, eps, residual, out=out,
                                              residual_out=residual_out)
    if out is None and residual_out is None and use_cpu(backend):
        return cpu.rms_norm(x, weight, eps, residual, out_dtype)
    res = reference.rms_norm(x, weight, eps, residual)
    if residual is None:
        return _into(out, res)
    return _into(out, res[0]), _into(residual_out, res[1])


def rotary_embedding(positions, q, k, cos_sin_cache, *, q_out=None, k_out=None, rows=None,
                     backend: str = "auto"):
    """`rows`: rope_rows(positions, cos_sin_cache) when the caller has them (the torch path)."""
    if use_triton(q, backend):
        return _triton_op("rotary", "rotary_embedding")(positions, q, k, cos_sin_cache,
                                                        q_out=q_out, k_out=k_out)
    qr, kr = reference.rotary_embedding(positions, q, k, cos_sin_cache, rows)
    return _into(q_out, qr), _into(k_out, kr)


def rope_rows(positions, cos_sin_cache, *, backend: str = "auto"):
    """The torch path's cos/sin rows of `positions`, gathered once per forward pass and handed
    to every layer's rotary op as `rows=`; None on the Triton path (its kernel reads the
    cache itself)."""
    if use_triton(cos_sin_cache, backend) or use_cpu(backend):   # both kernels read the cache
        return None
    return reference.rope_rows(positions, cos_sin_cache)


def rotary_embedding_write_kv(positions, q, k, v, cos_sin_cache, k_cache, v_cache, slot_mapping,
                              *, q_out=None, k_scales=None, v_scales=None, k_shift=None,
                              rows=None, backend: str = "auto"):
    """rotary_embedding on q and k, then write_kv_cache of the rotated k and v: one kernel
    on the Triton path. The cos/sin table's width is the rotary dimension: a table narrower
    than the head rotates its first values and passes the rest through (partial rotary), on
    every backend. Returns the rotated q. With `k_scales`/`v_scales` the cache is 8-bit
    (and `k_shift`, if given, is subtracted from the rotated K: write_kv_cache):
    on the Triton path the rotary kernel, then the quantized write (a kernel of its own, its
    tokens grouped by block on the host). `rows`: rope_rows(positions, cos_sin_cache) (the
    torch path; ignored by Triton)."""
    if use_triton(q, backend) and k_scales is not None:
        qr, kr = _triton_op("rotary", "rotary_embedding")(positions, q, k, cos_sin_cache,
                                                          q_out=q_out)
        _triton_op("kv_cache", "write_kv_cache_quant")(kr, v, k_cache, v_cache, k_scales,
                                                       v_scales, slot_mapping, k_shift)
        return qr
    if use_triton(q, backend):
        return _triton_op("rotary_kv", "rotary_embedding_write_kv")(
            positions, q, k, v, cos_sin_cache, k_cache, v_cache, slot_mapping, q_out=q_out)
    if q_out is None and k_scales is None and use_cpu(backend):
        return cpu.rope_write_kv(positions, q, k, v, cos_sin_cache, k_cache, v_cache, slot_mapping)
    qr, kr = reference.rotary_embedding(positions, q, k, cos_sin_cache, rows)
    write_kv_cache(kr, v, k_cache, v_cache, slot_mapping, k_scales=k_scales, v_scales=v_scales,
                   k_shift=k_shift, backend=backend)
    return _into(q_out, qr)


def silu_and_mul(x, *, out=None, out_dtype=None, backend: str = "auto"):
    """`out_dtype`: as in paged_decode_attention."""
    if use_triton(x, backend):
        return _triton_op("activation", "silu_and_mul")(x, out=out)
    if out is None and use_cpu(backend):
        return cpu.silu_and_mul(x, out_dtype)
    return _into(out, reference.silu_and_mul(x))


def gelu_tanh_and_mul(x, *, out=None, backend: str = "auto"):
    """Gemma's GeGLU gate: x [T, 2I] = cat(gate, up) -> gelu_tanh(gate) * up [T, I]."""
    if use_triton(x, backend):
        return _triton_op("activation", "gelu_tanh_and_mul")(x, out=out)
    return _into(out, reference.gelu_tanh_and_mul(x))


__all__ += ["gelu_tanh_and_mul", "fused_moe", "gpt_oss_swiglu"]


def fused_moe(x, w13, w2, topk_weights, topk_ids, *, w13_bias=None, w2_bias=None, swiglu=None,
              tiles=None, backend: str = "auto"):
    """The experts of an MoE block (moe.py; the reference loops over the experts). `tiles`:
    launch-config overrides for the Triton path. GPT-OSS's experts: `w13_bias` [E, 2I],
    `w2_bias` [E, H], `swiglu` (alpha, limit) for its clamped SwiGLU (reference.fused_moe)."""
    if use_triton(x, backend):
        return _triton_op("moe", "fused_moe")(x, w13, w2, topk_weights, topk_ids, w13_bias=w13_bias,
                                              w2_bias=w2_bias, swiglu=swiglu, tiles=tiles)
    return reference.fused_moe(x, w13, w2, topk_weights, topk_ids, w13_bias, w2_bias, swiglu)


def gpt_oss_swiglu(x, alpha: float, limit: float, *, backend: str = "auto"):
    """x [T, 2I] = cat(gate, up) -> GPT-OSS's clamped SwiGLU [T, I] (reference.gpt_oss_swiglu):
    the quantized experts' activation (the float ones fuse it into fused_moe)."""
    if use_triton(x, backend):
        return _triton_op("activation", "gpt_oss_swiglu")(x, alpha, limit)
    return reference.gpt_oss_swiglu(x, alpha, limit)


# -- quantized matmuls: x [M, K] @ W.T for each stored layout (engine/quant picks the layout) --
__all__ += ["int8_linear", "fp8_linear", "int4_linear", "int4pack_linear", "int8g32_linear",
            "int8g32_split_linear", "int8_groupmajor_linear"]
SMALL_M = 16        # up to this many rows the Triton weight-only kernels; above, dequantize + matmul


def _small(x: torch.Tensor, backend: str) -> bool:
    return use_triton(x, backend) and x.shape[0] <= SMALL_M


def int8_linear(x, q, scale, *, backend: str = "auto"):
    """int8 codes q [N, K] with a scale per output channel [N] (bfloat16 on CPU, which torch's
    and cpu.c's kernels take: they multiply bfloat16 x and return bfloat16). torch's kernel
    is wrong where K % 16 != 0 (seen on 2.13): such layers take the reference."""
    if _small(x, backend):
        return _triton_op("quant_matmul", "w8_matmul")(x, q, scale.float())
    if use_cpu(backend):            # every M: one path for prefill and decode
        return cpu.int8_matmul(x.bfloat16(), q, scale)
    if not use_triton(x, backend) and x.device.type == "cpu" and x.shape[1] % 16 == 0:
        return torch.ops.aten._weight_int8pack_mm(x.bfloat16(), q, scale)
    return reference.dequantized_linear(x, reference.dequantize_int8(q, scale))


def fp8_linear(x, q, scale, *, backend: str = "auto"):
    """float8_e4m3fn codes q [N, K], scale [N] (per channel) or [1] (per tensor) float32. On
    the Triton path above SMALL_M rows: torch._scaled_mm, x quantized per row (per channel
    weights) or per tensor. On CPU: the reference (fp8 saves memory only there)."""
    if _small(x, backend):
        return _triton_op("quant_matmul", "w8_matmul")(
            x, q, scale.expand(q.shape[0]).contiguous() if scale.numel() == 1 else scale)
    if use_triton(x, backend):
        return scaled_mm_fp8(x, q, scale, rowwise=scale.numel() > 1)
    return reference.dequantized_linear(x, reference.dequantize_fp8(q, scale))


def scaled_mm_fp8(x, q, scale, rowwise: bool):
    """x @ (q * scale).T through torch._scaled_mm, x quantized to e4m3 on the fly (per row when
    the weight has per-channel scales, per tensor otherwise)."""
    fp8_max = torch.finfo(torch.float8_e4m3fn).max
    xf = x.float()
    if rowwise:
        sx = xf.abs().amax(dim=1, keepdim=True).clamp(min=1e-12) / fp8_max      # [M, 1]
        sw = scale.view(1, -1)                                                 # [1, N]
    else:
        sx = xf.abs().amax().clamp(min=1e-12) / fp8_max
        sw = scale.reshape(())
    xq = (xf / sx).clamp(-fp8_max, fp8_max).to(torch.float8_e4m3fn)
    out_dtype = x.dtype if x.dtype != torch.float32 else torch.bfloat16
    return torch._scaled_mm(xq, q.t(), scale_a=sx, scale_b=sw, out_dtype=out_dtype)


def int4_linear(x, packed, scale, mn, group: int, *, backend: str = "auto"):
    """int4 codes two to a byte [N, K/2] (packing.py), float16 scale and min [N, K/group]."""
    if _small(x, backend):
        return _triton_op("quant_matmul", "int4_matmul")(x, packed, scale, mn, group)
    return reference.dequantized_linear(x, reference.dequantize_int4(packed, scale, mn, group))


# torch's generated binding of the op: torch.ops.aten.X goes through the JIT's boxed call
# (OpOverloadPacket, invokeOperatorFromPython), ~4% of a one-row decode step at 120 calls
_INT4PACK_MM = getattr(torch, "_weight_int4pack_mm_for_cpu", None) or \
    torch.ops.aten._weight_int4pack_mm_for_cpu


def int4pack_linear(x, packed, group: int, scales_and_zeros):
    """torch's CPU int4 kernel on its own layout (packing.to_int4pack): bfloat16 x and out."""
    if x.dtype != torch.bfloat16:
        x = x.bfloat16()
    return _INT4PACK_MM(x, packed, group, scales_and_zeros)


def int4cpu_linear(x, codes, scale, mn, group: int):
    """int4 codes in cpu_int4.c's runs of 32 [N, K/2], float16 scale and min [N, K/group]:
    the C kernel (float32 out; the layout exists only where it is built)."""
    return cpu.int4_matmul(x, codes, scale, mn, group)


def int8g32_linear(x, q, scale, *, backend: str = "auto"):
    """int8 codes [N, K] with a float32 scale per 32 values [N, K/32]: cpu.c's kernel (float32
    out from the stored codes), else the reference."""
    if use_cpu(backend):
        return cpu.int8g32_matmul(x, q, scale)
    return reference.dequantized_linear(x, reference.dequantize_int8(q, scale, 32))


def int8g32_split_linear(x, split, scale, *, backend: str = "auto"):
    """int8 codes held nibble-split (packing.py: [N, 2K/2] bytes) with float16 scales
    [N, K/32]: the Triton int4 kernel on [x, x], else the reference."""
    if _small(x, backend):
        return _triton_op("quant_matmul", "int4_matmul")(torch.cat((x, x), dim=1), split,
                                                         *packing.split_scales(scale), 32)
    codes = packing.nibble_join(packing.unpack_int4(split))
    return reference.dequantized_linear(x, reference.dequantize_int8(codes, scale, 32))


def int8_groupmajor_linear(x, q, scale, group_scales=None):
    """int8 codes held group-major [K/g, N, g] with scales [N, K/g] (float16): on CPU torch's
    int8 kernel once per group of columns (`group_scales` [K/g, N] bfloat16, its per-channel
    scales), the parts summed in float32; elsewhere the reference."""
    if x.device.type == "cpu":
        xb, g, y = x.bfloat16(), q.shape[2], None
        for i in range(q.shape[0]):
            part = torch.ops.aten._weight_int8pack_mm(xb[:, i * g:(i + 1) * g].contiguous(), q[i],
                                                      group_scales[i])
            y = part.float() if y is None else y.add_(part)
        return y
    gk, n, g = q.shape
    return reference.dequantized_linear(x, reference.dequantize_int8(
        q.transpose(0, 1).reshape(n, gk * g), scale, g))
