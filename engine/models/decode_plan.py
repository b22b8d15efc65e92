"""`DecodePlan`: a CPU decode step of a plain decoder in one C call (cpu_step.c).

At decode on the CPU a layer's arithmetic is small and its Python is not: ~10 kernel calls a
layer, each with its argument checks, allocations and dispatch, were half of a one-row step
of the default model (bench/RESULTS.md, "Speed"). The plan describes the model once, as C
structs pointing at the model's own tensors (no copy), and each decode step is then:

    embeddings (Python: the table lookup)  ->  pd_decode_step (C, without the GIL: every
    layer, then the final norm)  ->  hidden states [B, H]  ->  compute_logits (Python)

Which models: every layer a layers.DecoderLayer of layers.Attention and layers.MLP (the
Llama family: Llama, Mistral, Qwen2 with its q/k/v biases, Qwen3 with its per-head q/k
norms; sliding windows and sinks as configured), float32 norms and cache, and every linear
held float32 (nn.Linear) or in a layout the C code reads: int4 as cpu_int4.c stores it
(quant/int4.py Int4Cpu) or int8_g32 (quant/int8_g32.py G32Plain). Anything else (MoE,
MLA, other layer classes, an 8-bit cache, torch's int4 layout, fp8, int8 per channel)
builds no plan and runs layer by layer, as before. `build` says which and why.

Which steps: decode only (one query per sequence), no layer hook (a prefill worker ships KV
per layer). Where the linears keep bfloat16 copies for batches of many rows
(engine/quant/amx.py), such batches multiply by them here too (cpu_bf16.c, on the CPU's
bfloat16 dot products); a CPU without those leaves them to the layer path (oneDNN):
`max_rows`, from which rows a batch steps layer by layer (0: none).

The arithmetic is the layer-by-layer path's: the same C kernels in the same order with the
same float32 intermediates (tests/kernels/test_decode_plan.py compares the two bit for bit
on int4 and int8_g32 models, within float32 rounding on float32 ones, whose layer-by-layer
matmul is torch's, and on batches that take the bfloat16 copies, which oneDNN multiplies
in another order and rounds to bfloat16 on the layer path).

Threads: `step_threads` (EngineOptions; default every core the process may run on): the
stepping thread plus helpers (cpu_pool.c) that take chunks of each matmul and attention
only while the OS runs them; the caller takes back a chunk a descheduled helper holds, so
a busy core (the prefill worker's) never stalls the step, and the values are those of one
thread, bit for bit.

The structs hold raw pointers into the model's tensors: the plan is built when the model's
backend is settled (CausalLM.bind_kv_cache, after every repack) and is valid while those
tensors live; anything that replaces a weight or the cache afterwards must rebuild it.
"""
from __future__ import annotations

import ctypes
import logging
import weakref

import torch
from torch import nn

from engine.kernels import cpu

log = logging.getLogger(__name__)

LIN_F32, LIN_INT4, LIN_I8G32 = 0, 1, 2
SPIN_NS = 50_000       # a helper spins this long for the next op, then sleeps (cpu_pool.c)
STEAL_NS = 50_000      # a helper's chunk is taken back after this when the caller took none
_P, _I, _F = ctypes.c_void_p, ctypes.c_int, ctypes.c_float


class _Linear(ctypes.Structure):
    _fields_ = [("kind", _I), ("N", _I), ("K", _I), ("group", _I),
                ("w", _P), ("scale", _P), ("min", _P), ("bias", _P), ("dense", _P), ("dense_rows", _I)]


class _Layer(ctypes.Structure):
    _fields_ = [("input_norm", _P), ("post_norm", _P), ("q_norm", _P), ("k_norm", _P),
                ("qkv", _Linear), ("o", _Linear), ("gate_up", _Linear), ("down", _Linear),
                ("k_cache", _P), ("v_cache", _P), ("sinks", _P), ("window", _I)]


class _Model(ctypes.Structure):
    _fields_ = [("num_layers", _I), ("hidden", _I), ("num_heads", _I), ("num_kv_heads", _I),
                ("head_dim", _I), ("rotary_dim", _I), ("intermediate", _I), ("block_size", _I),
                ("eps", _F), ("scale", _F), ("cos_sin", _P), ("final_norm", _P),
                ("layers", ctypes.POINTER(_Layer)), ("head", _Linear)]


class Unsupported(Exception):
    """Why a model builds no plan (logged once, at bind)."""


def _f32(t: torch.Tensor | None, what: str) -> int | None:
    if t is None:
        return None
    if t.dtype != torch.float32 or not t.is_contiguous() or not t.is_cpu:
        raise Unsupported(f"{what} is not a contiguous float32 CPU tensor")
    return t.data_ptr()


def _linear(m: nn.Module, what: str, keep: list, leaves: list, head: bool = False) -> _Linear:
    """A linear layer as the C code reads it (`keep`: tensors the struct points into;
    `leaves`: gets the rows from which a bfloat16 copy the C code cannot use takes over;
    `head`: the output head, whose layout may not refine its top logits)."""
    from engine.quant.int4 import Int4Cpu
    from engine.quant.int8_g32 import G32Plain
    from engine.quant.linear import QuantLinear
    from engine.quant.scheme import Packed
    if type(m) is nn.Linear:
        n, k = m.weight.shape
        bias = m.bias
        lin = _Linear(LIN_F32, n, k, 0, _f32(m.weight.data, what), None, None, None)
        keep.append(m.weight.data)
    elif isinstance(m, QuantLinear) and m.head == head:
        p, (n, k), bias = m.packed, m.packed.shape, m.bias
        if head and type(p).refine_top is not Packed.refine_top:
            raise Unsupported(f"{what}: {type(p).__name__} refines its top logits")
        if isinstance(p, Int4Cpu):
            lin = _Linear(LIN_INT4, n, k, p.group, p.qweight.data_ptr(), p.scale.data_ptr(),
                          p.min.data_ptr(), None)
            keep.extend((p.qweight, p.scale, p.min))
        elif isinstance(p, G32Plain):
            lin = _Linear(LIN_I8G32, n, k, 32, p.qweight.data_ptr(), _f32(p.scale, what), None, None)
            keep.extend((p.qweight, p.scale))
        else:
            raise Unsupported(f"{what}: {type(p).__name__} weights")
    else:
        raise Unsupported(f"{what}: a {type(m).__name__}")
    if bias is not None:
        b = bias.data.float().contiguous()
        keep.append(b)
        lin.bias = b.data_ptr()
    dense = getattr(m, "dense", None)
    if dense is not None and m.dense_rows:           # engine/quant/amx.py's bfloat16 copy
        if cpu.has_bf16():
            lin.dense, lin.dense_rows = dense.data_ptr(), m.dense_rows
            keep.append(dense)
        else:                                        # no native bfloat16 dots: oneDNN's turn
            leaves.append(m.dense_rows)
    return lin


def _layer(i: int, layer: nn.Module, keep: list, leaves: list) -> _Layer:
    """Decoder layer `i` as the C code reads it (Unsupported: any other kind of layer)."""
    from .layers import MLP, Attention, DecoderLayer
    attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
    if type(layer) is not DecoderLayer or type(attn) is not Attention or type(mlp) is not MLP:
        raise Unsupported(f"layer {i} is a {type(layer).__name__} of {type(attn).__name__} "
                          f"and {type(mlp).__name__}")
    if attn.k_scales is not None or attn.k_cache is None:
        raise Unsupported("the KV cache is not a bound float32 one")
    sinks = None if attn.sinks is None else attn.sinks.data.float().contiguous()
    norms = (layer.input_layernorm.weight, layer.post_attention_layernorm.weight) + \
        ((attn.q_norm.weight, attn.k_norm.weight) if attn.q_norm else ())
    keep.extend([t.data for t in norms] + [attn.k_cache, attn.v_cache] + ([sinks] if sinks is not None else []))
    return _Layer(
        _f32(layer.input_layernorm.weight.data, "input_layernorm"),
        _f32(layer.post_attention_layernorm.weight.data, "post_attention_layernorm"),
        _f32(attn.q_norm.weight.data if attn.q_norm else None, "q_norm"),
        _f32(attn.k_norm.weight.data if attn.k_norm else None, "k_norm"),
        _linear(attn.qkv_proj, f"layer {i} qkv_proj", keep, leaves),
        _linear(attn.o_proj, f"layer {i} o_proj", keep, leaves),
        _linear(mlp.gate_up_proj, f"layer {i} gate_up_proj", keep, leaves),
        _linear(mlp.down_proj, f"layer {i} down_proj", keep, leaves),
        _f32(attn.k_cache, "k_cache"), _f32(attn.v_cache, "v_cache"),
        None if sinks is None else sinks.data_ptr(), attn.window or 0)


def _head(model: nn.Module, keep: list) -> _Linear | None:
    """The output head as the C code reads it: float32 (a tied float table too) or G32Plain
    codes; None (logged) for any other, whose logits stay layer by layer."""
    c = model.config
    try:
        if model.lm_head is None:                        # tied to a float table
            keep.append(model.embed_tokens.weight.data)
            return _Linear(LIN_F32, c.vocab_size, c.hidden_size, 0,
                           _f32(model.embed_tokens.weight.data, "embed_tokens"), None, None, None)
        return _linear(model.lm_head, "lm_head", keep, [], head=type(model.lm_head) is not nn.Linear)
    except Unsupported as e:
        log.info("logits layer by layer: %s", e)
        return None


class DecodePlan:
    """The model as cpu_step.c reads it, and its decode step (module docstring)."""

    def __init__(self, model: nn.Module):
        c = model.config
        keep: list[torch.Tensor] = []
        leaves: list[int] = []
        layers = [_layer(i, layer, keep, leaves) for i, layer in enumerate(model.layers)]
        first = model.layers[0]
        attn = first.self_attn
        eps = {first.input_layernorm.eps, first.post_attention_layernorm.eps, model.norm.eps}
        if len(eps) != 1:
            raise Unsupported(f"norms with different eps {sorted(eps)}")
        inter = first.mlp.gate_up_proj.out_features // 2
        if any(l.mlp.gate_up_proj.out_features != 2 * inter for l in model.layers):
            raise Unsupported("layers of different MLP widths")
        self._layers = (_Layer * len(layers))(*layers)
        # every tensor the structs point into: freed only after the plan (whose finalizer
        # joins the helper threads that may still read them)
        self._keep = keep + [model.norm.weight.data]
        self._model = _Model(len(layers), c.hidden_size, attn.nh, attn.nkv, attn.hd,
                             model.cos_sin.shape[1], inter, attn.k_cache.shape[1], eps.pop(),
                             attn.scale, _f32(model.cos_sin, "cos_sin"),
                             _f32(model.norm.weight.data, "norm"), self._layers)
        head = _head(model, keep)                       # the logits in C too, where it can
        self.has_head = head is not None
        if head is not None:
            self._model.head = head
        self._cos_sin = model.cos_sin                   # the table the struct points into
        self.hidden = c.hidden_size
        self.max_rows = min(leaves, default=0)          # 0: every batch
        lib = cpu.nogil_library()
        lib.pd_decode_step.argtypes = [ctypes.POINTER(_Model), _P, _I, _P, _P, _P, _P, _I, _P]
        lib.pd_decode_logits.argtypes, lib.pd_decode_logits.restype = [ctypes.POINTER(_Model), _P, _I, _P, _P], _I
        self._lib, self._step = lib, lib.pd_decode_step
        self.threads = max(1, getattr(model, "step_threads", 1))
        self._pool = None                               # its helper threads, at the first step

    @classmethod
    def build(cls, model: nn.Module) -> "DecodePlan | None":
        """The plan of `model` (on the cpu backend), or None, logging why."""
        if cpu.nogil_library() is None:
            return None
        try:
            return cls(model)
        except Unsupported as e:
            log.info("decode steps run layer by layer: %s", e)
            return None

    def takes(self, batch: int) -> bool:
        return not self.max_rows or batch < self.max_rows

    def pool(self):
        """The helper threads (cpu_pool.c), started at the first call."""
        if self._pool is None and self.threads > 1:
            self._pool = self._lib.pd_pool_new(self.threads - 1, SPIN_NS, STEAL_NS)
            weakref.finalize(self, self._lib.pd_pool_free, self._pool)   # joins them
        return self._pool

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """h [M, H] -> [M, V] float32 logits, the head's own arithmetic (has_head)."""
        h = h if h.dtype == torch.float32 and h.is_contiguous() else h.float().contiguous()
        y = torch.empty(h.shape[0], self._model.head.N)
        if self._lib.pd_decode_logits(ctypes.byref(self._model), self.pool(), h.shape[0], h.data_ptr(),
                                      y.data_ptr()):
            raise MemoryError("logits: no memory for scratch buffers")
        self._inputs = (h,)                 # read by late helpers until the next call
        return y

    def forward(self, h: torch.Tensor, positions: torch.Tensor, meta) -> torch.Tensor:
        """h [B, H] float32 embeddings (overwritten) -> [B, H] final hidden states."""
        if h.dtype != torch.float32 or not h.is_contiguous():
            h = h.float().contiguous()
        B = h.shape[0]
        tables = meta.block_tables if meta.block_tables.is_contiguous() else meta.block_tables.contiguous()
        pos = positions if positions.dtype == torch.int64 else positions.long()
        if self._step(ctypes.byref(self._model), self.pool(), B, h.data_ptr(), pos.data_ptr(),
                      meta.slot_mapping.data_ptr(), tables.data_ptr(), tables.shape[1],
                      meta.context_lens.data_ptr()):
            raise MemoryError("decode step: no memory for its scratch buffers")
        # a helper whose chunk the step took back may still read these until the next call
        # begins (cpu_pool.c: pool_quiesce): they live until then
        self._inputs = (pos, meta.slot_mapping, tables, meta.context_lens)
        return h
