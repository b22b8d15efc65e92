"""Weight quantization: one file per storage scheme behind this registry (torch-free, so the
CLI and config import the names without loading torch).

    scheme.py       the interface: QuantWeight (codes + scales), Packed (a kernel's layout),
                    QuantScheme (quantize, pack for a device and backend, read checkpoints)
    int8.py         int8 per output channel
    int8_g32.py     int8 with a scale per 32 values (GGUF Q8_0; every method's head/table)
    int4.py         int4_g32 / int4_g128 (GGUF Q4_0 / Q4_1, compressed-tensors int4)
    fp8.py          fp8 / fp8_tensor (quant_method "fp8", compressed-tensors fp8)
    amx.py          bfloat16 copies of the linears for matmuls of many rows (--amx-weights)
    linear.py       QuantLinear, QuantEmbedding, QuantExperts: layers holding a scheme
    quantize.py     quantize_model (float checkpoint -> quantized layers), weight_bytes
    checkpoint.py   pre-quantized tensors of GGUF and Hugging Face checkpoints, by scheme

A new scheme: one file with a QuantScheme subclass, and its line in SCHEMES below.
"""
from __future__ import annotations

import importlib

# name -> "module:class" under engine/quant, imported on first use
SCHEMES = {
    "int8": "int8:Int8",
    "int8_g32": "int8_g32:Int8G32",
    "int4_g32": "int4:Int4G32",
    "int4_g128": "int4:Int4G128",
    "fp8": "fp8:Fp8",
    "fp8_tensor": "fp8:Fp8Tensor",
}
# what --quantization takes: auto (as the checkpoint holds it), none (float), or a scheme
QUANTIZATIONS = ("auto", "none", *SCHEMES)
# what --amx-weights takes (amx.py: bfloat16 copies for matmuls of many rows)
AMX_WEIGHTS = ("auto", "off", "bf16")
_loaded: dict = {}


def check_method(name: str) -> str:
    """`name` if --quantization takes it, else ValueError."""
    if name not in QUANTIZATIONS:
        raise ValueError(f"unsupported quantization {name!r}: expected one of {QUANTIZATIONS}")
    return name


def get_scheme(name: str):
    """The registered QuantScheme instance of `name`."""
    if name not in _loaded:
        if name not in SCHEMES:
            raise ValueError(f"unknown quantization scheme {name!r}: expected one of {tuple(SCHEMES)}")
        module, _, cls = SCHEMES[name].partition(":")
        _loaded[name] = getattr(importlib.import_module(f"{__name__}.{module}"), cls)()
    return _loaded[name]


def all_schemes() -> list:
    return [get_scheme(n) for n in SCHEMES]
