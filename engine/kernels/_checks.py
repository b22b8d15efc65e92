"""Argument checks shared by the Triton wrappers: each failure is a ValueError naming the
argument, so a wrong call fails in Python rather than as a silent out-of-bounds read."""
from __future__ import annotations

import os

import torch

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
KV8_DTYPES = (torch.float8_e4m3fn, torch.int8)        # an 8-bit cache with scales (reference.py)


def interpreting() -> bool:
    """True when Triton runs kernels through its CPU interpreter (TRITON_INTERPRET=1)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def check_tensor(name: str, t, ndim: int | None = None, dtypes=None, device=None,
                 last_contiguous: bool = True) -> None:
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if ndim is not None and t.dim() != ndim:
        raise ValueError(f"{name} must have {ndim} dims, got shape {tuple(t.shape)}")
    if dtypes is not None and t.dtype not in dtypes:
        raise ValueError(f"{name} has dtype {t.dtype}; expected one of {list(dtypes)}")
    if device is not None and t.device != device:
        raise ValueError(f"{name} is on {t.device}, expected {device} like the other inputs")
    if last_contiguous and t.dim() > 0 and t.shape[-1] > 1 and t.stride(-1) != 1:
        raise ValueError(f"{name} must be contiguous in its last dim (stride {t.stride(-1)})")


def check_shape(name: str, t: torch.Tensor, shape: tuple) -> None:
    if tuple(t.shape) != tuple(shape):
        raise ValueError(f"{name} has shape {tuple(t.shape)}, expected {tuple(shape)}")


def check_out(name: str, out: torch.Tensor, shape: tuple, dtype: torch.dtype, device) -> None:
    check_tensor(name, out, dtypes=(dtype,), device=device)
    check_shape(name, out, shape)


def dot_precision(dtype: torch.dtype) -> str:
    """fp32 inputs must not be rounded to tf32 inside tl.dot (the tests hold fp32 to 1e-4)."""
    return "ieee" if dtype == torch.float32 else "tf32"


def upcast_dot(dtype: torch.dtype) -> bool:
    """The Triton 3.x interpreter multiplies bf16 dot operands as raw uint16 bits; under the
    interpreter the kernels feed tl.dot fp32 copies instead (GPU runs use bf16 tensor cores)."""
    return interpreting() and dtype == torch.bfloat16


def check_kv_scales(k_cache: torch.Tensor, k_scales, v_scales) -> None:
    """Scales come in pairs, with an 8-bit cache only: [blocks, H_kv] fp32, contiguous (the
    kernels index both with one row stride)."""
    if (k_scales is None) != (v_scales is None):
        raise ValueError("k_scales and v_scales come together")
    if k_scales is None:
        return
    if k_cache.dtype not in KV8_DTYPES:
        raise ValueError(f"scales given with a {k_cache.dtype} cache; expected one of {list(KV8_DTYPES)}")
    for name, s in (("k_scales", k_scales), ("v_scales", v_scales)):
        check_tensor(name, s, 2, (torch.float32,), k_cache.device)
        check_shape(name, s, (k_cache.shape[0], k_cache.shape[2]))
        if not s.is_contiguous():
            raise ValueError(f"{name} must be contiguous")


def scale_args(k_cache: torch.Tensor, k_scales, v_scales) -> tuple:
    """(k_scales, v_scales, row stride) for a kernel; the cache stands in for absent scales
    (never read: KV_SCALED is False)."""
    if k_scales is None:
        return k_cache, k_cache, 0
    return k_scales, v_scales, k_scales.stride(0)


def check_paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                          block_tables: torch.Tensor, k_scales=None,
                          v_scales=None) -> tuple[int, int]:
    """What both paged attention kernels require: q [N, H_q, D]; K and V caches
    [blocks, block_size, H_kv, D] of q's dtype (or 8-bit with scales, check_kv_scales) and
    device with the same strides (the kernels index both with one set); H_q a multiple of
    H_kv; int32 block tables. -> (block_size, H_kv)."""
    check_tensor("q", q, 3, FLOAT_DTYPES)
    dev, d = q.device, q.shape[2]
    check_tensor("k_cache", k_cache, 4, KV8_DTYPES if k_scales is not None else (q.dtype,), dev)
    check_kv_scales(k_cache, k_scales, v_scales)
    _, bs, hkv, dk = k_cache.shape
    if dk != d:
        raise ValueError(f"k_cache head_dim {dk} != q head_dim {d}")
    check_tensor("v_cache", v_cache, 4, (k_cache.dtype,), dev)
    check_shape("v_cache", v_cache, k_cache.shape)
    if v_cache.stride() != k_cache.stride():
        raise ValueError(f"v_cache strides {v_cache.stride()} differ from k_cache's {k_cache.stride()}")
    if q.shape[1] % hkv:
        raise ValueError(f"query heads {q.shape[1]} not a multiple of KV heads {hkv}")
    check_tensor("block_tables", block_tables, 2, (torch.int32,), dev)
    return bs, hkv


NO_WINDOW = 1 << 30         # the kernels' window argument when every key is visible


def check_window_sinks(window, sinks, num_heads: int, q: torch.Tensor) -> tuple:
    """(window, sinks) as the attention kernels take them: window a positive int (None:
    NO_WINDOW), sinks [H_q] fp32 on q's device (None: q stands in, never read: HAS_SINKS is
    False)."""
    if window is not None and (not isinstance(window, int) or window < 1):
        raise ValueError(f"window must be a positive int or None, got {window!r}")
    if sinks is not None:
        check_tensor("sinks", sinks, 1, (torch.float32,), q.device)
        check_shape("sinks", sinks, (num_heads,))
    return (NO_WINDOW if window is None else min(window, NO_WINDOW),
            q if sinks is None else sinks)
