"""The layers a quantized model is made of; each holds a scheme and its weight as the
scheme's chosen kernel stores it (a Packed, engine/quant/scheme.py).

    QuantLinear      y = x @ W.T (+ bias): nn.Linear's drop-in (decoder linears, the head);
                     with `keep_dense`, a bfloat16 copy for inputs of many rows (amx.py)
    QuantEmbedding   an embedding table of int8 rows (a scale per row, or per 32 values),
                     whose layout a tied head shares: one copy for lookups and logits
    QuantExperts     an MoE block's experts, a QuantLinear per expert and projection

`set_backend(model, backend)` hands a backend settled after loading (CausalLM.bind_kv_cache:
auto -> cpu) to every layer, and each scheme repacks what its kernel for that backend stores
differently, a tied head keeping the table's one copy.
"""
from __future__ import annotations

import torch
from torch import nn

from engine.kernels import gpt_oss_swiglu, silu_and_mul
from engine.kernels.reference import moe_by_expert

from . import get_scheme
from .scheme import Packed, QuantWeight


class QuantLinear(nn.Module):
    """y = x @ W.T (+ bias) with W held by `scheme` in `packed`. `head`: an output head (its
    layout may refine the top logits: Packed.refine_top)."""

    def __init__(self, scheme, packed: Packed, bias: torch.Tensor | None = None, head: bool = False):
        super().__init__()
        self.scheme, self.head = scheme, head
        self._set_packed(packed)
        self.out_features, self.in_features = packed.shape
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
        # the bfloat16 copy for matmuls of `dense_rows` rows or more (engine/quant/amx.py; 0:
        # none). `forward` reads these plain attributes first: a parameter, buffer or
        # submodule read goes through nn.Module.__getattr__ (~0.4 us), ~200 layers a step
        self.register_buffer("dense", None, persistent=False)
        self.dense_rows = 0
        self.has_bias = bias is not None

    @classmethod
    def of(cls, qw: QuantWeight, bias: torch.Tensor | None = None, *, keep_scales: bool = True,
           head: bool = False, backend: str = "auto") -> "QuantLinear":
        """From a scheme's weight (on the device the layer runs on), codes and scales as given.
        `keep_scales=False`: a layout that converts the scales for its kernel keeps only those."""
        scheme = get_scheme(qw.method)
        return cls(scheme, scheme.pack(qw, backend, keep_scales), bias, head)

    @classmethod
    def quantize(cls, method: str, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
                 head: bool = False, backend: str = "auto") -> "QuantLinear":
        """From a float weight [N, K], quantized by scheme `method`."""
        return cls.of(get_scheme(method).quantize(weight), bias, keep_scales=False, head=head,
                      backend=backend)

    @property
    def method(self) -> str:
        return self.scheme.name

    def extra_repr(self) -> str:
        return f"{self.method}, in={self.in_features}, out={self.out_features}"

    def quantized(self) -> QuantWeight:
        """The codes and scales this layer holds (read back exactly from its kernel's layout)."""
        return self.packed.quantized()

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The [N, K] weight this layer multiplies by."""
        return self.quantized().dequantize().to(dtype)

    def _set_packed(self, packed: Packed) -> None:
        """The layout, and `input_dtype`: the dtype this layer multiplies in, when it is not
        the activations' (see Packed.input_dtype); None for a head, which may recompute
        logits from x itself. A plain attribute, set with the layout (read ~90 times a
        step; a property through nn.Module.__getattr__ cost ~2% of a one-row step)."""
        self.packed = packed
        self.input_dtype = None if self.head else packed.input_dtype

    def set_backend(self, backend: str, moved: dict) -> None:
        self._set_packed(_repacked(self.scheme, self.packed, backend, moved))

    def keep_dense(self, min_rows: int) -> None:
        """Keep the weight dequantized and rounded once to bfloat16 beside the codes; inputs
        of `min_rows` rows or more multiply by it (engine/quant/amx.py). A copy already kept
        (a cached build's) stays."""
        if self.dense is not None:
            self.dense_rows = min_rows
            return
        w = self.dequantize(torch.float32)
        self.dense = w.to(torch.bfloat16, memory_format=torch.contiguous_format)
        self.dense_rows = min_rows

    def drop_dense(self) -> None:
        self.dense, self.dense_rows = None, 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x2 = x if x.dim() == 2 else x.reshape(-1, self.in_features)
        if self.dense_rows and x2.shape[0] >= self.dense_rows:
            y = nn.functional.linear(x2.to(torch.bfloat16), self.dense)    # oneDNN's bf16 brgemm
        else:
            y = self.packed.forward(x2)     # not __call__: no hooks here, ~200 such calls a step
        if self.head:
            y = self.packed.refine_top(x2, y)
        if y.dtype != x.dtype:
            y = y.to(x.dtype)
        if self.has_bias:
            y = y + self.bias
        return y if x.dim() == 2 else y.view(*shape[:-1], self.out_features)


class QuantEmbedding(nn.Module):
    """nn.Embedding over a scheme's table layout (`QuantScheme.table`)."""

    def __init__(self, qw: QuantWeight, dtype: torch.dtype, backend: str = "auto"):
        super().__init__()
        self.scheme = get_scheme(qw.method)
        self.dtype, self.shape = dtype, qw.shape
        self.packed = self.scheme.table(qw, backend)

    def tied_head(self) -> QuantLinear:
        """The output head of a tied model, over the table's codes (QuantScheme.tied_head)."""
        return QuantLinear(self.scheme, self.scheme.tied_head(self.packed), head=True)

    def quantized(self) -> QuantWeight:
        return self.packed.quantized()

    def set_backend(self, backend: str, moved: dict) -> None:
        self.packed = _repacked(self.scheme, self.packed, backend, moved)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.packed.lookup(ids, self.dtype)


class QuantExperts(nn.Module):
    """The experts of an MoE block (engine/models/moe.py Experts: gate_up_proj [E, 2I, H],
    down_proj [E, H, I]) held as one QuantLinear per expert and projection, computed by the
    loop engine/kernels/reference.py's `fused_moe` runs for the float ones (`moe_by_expert`:
    one expert at a time, its tokens gathered, scaled by the routing weight, summed in fp32).
    On CUDA that is the same loop, no fused kernel over the experts yet, and its `nonzero`
    waits on the device (no decode graphs: runner.py). GPT-OSS's experts: the biases
    (`gate_up_bias` [E, 2I], `down_bias` [E, H]) ride on the QuantLinears, `swiglu` (alpha,
    limit) picks its clamped SwiGLU over silu_and_mul."""

    def __init__(self, method: str, gate_up: torch.Tensor, down: torch.Tensor, backend: str = "auto",
                 *, gate_up_bias: torch.Tensor | None = None, down_bias: torch.Tensor | None = None,
                 swiglu: tuple[float, float] | None = None):
        super().__init__()
        self.backend, self.swiglu = backend, swiglu

        def layers(ws, bs):
            return nn.ModuleList(QuantLinear.quantize(method, w, None if bs is None else bs[e],
                                                      backend=backend) for e, w in enumerate(ws))
        self.gate_up = layers(gate_up, gate_up_bias)
        self.down = layers(down, down_bias)

    @classmethod
    def of(cls, method: str, experts: nn.Module, backend: str = "auto",
           swiglu: tuple[float, float] | None = None) -> "QuantExperts":
        """From a float Experts module, with its `gate_up_proj_bias` / `down_proj_bias` where
        it has them (GPT-OSS)."""
        bias = {k: getattr(experts, f"{p}_bias", None) for k, p in
                (("gate_up_bias", "gate_up_proj"), ("down_bias", "down_proj"))}
        return cls(method, experts.gate_up_proj.data, experts.down_proj.data, backend, swiglu=swiglu,
                   **{k: None if b is None else b.data for k, b in bias.items()})

    def forward(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        def expert(e: int, xs: torch.Tensor) -> torch.Tensor:
            h = self.gate_up[e](xs)
            if self.swiglu is None:
                return self.down[e](silu_and_mul(h, backend=self.backend))
            return self.down[e](gpt_oss_swiglu(h, *self.swiglu, backend=self.backend))
        return moe_by_expert(x, topk_weights, topk_ids, len(self.gate_up), expert)


def set_backend(model: nn.Module, backend: str) -> None:
    """Every quantized layer of `model` on `backend`: repacked where its scheme's kernel for
    it stores the weight otherwise; a layout shared by a table and its tied head is repacked
    once and stays shared."""
    moved: dict[int, Packed] = {}
    for m in model.modules():
        if isinstance(m, (QuantLinear, QuantEmbedding)):
            m.set_backend(backend, moved)


def _repacked(scheme, packed: Packed, backend: str, moved: dict) -> Packed:
    if id(packed) not in moved:
        moved[id(packed)] = scheme.repack(packed, backend)
    return moved[id(packed)]
