"""int8_g32: int8 codes with a float16 scale per 32 values along K (GGUF Q8_0), the layout
of GGUF Q8_0 checkpoints and of every method's output head and embedding table
(quantize.py's HEAD).

    w ~ q * s[n, k // 32]      (int8.Int8Weight with group 32)
    GGUF Q8_0: blocks of 32 values: float16 d, 32 int8 q; w = d * q (read as stored)

Layouts, by device and backend (the kernel choice of `Int8G32.pack`):

  CPU, N % 16 == 0     G32Int4Pack: torch's int4 kernel over the nibble split (q = 16 hi + lo,
                       engine/kernels/packing.py): x @ W.T = [x, x] @ [hi | lo].T, the hi
                       groups with scale 16 s and zero 0, the lo groups s and 8 s (the kernel
                       computes (code - 8) * scale + zero); bfloat16 x and out. As an output
                       head it recomputes its near-top logits exactly (`refine_top`).
  CPU, backend cpu     G32Plain: codes [N, K] and float32 scales, cpu.c's matmul (float32 out
                       from the stored codes; no refinement needed); `repack` moves a layer
                       (and a table) here when the model's backend is settled on cpu.
  CUDA, other CPU      G32Split: the nibble-split codes packed two to a byte, float16 scales:
                       the Triton int4 kernel on [x, x] up to 16 rows, else the reference
  a tied table         an embedding table (lookups) whose matmul the tied head shares: the
                       CPU int4 layout where its rows read back from it (a multiple of 64
                       rows, checked on three), else G32GroupMajor (codes [K/32, V, 32]; on
                       CPU torch's int8 kernel once per group of 32 columns, summed in float32)
"""
from __future__ import annotations

import numpy as np
import torch

import engine.kernels as K
from engine.kernels import packing as P

from .int8 import Int8Weight, quantize_int8
from .scheme import Packed, QuantScheme

EXACT_TOP_MAX = 512             # logits a CPU int8_g32 head recomputes exactly, at most
GROUP = 32


class G32Int4Pack(Packed):
    """torch's CPU int4 layout of the nibble split (the module docstring)."""

    def __init__(self, qw: Int8Weight, backend: str, keep_scales: bool):
        super().__init__(qw, backend)
        s = qw.scale.float()
        packed, sz = P.to_int4pack(P.nibble_split(qw.q), torch.cat((16 * s, s), dim=1),
                                   torch.cat((torch.zeros_like(s), 8 * s), dim=1))
        self.register_buffer("qweight", packed)
        self.register_buffer("scales_and_zeros", sz)                 # [2K/32, N, 2] bfloat16
        self.register_buffer("scale", qw.scale if keep_scales else None)
        self.rows_ok = self.rows_readable(qw.q)      # lookups and refine_top read rows back

    @property
    def input_dtype(self) -> torch.dtype | None:
        return torch.bfloat16

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xb = x.bfloat16()
        return K.int4pack_linear(torch.cat((xb, xb), dim=1), self.qweight, GROUP, self.scales_and_zeros)

    def _scales(self, rows=slice(None)) -> torch.Tensor:
        """The float16 scales kept, or the kernel's: the lo groups' (bfloat16-rounded)."""
        if self.scale is not None:
            return self.scale[rows]
        return self.scales_and_zeros[self.shape[1] // GROUP:, rows, 0].T.half()

    def quantized(self) -> Int8Weight:
        """The codes back: read from the bytes where rows read back (`rows_ok`: a table, as
        the backend cpu repack of the tied SmolLM2 table, 49152 rows: a fraction of a second), else through
        the kernel on the identity (exact too, but a [2K, 2K] x [2K, N] matmul: seconds)."""
        n, k = self.shape
        if self.rows_ok:
            return Int8Weight(P.int4pack_all_rows(self.qweight, n, k), self._scales(), GROUP)
        return Int8Weight(P.nibble_join(P.int4pack_codes(self.qweight, n, 2 * k)), self._scales(), GROUP)

    def rows_readable(self, q: torch.Tensor) -> bool:
        """Whether `packing.int4pack_rows` reads the codes `q` back out of this layout: a
        multiple of 64 rows, checked on three of them."""
        n, k = self.shape
        if n % 64 or not P.int4pack_block():
            return False
        probe = torch.tensor([0, 33, n - 1])
        return torch.equal(P.int4pack_rows(self.qweight, probe, k), q[probe])

    def lookup(self, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        q = P.int4pack_rows(self.qweight, ids.flatten(), self.shape[1])
        q = q.view(*ids.shape, -1, GROUP).float()                       # [..., K/g, g]
        return (q * self.scale[ids].float()[..., None]).flatten(-2).to(dtype)

    def refine_top(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """Logits from torch's bf16 kernel carry bfloat16 roundings (of x, and of each output:
        up to 2^-8 of its size), enough to swap two near-tied tokens (SmolLM2's answer to
        "What is the capital of France?" starts with 25.232 against 25.226, one bfloat16 value
        apart). Every column within 2^-5 of a row's largest magnitude of that row's maximum is
        recomputed in float32 from the stored codes and scales (a few rows of the table), so
        the argmax and the top logprobs are those of the dequantized table (only where the
        rows read back: `rows_ok`)."""
        if not self.rows_ok:
            return y
        y = y.float()
        top = y.amax(-1, keepdim=True)
        near = (y >= top - 2 ** -5 * y.abs().amax(-1, keepdim=True)).any(0)
        cols = near.nonzero().flatten()
        if cols.numel() > EXACT_TOP_MAX:
            cols = cols[y.amax(0)[cols].topk(EXACT_TOP_MAX).indices]
        k = self.shape[1]
        q = P.int4pack_rows(self.qweight, cols, k).view(-1, k // GROUP, GROUP).float()
        w = (q * self._scales(cols).float()[..., None]).view(-1, k)
        y[:, cols] = x.float() @ w.T
        return y


class G32Plain(Packed):
    """Codes [N, K] and float32 scales [N, K/32]: cpu.c's layout (backend cpu)."""

    def __init__(self, qw: Int8Weight, backend: str):
        super().__init__(qw, backend)
        self.register_buffer("qweight", qw.q.contiguous())
        self.register_buffer("scale", qw.scale.float().contiguous())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return K.int8g32_linear(x, self.qweight, self.scale, backend=self.backend)

    def quantized(self) -> Int8Weight:
        return Int8Weight(self.qweight, self.scale.half(), GROUP)

    def lookup(self, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        q = self.qweight[ids].view(*ids.shape, -1, GROUP).float()           # [..., K/g, g]
        return (q * self.scale[ids][..., None]).flatten(-2).to(dtype)


class G32Split(Packed):
    """The nibble-split codes packed two to a byte [N, K] bytes, float16 scales [N, K/32]."""

    def __init__(self, qw: Int8Weight, backend: str):
        super().__init__(qw, backend)
        self.register_buffer("qweight", P.pack_int4(P.nibble_split(qw.q)))
        self.register_buffer("scale", qw.scale)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return K.int8g32_split_linear(x, self.qweight, self.scale, backend=self.backend)

    def quantized(self) -> Int8Weight:
        return Int8Weight(P.nibble_join(P.unpack_int4(self.qweight)), self.scale, GROUP)


class G32GroupMajor(Packed):
    """A table's codes group-major [K/32, V, 32] and float16 scales [V, K/32] (on CPU also
    their transpose in bfloat16, torch's int8 kernel's per-channel scales)."""

    def __init__(self, qw: Int8Weight, backend: str):
        super().__init__(qw, backend)
        v, k = qw.shape
        self.register_buffer("qweight", qw.q.view(v, k // GROUP, GROUP).transpose(0, 1).contiguous())
        self.register_buffer("scale", qw.scale)
        cpu = qw.q.device.type == "cpu"
        self.register_buffer("group_scales", qw.scale.T.bfloat16().contiguous() if cpu else None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return K.int8_groupmajor_linear(x, self.qweight, self.scale, self.group_scales)

    def quantized(self) -> Int8Weight:
        gk, v, g = self.qweight.shape
        return Int8Weight(self.qweight.transpose(0, 1).reshape(v, gk * g), self.scale, GROUP)

    def lookup(self, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        q = self.qweight[:, ids].movedim(0, -2).float()                    # [..., K/g, g]
        return (q * self.scale[ids].float()[..., None]).flatten(-2).to(dtype)


def _cpu(qw: Int8Weight, backend: str) -> bool:
    """The CPU layouts: on a CPU device, unless the Triton kernels are asked for."""
    return qw.q.device.type == "cpu" and backend != "triton"


class Int8G32(QuantScheme):
    name, tables = "int8_g32", True
    gguf_types = ("Q8_0",)

    def quantize(self, w: torch.Tensor) -> Int8Weight:
        return quantize_int8(w, GROUP)

    def pack(self, qw: Int8Weight, backend: str, keep_scales: bool = True) -> Packed:
        if qw.group != GROUP:
            raise ValueError(f"int8_g32 layer given group-{qw.group} weights")
        # torch's CPU int4 kernel needs N % 16 == 0; backend cpu starts here too and moves to
        # G32Plain at bind (`repack`, from what this layout kept: see _scales)
        if _cpu(qw, backend) and qw.shape[0] % 16 == 0:
            return G32Int4Pack(qw, backend, keep_scales)
        return G32Split(qw, backend)

    def repack(self, packed: Packed, backend: str) -> Packed:
        if backend == "cpu" and not isinstance(packed, G32Plain):
            return G32Plain(packed.quantized(), backend)
        return super().repack(packed, backend)

    def table(self, qw: Int8Weight, backend: str) -> Packed:
        if _cpu(qw, backend) and qw.shape[0] % 64 == 0:
            packed = G32Int4Pack(qw, backend, keep_scales=True)
            if packed.rows_ok:
                return packed
        return G32GroupMajor(qw, backend)

    def from_gguf(self, raw) -> Int8Weight:
        n, k = raw.shape
        b = torch.from_numpy(np.array(raw.data, dtype=np.uint8)).view(n, k // 32, -1)
        d = b[..., 0:2].contiguous().view(torch.float16).squeeze(-1)     # [N, K/32]
        return Int8Weight(b[..., 2:].contiguous().view(torch.int8).reshape(n, k), d, GROUP)
