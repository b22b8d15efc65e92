"""Pre-quantized checkpoints read into the schemes' weights, codes and scales unchanged (no
requantization). Which tensor types and config entries each scheme reads is its own file's
business (`gguf_types`, `hf_weight`, `reads_compressed_tensors`); this module asks them.

  GGUF       a tensor of a type some scheme lists in `gguf_types` (Q8_0, Q4_0, Q4_1)
  Hugging Face config.json `quantization_config`:
    quant_method "fp8"                  fp8.py (`reads_quant_method`)
    quant_method "compressed-tensors"   every config group read by some scheme
                                        (int4.py: pack-quantized int4; fp8.py: float-quantized)
"""
from __future__ import annotations

from functools import cache
from typing import Callable, Iterator

import torch

from . import all_schemes
from .scheme import QuantWeight


@cache
def gguf_kept() -> dict[str, object]:
    """GGUF tensor type name -> the scheme that keeps it quantized."""
    return {t: s for s in all_schemes() for t in s.gguf_types}


def gguf_weight(raw) -> QuantWeight | None:
    """A 2-D GGUF RawTensor of a kept type as its scheme's weight; None for any other."""
    scheme = gguf_kept().get(raw.type_name)
    if scheme is None or len(raw.shape) != 2:
        return None
    return scheme.from_gguf(raw)


def check_config(config: dict, where) -> str | None:
    """The scheme a config.json's quantization_config names ("fp8" or "compressed-tensors"),
    None without one; anything no scheme reads exactly is a ValueError naming it."""
    qc = config.get("quantization_config")
    if not qc:
        return None
    method = qc.get("quant_method")
    if any(s.reads_quant_method(method, qc, where) for s in all_schemes()):
        return method
    if method != "compressed-tensors":
        raise ValueError(f"{where}: unsupported quantization_config quant_method {method!r}: "
                         "supported are fp8 and compressed-tensors")
    for name, group in (qc.get("config_groups") or {}).items():
        w = group.get("weights") or {}
        fmt = group.get("format") or qc.get("format")
        if not any(s.reads_compressed_tensors(fmt, w) for s in all_schemes()):
            raise ValueError(
                f"{where}: compressed-tensors group {name!r} (format {fmt!r}, weights {w}) is not "
                "supported: pack-quantized symmetric int4 with group 32 or 128 (no actorder), "
                "or float-quantized fp8 per tensor or channel")
    return method


def hf_tensors(keys: list[str], get: Callable[[str], torch.Tensor]
               ) -> Iterator[tuple[str, Callable[[], torch.Tensor | QuantWeight]]]:
    """(name, getter) for every weight of a pre-quantized safetensors checkpoint: a module's
    quantized weight and its scales become one `<module>.weight` whose getter returns the
    scheme's weight; other tensors pass through."""
    have, schemes = set(keys), all_schemes()
    siblings = tuple({s for scheme in schemes for s in scheme.hf_siblings})
    for key in keys:
        found = next((w for s in schemes if (w := s.hf_weight(key, have, get)) is not None), None)
        if found is not None:
            yield found
        elif not key.endswith(siblings):
            yield key, lambda k=key: get(k)
