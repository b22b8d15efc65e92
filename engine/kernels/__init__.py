"""Kernels used by the model: Triton on CUDA, torch references on CPU.

Every op here dispatches on the selected backend ("auto": Triton for CUDA tensors, the torch
reference otherwise; "torch" or "triton" force one). The Triton kernels live in their own
modules; `reference.py` holds the torch oracle for each.
"""
from __future__ import annotations

from . import reference

_BACKEND = "auto"


def set_backend(name: str) -> None:
    global _BACKEND
    if name not in ("auto", "torch", "triton"):
        raise ValueError(f"unknown kernel backend {name!r}: expected auto, torch or triton")
    _BACKEND = name


def get_backend() -> str:
    return _BACKEND


write_kv_cache = reference.write_kv_cache
paged_prefill_attention = reference.paged_prefill_attention
paged_decode_attention = reference.paged_decode_attention
rms_norm = reference.rms_norm
rotary_embedding = reference.rotary_embedding
silu_and_mul = reference.silu_and_mul
