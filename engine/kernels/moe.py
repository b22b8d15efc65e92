"""fused_moe: the experts of a mixture-of-experts block as two grouped GEMMs.

    x [T, H], routed to top_k experts per token (topk_ids / topk_weights [T, k])
    rows           M = T * k, row t*k + j = (token t, its j-th expert)
    align          rows sorted by expert, each expert's run padded to BLOCK_M
                   (sorted_ids: row index, M marks padding; block_expert: one expert per
                   BLOCK_M rows, -1 for the spare blocks past the last expert's run)
    GEMM 1         inter[row] = silu(x[t] @ gate[e].T) * (x[t] @ up[e].T)      [M, I]
    GEMM 2         y[row]     = w[row] * (inter[row] @ down[e].T)               [M, H]
    sum            out[t]     = sum_j y[t*k + j]                                [T, H]

GPT-OSS's experts add biases (w13_bias [E, 2I] to gate and up before the activation, w2_bias
[E, H] before the routing weight) and gate with its clamped SwiGLU (`swiglu` = (alpha,
limit): g = min(gate, limit), u = clamp(up, -limit, limit), (u + 1) * g * sigmoid(alpha g));
both live in the same epilogues, selected at compile time.

Each program of a GEMM takes BLOCK_M sorted rows (all of one expert) and BLOCK_N output
columns, so every expert's weights are read once per column tile however many tokens chose
it, and experts no token chose cost nothing. The SiLU-and-mul is fused into GEMM 1's
epilogue (it computes the gate and the up tile together), the routing weight into GEMM 2's;
the k-way sum is one torch reduction.

One token (decode at batch 1) skips the alignment: its k rows go to k distinct experts, so
each row is a block of its own.

Graph-safe: the alignment is device-side tensor ops of shapes fixed by T (no host sync), and
the grid is sized for the worst case (every expert's run padded), spare blocks exit at once.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._checks import FLOAT_DTYPES, check_shape, check_tensor, dot_precision, upcast_dot


@triton.jit
def _moe_gemm_kernel(a_ptr, w_ptr, out_ptr, sorted_ids_ptr, block_expert_ptr, topw_ptr,
                     num_rows, N, K, stride_am, stride_we, stride_wn, stride_wk, stride_om,
                     bias_ptr, stride_be, alpha, limit,
                     A_ROW_DIV: tl.constexpr, SILU_MUL: tl.constexpr, WEIGHTED: tl.constexpr,
                     HAS_BIAS: tl.constexpr, CLAMPED: tl.constexpr,
                     ROW_PER_BLOCK: tl.constexpr, PREC: tl.constexpr, UPCAST: tl.constexpr,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    # grid (row blocks, column blocks); row blocks vary fastest, so the programs that share
    # one expert's weight tile run together and the tile is read from DRAM about once.
    # ROW_PER_BLOCK (one token): block m is row m alone and block_expert is topk_ids itself.
    # HAS_BIAS: bias [E, N] (GEMM 1: [E, 2N], gate then up) added before the epilogue;
    # CLAMPED (with SILU_MUL): GPT-OSS's clamped SwiGLU instead of silu(gate) * up.
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    e = tl.load(block_expert_ptr + pid_m).to(tl.int64)
    if e < 0:
        return
    if ROW_PER_BLOCK:
        rows = tl.where(tl.arange(0, BLOCK_M) == 0, pid_m, num_rows)
    else:
        rows = tl.load(sorted_ids_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    valid = rows < num_rows
    a_rows = (rows // A_ROW_DIV).to(tl.int64)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < N
    w_base = w_ptr + e * stride_we + cols[None, :].to(tl.int64) * stride_wn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < K
        a = tl.load(a_ptr + a_rows[:, None] * stride_am + ks[None, :],
                    mask=valid[:, None] & k_ok[None, :], other=0.0)
        w_mask = k_ok[:, None] & col_ok[None, :]
        w = tl.load(w_base + ks[:, None] * stride_wk, mask=w_mask, other=0.0)     # [BK, BN]
        if UPCAST:
            a = a.to(tl.float32)
            w = w.to(tl.float32)
        acc += tl.dot(a, w, input_precision=PREC)
        if SILU_MUL:     # the up rows sit N rows below the gate rows
            wu = tl.load(w_base + N * stride_wn + ks[:, None] * stride_wk, mask=w_mask, other=0.0)
            if UPCAST:
                wu = wu.to(tl.float32)
            acc_up += tl.dot(a, wu, input_precision=PREC)
    if HAS_BIAS:
        b_row = bias_ptr + e * stride_be
        acc += tl.load(b_row + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
        if SILU_MUL:
            acc_up += tl.load(b_row + N + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    if SILU_MUL:
        if CLAMPED:
            g = tl.minimum(acc, limit)
            u = tl.minimum(tl.maximum(acc_up, -limit), limit)
            acc = (u + 1.0) * (g / (1.0 + tl.exp(-alpha * g)))
        else:
            acc = acc / (1.0 + tl.exp(-acc)) * acc_up
    if WEIGHTED:
        acc = acc * tl.load(topw_ptr + rows, mask=valid, other=0.0)[:, None]
    tl.store(out_ptr + rows[:, None].to(tl.int64) * stride_om + cols[None, :],
             acc.to(out_ptr.dtype.element_ty), mask=valid[:, None] & col_ok[None, :])


def align_by_expert(topk_ids: torch.Tensor, num_experts: int, block_m: int):
    """topk_ids [T, k] -> (sorted_ids [P] int32, block_expert [P // block_m] int32).

    Rows are sorted by expert (stable: by token within an expert); each expert's run starts
    on a block boundary. P = M + min(E, M) * (block_m - 1) rounded up to block_m: the most
    any routing can need, so shapes depend on T only."""
    flat = topk_ids.reshape(-1).long()
    m, dev = flat.numel(), flat.device
    p = -(-(m + min(num_experts, m) * (block_m - 1)) // block_m) * block_m
    counts = torch.zeros(num_experts, dtype=torch.int64, device=dev)
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    ends = padded.cumsum(0)
    order = torch.argsort(flat, stable=True)
    e_sorted = flat[order]
    # destination of the i-th sorted row: its expert's padded start + its rank in the expert
    rank = torch.arange(m, device=dev) - (counts.cumsum(0) - counts)[e_sorted]
    sorted_ids = torch.full((p,), m, dtype=torch.int32, device=dev)
    sorted_ids.scatter_(0, (ends - padded)[e_sorted] + rank, order.to(torch.int32))
    starts = torch.arange(0, p, block_m, device=dev)
    block_expert = torch.searchsorted(ends, starts, right=True)
    block_expert = torch.where(block_expert < num_experts, block_expert, -1).to(torch.int32)
    return sorted_ids, block_expert


def _config(rows_per_expert: float, n: int, k: int) -> dict:
    """Tile sizes by the average rows an expert gets (decode: a few; prefill: many). BLOCK_N
    counts gate columns: GEMM 1's programs read 2 * BLOCK_N weight rows (gate and up)."""
    if rows_per_expert <= 8:
        bm, bn, bk, warps, stages = 16, 64, 128, 4, 4
    elif rows_per_expert <= 16:
        bm, bn, bk, warps, stages = 32, 64, 128, 4, 3
    elif rows_per_expert <= 64:
        bm, bn, bk, warps, stages = 64, 128, 64, 8, 4
    else:
        bm, bn, bk, warps, stages = 128, 128, 64, 8, 3
    # small test shapes: no tile wider than the matrix (the interpreter pays for every lane)
    bn = min(bn, max(16, triton.next_power_of_2(n)))
    bk = min(bk, max(16, triton.next_power_of_2(k)))
    return dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, num_warps=warps, num_stages=stages)


def _bias_args(bias: torch.Tensor | None, weight: torch.Tensor) -> tuple:
    """(pointer, row stride) of an optional bias; without one the weight stands in, unread."""
    return (weight, 0) if bias is None else (bias, bias.stride(0))


def fused_moe(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor, *, w13_bias: torch.Tensor | None = None,
              w2_bias: torch.Tensor | None = None, swiglu: tuple[float, float] | None = None,
              tiles: dict | None = None) -> torch.Tensor:
    """x [T, H]; w13 [E, 2I, H] = cat(gate, up) per expert; w2 [E, H, I]; topk_weights [T, k]
    (any float dtype, applied in fp32); topk_ids [T, k] int -> [T, H] in x.dtype.
    w13_bias [E, 2I], w2_bias [E, H] (x's dtype) and swiglu (alpha, limit): GPT-OSS (above).
    `tiles` overrides entries of the launch config chosen from the load (BLOCK_M / BLOCK_N /
    BLOCK_K / num_warps / num_stages, for both GEMMs): tests and the benchmark's sweep."""
    check_tensor("x", x, 2, FLOAT_DTYPES)
    t, h = x.shape
    check_tensor("w13", w13, 3, (x.dtype,), x.device)
    e, i2, _ = w13.shape
    check_shape("w13", w13, (e, i2, h))
    check_tensor("w2", w2, 3, (x.dtype,), x.device)
    check_shape("w2", w2, (e, h, i2 // 2))
    check_tensor("topk_ids", topk_ids, 2, (torch.int32, torch.int64), x.device)
    k = topk_ids.shape[1]
    check_shape("topk_ids", topk_ids, (t, k))
    check_tensor("topk_weights", topk_weights, 2, FLOAT_DTYPES, x.device)
    check_shape("topk_weights", topk_weights, (t, k))
    for name, b, shape in (("w13_bias", w13_bias, (e, i2)), ("w2_bias", w2_bias, (e, h))):
        if b is not None:
            check_tensor(name, b, 2, (x.dtype,), x.device)
            check_shape(name, b, shape)
    alpha, limit = swiglu if swiglu is not None else (1.0, 0.0)
    x = x.contiguous()
    i, m = i2 // 2, t * k
    out = torch.empty(t, h, dtype=x.dtype, device=x.device)
    if m == 0:
        return out
    cfg1, cfg2 = _config(m / e, i, h), _config(m / e, h, i)
    cfg1.update(tiles or {})
    cfg2.update(tiles or {})
    one_token = t == 1      # k rows, k distinct experts: no sorting (decode at batch 1)
    if one_token:
        sorted_ids = block_expert = topk_ids.reshape(-1)
    else:
        sorted_ids, block_expert = align_by_expert(topk_ids, e, cfg1["BLOCK_M"])
    weights = topk_weights.reshape(-1).float().contiguous()
    inter = torch.empty(m, i, dtype=x.dtype, device=x.device)
    y = torch.empty(m, h, dtype=x.dtype, device=x.device)
    prec, upcast = dot_precision(x.dtype), upcast_dot(x.dtype)
    nblk = block_expert.numel()
    _moe_gemm_kernel[(nblk, triton.cdiv(i, cfg1["BLOCK_N"]))](
        x, w13, inter, sorted_ids, block_expert, weights, m, i, h,
        x.stride(0), w13.stride(0), w13.stride(1), w13.stride(2), inter.stride(0),
        *_bias_args(w13_bias, w13), float(alpha), float(limit),
        A_ROW_DIV=k, SILU_MUL=True, WEIGHTED=False, HAS_BIAS=w13_bias is not None,
        CLAMPED=swiglu is not None, ROW_PER_BLOCK=one_token, PREC=prec, UPCAST=upcast, **cfg1)
    _moe_gemm_kernel[(nblk, triton.cdiv(h, cfg2["BLOCK_N"]))](
        inter, w2, y, sorted_ids, block_expert, weights, m, h, i,
        inter.stride(0), w2.stride(0), w2.stride(1), w2.stride(2), y.stride(0),
        *_bias_args(w2_bias, w2), 1.0, 0.0,
        A_ROW_DIV=1, SILU_MUL=False, WEIGHTED=True, HAS_BIAS=w2_bias is not None,
        CLAMPED=False, ROW_PER_BLOCK=one_token, PREC=prec, UPCAST=upcast, **cfg2)
    return torch.sum(y.view(t, k, h), dim=1, out=out)
