"""What a quantization scheme is: the interface every file of engine/quant implements.

    QuantWeight   the codes and scales of one [N, K] weight as a checkpoint or a quantizer
                  gives them (a dataclass of tensors): its shape, its exact float value, rows
                  concatenated (fused projections), moved to a device
    Packed        the same weight as a kernel stores it on one device for one kernel backend
                  (an nn.Module of buffers): `forward(x [M, K])` runs its matmul through
                  engine.kernels, `quantized()` reads the QuantWeight back exactly
    QuantScheme   one storage format: quantize a float weight, choose the Packed layout for a
                  device and backend (its kernel choice), read its own checkpoint formats
                  (GGUF tensor types, Hugging Face quantization_config entries)

A layer (engine/quant/linear.py: QuantLinear) holds a scheme and a Packed weight; the model's
backend, settled at CausalLM.bind_kv_cache, may have the scheme repack it (`repack`).
"""
from __future__ import annotations

import dataclasses
from typing import Callable, ClassVar

import torch
from torch import nn


class QuantWeight:
    """Base of the dataclasses of codes and scales (int8.Int8Weight, int4.Int4Weight, ...)."""

    @property
    def method(self) -> str:
        """The registry name of the scheme this weight is stored in."""
        raise NotImplementedError

    @property
    def shape(self) -> tuple[int, int]:
        raise NotImplementedError

    def dequantize(self) -> torch.Tensor:
        """The float32 [N, K] weight it stands for."""
        raise NotImplementedError

    @classmethod
    def cat(cls, parts: list) -> "QuantWeight":
        """Weights of one scheme stacked along N (the fused qkv / gate_up projections)."""
        fields = [f.name for f in dataclasses.fields(cls)]
        first = parts[0]
        return cls(**{f: torch.cat([getattr(p, f) for p in parts]) if isinstance(getattr(first, f), torch.Tensor)
                      else getattr(first, f) for f in fields})

    def to(self, device) -> "QuantWeight":
        return dataclasses.replace(self, **{f.name: getattr(self, f.name).to(device)
                                            for f in dataclasses.fields(self)
                                            if isinstance(getattr(self, f.name), torch.Tensor)})


class Packed(nn.Module):
    """A weight as one kernel stores it. Subclasses register their tensors as buffers (so
    `.to()`, `state_dict()` and weight_bytes see them) and keep `backend` (the model's)."""

    def __init__(self, qw: QuantWeight, backend: str):
        super().__init__()
        self.shape, self.backend = qw.shape, backend          # (N, K)

    @property
    def input_dtype(self) -> torch.dtype | None:
        """The dtype this kernel multiplies in when it is not the activations' (torch's CPU
        int8/int4 kernels: bfloat16), so the op before it can write that directly."""
        return None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [M, K] -> [M, N], in whatever float dtype the kernel returns."""
        raise NotImplementedError

    def quantized(self) -> QuantWeight:
        raise NotImplementedError

    def refine_top(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """An output head's logits `y` made exact where rounding could change the top ones
        (int8_g32's CPU int4 layout does); others return y."""
        return y

    def lookup(self, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Rows `ids` of the [V, K] table in `dtype`: an embedding held in this layout."""
        raise TypeError(f"{type(self).__name__} does not hold an embedding table")


class QuantScheme:
    """One storage format, registered by name in engine/quant/__init__.py."""
    name: ClassVar[str]
    tables: ClassVar[bool] = False                   # can hold an embedding table (`table`)
    gguf_types: ClassVar[tuple[str, ...]] = ()      # GGUF tensor types read into this scheme
    hf_siblings: ClassVar[tuple[str, ...]] = ()     # safetensors suffixes its weights consume

    def quantize(self, w: torch.Tensor) -> QuantWeight:
        raise ValueError(f"cannot quantize to {self.name!r}")

    def pack(self, qw: QuantWeight, backend: str, keep_scales: bool = True) -> Packed:
        """The layout (and so the kernel) for qw's device and `backend`. `keep_scales=False`:
        a layout that converts the scales for its kernel may drop the originals."""
        raise NotImplementedError

    def repack(self, packed: Packed, backend: str) -> Packed:
        """`packed` for a backend settled after it was built (auto -> cpu); the same object
        where its layout serves the new backend too."""
        packed.backend = backend
        return packed

    def table(self, qw: QuantWeight, backend: str) -> Packed:
        """A layout with `lookup`: an embedding table."""
        raise ValueError(f"{self.name} weights cannot hold an embedding table")

    def tied_head(self, table: Packed) -> Packed:
        """The layout a tied head multiplies by: the table's own (one copy), unless its
        kernel cannot."""
        return table

    def from_gguf(self, raw) -> QuantWeight:
        """A GGUF RawTensor of one of `gguf_types`, codes and scales as stored."""
        raise NotImplementedError

    def hf_weight(self, key: str, have: set[str], get: Callable[[str], torch.Tensor]
                  ) -> tuple[str, Callable[[], QuantWeight]] | None:
        """(weight name, getter) when `key` is this scheme's weight in a pre-quantized
        safetensors checkpoint (with its siblings in `have`); None otherwise."""
        return None

    def reads_quant_method(self, method: str | None, qc: dict, where) -> bool:
        """Whether a config.json quantization_config of `method` is this scheme's own format
        (ValueError where it is, with settings it cannot read exactly)."""
        return False

    def reads_compressed_tensors(self, fmt: str | None, weights: dict) -> bool:
        """Whether a compressed-tensors config group (format, weights args) is this scheme's."""
        return False
