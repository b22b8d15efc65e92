"""QuantLinear: a drop-in for the model's nn.Linear layers with a quantized weight, and
`quantize_model`, the seam that swaps them in after loading.

Where each method runs (x: [M, K] activations, M = tokens in the step):

              CPU                                         CUDA
  int8        aten._weight_int8pack_mm (bf16 x); with the   M <= 16: Triton w8_matmul
              C kernels (backend cpu): cpu.c's int8        else: dequantize, F.linear
              matmul (same bf16 x and output; one
              thread); K % 16 != 0 (torch's kernel is
              wrong there, 2.13): dequantize, F.linear
  int8_g32    aten._weight_int4pack_mm_for_cpu (bf16 x),   M <= 16: Triton int4_matmul, the
              the codes split in two nibbles (below)       same split; else dequantize, F.linear
  int4_gN     aten._weight_int4pack_mm_for_cpu (bf16 x)    M <= 16: Triton int4_matmul
                                                           else: dequantize, F.linear
  fp8         dequantize, F.linear (saves memory only)     M <= 16: Triton w8_matmul
                                                           else: torch._scaled_mm, x quantized
                                                           per token (per tensor for fp8_tensor)

torch's CPU int8/int4 kernels are fast only for bfloat16 activations (float32 ones take a
slow generic path: measured 8-25x slower), so x is rounded to bfloat16 for them. On CPU each
method takes one path whatever M is, so a prompt prefilled in chunks (a prefill worker's) and
one prefilled whole compute alike (int8 used to dequantize above 16 rows: a P/D test caught the
two differing at a near-tie; the kernel costs ~15% more there: 12.6 vs 10.9 ms at 64 rows,
bench/logs/2026-11-30-quant-cpu.log).
The CPU int4 kernel wants its own packed layout (`_convert_weight_to_int4pack_for_cpu`) and
bfloat16 scale/zero pairs, derived from the scale and min kept as given (exact: a GGUF's
float16 ones). Layers with N % 16 != 0, which it refuses, keep the plain layout and dequantize.
int8_g32 (GGUF Q8_0: a scale per 32 values, which torch's int8 kernel, per channel only, cannot
take) runs on the same kernel: q = 16 * hi + lo with hi = q >> 4 in [-8, 7] and lo = q & 15,
so x @ W.T = [x, x] @ [hi part | lo part].T, the hi groups with scale 16 s and zero 0, the lo
groups with scale s and zero 8 s (the kernel computes (code - 8) * scale + zero). On CUDA the
same split feeds the Triton int4 kernel (w = code * scale + min: hi groups 16 s and -128 s,
lo groups s and 0), the split codes being the only copy (N x K bytes, as int8).
"""
from __future__ import annotations

import torch
from torch import nn

from engine.config import QUANTIZATIONS as METHODS
from engine.kernels import cpu as cpu_kernels
from engine.kernels import silu_and_mul
from engine.kernels.reference import moe_by_expert

from .quantize import (FP8_MAX, Fp8Weight, Int4Weight, Int8Weight, QuantWeight, dequantize, pack_int4,
                       quantize_fp8, quantize_int4, quantize_int8, unpack_int4)

SMALL_M = 16                    # up to this many rows: the weight-only kernels
EXACT_TOP_MAX = 512             # logits a CPU int8_g32 head recomputes exactly, at most


# the output head and embedding table under every method: int8 with a float16 scale per 32
# values (GGUF Q8_0's layout). SmolLM2-135M, int8 decoder linears, 2047 tokens of GPL-3
# (bench/logs/2026-11-30-quant-eval.log, measured while int8 above 16 rows still ran in float32):
# perplexity +0.30% with the head and embedding int8 per row, +0.30% int8_g32, +0.36% float32;
# greedy tokens agreeing 60.5%, 65.0%, 74.6%; weights 0.50x, 0.51x, 0.82x of bf16.
# None: leave them in the model dtype.
HEAD: str | None = "int8_g32"


def check_method(name: str) -> str:
    if name not in METHODS:
        raise ValueError(f"unknown quantization {name!r}: expected one of {METHODS}")
    return name


class QuantLinear(nn.Module):
    """y = x @ W.T (+ bias) with W held quantized. Build with `from_float` or `from_quantized`."""

    def __init__(self, method: str, in_features: int, out_features: int,
                 bias: torch.Tensor | None, device: torch.device):
        super().__init__()
        self.method, self.in_features, self.out_features = method, in_features, out_features
        self.on_cpu = torch.device(device).type == "cpu"
        self.group = int(method.split("_g")[1]) if "_g" in method else 0
        # torch's CPU int4 kernel needs N % 16 == 0; other shapes keep the plain layout
        self.cpu_int4 = self.on_cpu and bool(self.group) and out_features % 16 == 0
        self.group_major = False        # see `sharing`
        self.cpu_g32 = False            # see `to_cpu_kernels`
        self.exact_top = False          # see `_exact_top`
        self.backend = "auto"           # the model's, settled at CausalLM.bind_kv_cache
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)

    @classmethod
    def from_float(cls, method: str, weight: torch.Tensor, bias: torch.Tensor | None = None):
        if method in ("int8", "int8_g32"):
            return cls.from_quantized(method, quantize_int8(weight, 32 if method == "int8_g32" else 0),
                                      bias, keep_scales=False)
        if method.startswith("int4"):
            return cls.from_quantized(method, quantize_int4(weight, int(method.split("_g")[1])), bias,
                                      keep_scales=False)
        if method in ("fp8", "fp8_tensor"):
            return cls.from_quantized(method, quantize_fp8(weight, method == "fp8"), bias)
        raise ValueError(f"cannot quantize to {method!r}")

    @classmethod
    def from_quantized(cls, method: str, qw: QuantWeight, bias: torch.Tensor | None = None,
                       keep_scales: bool = True) -> "QuantLinear":
        """From an Int8Weight / Int4Weight / Fp8Weight (on the device the layer runs on), its
        codes and scales kept as given. `keep_scales=False`: in torch's CPU int4 layout, keep
        only the kernel's bfloat16 scales (1 bit a weight less at group 32; `quantized()` then
        reads them back from those)."""
        if isinstance(qw, Int4Weight):
            (n, k), dev = qw.shape, qw.packed.device
        else:
            (n, k), dev = qw.q.shape, qw.q.device
        self = cls(method, k, n, bias, dev)
        if self.group and qw.group != self.group:
            raise ValueError(f"{method} layer given group-{qw.group} weights")
        if method == "int8":
            self.register_buffer("qweight", qw.q)
            # the CPU kernel takes scales in the activation dtype
            self.register_buffer("scale", qw.scale.bfloat16() if self.on_cpu else qw.scale.float())
        elif self.group:
            if keep_scales or not self.cpu_int4:
                self.register_buffer("scale", qw.scale)
                if method.startswith("int4"):
                    self.register_buffer("min", qw.min)
            if not self.cpu_int4:
                self.register_buffer("qweight", qw.packed if method.startswith("int4")
                                     else pack_int4(_nibble_split(qw.q)))
            elif method.startswith("int4"):
                # torch's int4 dequantization is (q - 8) * scale + zero
                s = qw.scale.float()
                self._int4pack(unpack_int4(qw.packed), s, qw.min.float() + 8 * s)
            else:
                s = qw.scale.float()
                self._int4pack(_nibble_split(qw.q), torch.cat((16 * s, s), dim=1),
                               torch.cat((torch.zeros_like(s), 8 * s), dim=1))
        else:
            self.register_buffer("qweight", qw.q)
            self.register_buffer("scale", qw.scale.float())
        return self

    @classmethod
    def sharing(cls, emb: "QuantEmbedding") -> "QuantLinear":
        """A tied head over an int8_g32 embedding table's own codes and scales: one copy for
        lookups and logits. On CPU the table is held in torch's int4 kernel layout (the nibble
        split) where it can be: the head runs that kernel as other int8_g32 layers do, then
        recomputes exactly the logits that could be the largest (`_exact_top`). Otherwise
        (codes group-major [K/32, V, 32]) it runs torch's int8 kernel (per channel scales)
        once per group of 32 columns and sums in float32 on CPU, and dequantizes elsewhere."""
        n, k = emb.shape
        self = cls("int8_g32", k, n, None, emb.qweight.device)
        self.register_buffer("qweight", emb.qweight)
        self.register_buffer("scale", emb.scale)
        if emb.cpu_packed:
            self.register_buffer("scales_and_zeros", emb.scales_and_zeros)
            self.exact_top = True
            return self
        self.cpu_int4, self.group_major = False, True
        if self.on_cpu:
            self.register_buffer("group_scales", emb.scale.T.bfloat16().contiguous())   # [K/32, V]
        return self

    @classmethod
    def head(cls, qw: Int8Weight, keep_scales: bool = True) -> "QuantLinear":
        """An untied output head of int8_g32 codes: as any int8_g32 layer, plus, where its rows
        read back out of torch's CPU int4 layout, the near-max logits recomputed exactly
        (`_exact_top`, with the scales the layer holds: see from_quantized)."""
        self = cls.from_quantized("int8_g32", qw, keep_scales=keep_scales)
        self.exact_top = self.rows_readable(qw.q)
        return self

    def to_cpu_kernels(self, table: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
        """Backend cpu (engine/kernels/cpu.c; `to_cpu_kernels` below): an int8_g32 layer runs
        cpu.c's int8 matmul with a scale per 32 values, from plain int8 codes [N, K] and
        float32 scales [N, K/32] (`table`: the tied embedding's, shared), in place of torch's
        int4 layout (the nibble split) and its bfloat16 scale pairs. Its logits are float32
        from the stored codes, so a head needs no `_exact_top`; one path for every M."""
        if self.method != "int8_g32" or not self.on_cpu or self.in_features % 32 or self.cpu_g32:
            return
        if table is None:
            qw = self.quantized()
            table = (qw.q.contiguous(), qw.scale.float().contiguous())
        for name in ("qweight", "scale", "scales_and_zeros", "group_scales"):
            self._buffers.pop(name, None)
        self.register_buffer("qweight", table[0])
        self.register_buffer("scale", table[1])
        self.cpu_g32, self.cpu_int4, self.group_major, self.exact_top = True, False, False, False

    def rows_readable(self, q: torch.Tensor) -> bool:
        """Whether `_int4pack_rows` reads this layer's codes `q` back: an int8_g32 layer in
        torch's CPU int4 layout with a multiple of 64 rows, checked on three of them."""
        n = self.out_features
        if not (self.cpu_int4 and self.method == "int8_g32" and n % 64 == 0 and int4pack_block()):
            return False
        probe = torch.tensor([0, 33, n - 1])
        return torch.equal(_int4pack_rows(self.qweight, probe, self.in_features), q[probe])

    def _exact_top(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """Logits from torch's bf16 kernel carry bfloat16 roundings (of x, and of each output:
        up to 2^-8 of its size), enough to swap two near-tied tokens (SmolLM2's answer to
        "What is the capital of France?" starts with 25.232 against 25.226, one bfloat16 value
        apart). Every column within 2^-5 of a row's largest magnitude of that row's maximum is
        recomputed in float32 from the stored codes and scales (a few rows of the table), so
        the argmax and the top logprobs are those of the dequantized table."""
        top = y.amax(-1, keepdim=True)
        near = (y >= top - 2 ** -5 * y.abs().amax(-1, keepdim=True)).any(0)
        cols = near.nonzero().flatten()
        if cols.numel() > EXACT_TOP_MAX:
            cols = cols[y.amax(0)[cols].topk(EXACT_TOP_MAX).indices]
        k, g = self.in_features, self.group
        q = _int4pack_rows(self.qweight, cols, k).view(-1, k // g, g).float()
        scale = getattr(self, "scale", None)        # else the kernel's: the lo groups' scales
        scale = self.scales_and_zeros[k // g:, cols, 0].T if scale is None else scale[cols]
        w = (q * scale.float()[..., None]).view(-1, k)
        y[:, cols] = x.float() @ w.T
        return y

    def _int4pack(self, codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> None:
        self.register_buffer("qweight", torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 1))
        sz = torch.stack((scale.T, zero.T), dim=-1).contiguous()
        self.register_buffer("scales_and_zeros", sz.bfloat16())        # [K'/g, N, 2]

    def extra_repr(self) -> str:
        return f"{self.method}, in={self.in_features}, out={self.out_features}"

    def quantized(self) -> QuantWeight:
        """The codes and scales this layer holds, in the quantize.py layout (read back exactly
        from the CPU kernel's packed layout)."""
        n, k = self.out_features, self.in_features
        if self.method.startswith("fp8"):
            return Fp8Weight(self.qweight, self.scale)
        if self.method == "int8":
            return Int8Weight(self.qweight, self.scale.float())
        if self.cpu_g32:
            return Int8Weight(self.qweight, self.scale.half(), self.group)
        if self.group_major:
            return Int8Weight(self.qweight.transpose(0, 1).reshape(n, k), self.scale, self.group)
        if not self.cpu_int4:
            if self.method == "int8_g32":
                return Int8Weight(_nibble_join(unpack_int4(self.qweight)), self.scale, self.group)
            return Int4Weight(self.qweight, self.scale, self.min, self.group)
        sz = self.scales_and_zeros.float()
        if self.method == "int8_g32":
            scale = getattr(self, "scale", None)
            if scale is None:           # the lo groups' scales
                scale = sz[k // self.group:, :, 0].T.half()
            return Int8Weight(_nibble_join(_int4pack_codes(self.qweight, n, 2 * k)), scale, self.group)
        scale, mn = getattr(self, "scale", None), getattr(self, "min", None)
        if scale is None:
            scale, mn = sz[..., 0].T, sz[..., 1].T - 8 * sz[..., 0].T
        return Int4Weight(pack_int4(_int4pack_codes(self.qweight, n, k)), scale, mn, self.group)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The [N, K] weight this layer multiplies by."""
        return dequantize(self.quantized()).to(dtype)

    @property
    def input_dtype(self) -> torch.dtype | None:
        """bfloat16 where torch's CPU int8 / int4 kernels run this layer: they multiply in it
        and return it, so a caller that writes its output in bfloat16 saves two casts (the C
        kernels do). None: the activations' own dtype."""
        if self.on_cpu and not self.exact_top and (
                (self.method == "int8" and self.in_features % 16 == 0) or self.cpu_int4):
            return torch.bfloat16
        return None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x2 = x if x.dim() == 2 else x.reshape(-1, self.in_features)
        y = self._matmul(x2)
        if self.exact_top:
            y = self._exact_top(x2, y.float())
        if y.dtype != x.dtype:
            y = y.to(x.dtype)
        if self.bias is not None:
            y = y + self.bias
        return y if x.dim() == 2 else y.view(*shape[:-1], self.out_features)

    def _matmul(self, x: torch.Tensor) -> torch.Tensor:
        m = x.shape[0]
        if self.on_cpu:
            if self.cpu_g32:
                return cpu_kernels.int8g32_matmul(x, self.qweight, self.scale)
            if self.group_major:
                xb, g, y = x.bfloat16(), self.group, None
                for i in range(self.qweight.shape[0]):
                    part = torch.ops.aten._weight_int8pack_mm(
                        xb[:, i * g:(i + 1) * g].contiguous(), self.qweight[i], self.group_scales[i])
                    y = part.float() if y is None else y.add_(part)
                return y
            if self.method == "int8":
                if self.backend == "cpu":       # every M: one path for prefill and decode
                    return cpu_kernels.int8_matmul(x.bfloat16(), self.qweight, self.scale)
                if self.in_features % 16 == 0:     # torch's kernel is wrong on other K (2.13)
                    return torch.ops.aten._weight_int8pack_mm(x.bfloat16(), self.qweight, self.scale)
            if self.cpu_int4:
                xb = x.bfloat16()
                if self.method == "int8_g32":
                    xb = torch.cat((xb, xb), dim=1)
                return torch.ops.aten._weight_int4pack_mm_for_cpu(
                    xb, self.qweight, self.group, self.scales_and_zeros)
            return nn.functional.linear(x, self.dequantize(x.dtype))
        from engine.kernels import quant_matmul as qm
        if m <= SMALL_M and not self.group_major:
            if self.method == "int8_g32":
                return qm.int4_matmul(torch.cat((x, x), dim=1), self.qweight, *int8_g32_split_scales(self.scale), 32)
            if self.method.startswith("int4"):
                return qm.int4_matmul(x, self.qweight, self.scale, self.min, self.group)
            return qm.w8_matmul(x, self.qweight, self._channel_scale())
        if self.method.startswith("fp8"):
            return scaled_mm_fp8(x, self.qweight, self.scale, self.method == "fp8")
        return nn.functional.linear(x, self.dequantize(x.dtype))

    def _channel_scale(self) -> torch.Tensor:
        s = self.scale
        return s.expand(self.out_features).contiguous() if s.numel() == 1 and self.out_features > 1 else s


def _nibble_split(q: torch.Tensor) -> torch.Tensor:
    """int8 [N, K] -> codes 0..15 [N, 2K]: (q >> 4) + 8, then q & 15 (q = 16 hi + lo)."""
    q = q.to(torch.int32)
    return torch.cat(((q >> 4) + 8, q & 15), dim=1)


def _nibble_join(c: torch.Tensor) -> torch.Tensor:
    k = c.shape[1] // 2
    return (16 * (c[:, :k] - 8) + c[:, k:]).to(torch.int8)


def int8_g32_split_scales(scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """An int8_g32 layer's float16 scales [N, K/32] -> the int4 kernel's scale and min
    [N, 2K/32] for the nibble split: hi groups 16 s and -128 s, lo groups s and 0 (exact)."""
    return torch.cat((16 * scale, scale), dim=1), torch.cat((-128 * scale, torch.zeros_like(scale)), dim=1)


def _int4pack_codes(packed: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """The [N, K] int32 codes held in torch's CPU int4 layout: the kernel run on the identity
    with scale 1 and zero 8 returns each code (small integers, exact in bfloat16)."""
    sz = torch.tensor([1.0, 8.0], dtype=torch.bfloat16).expand(k // 32, n, 2).contiguous()
    eye = torch.eye(k, dtype=torch.bfloat16)
    return torch.ops.aten._weight_int4pack_mm_for_cpu(eye, packed, 32, sz).T.to(torch.int32)


_INT4PACK_BLOCK: int | None = None


def int4pack_block() -> int:
    """Rows per block of torch's CPU int4 layout on this machine: 64 where its kernel runs
    AVX-512, 32 on AVX2 and the portable path (torch's int4mm_kernel BLOCK_N); probed once
    on a known matrix, 0 when neither reads back (rows are then never read from it)."""
    global _INT4PACK_BLOCK
    if _INT4PACK_BLOCK is None:
        codes = torch.arange(64 * 64, dtype=torch.int32).view(64, 64) * 7 % 16
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 1)
        ids = torch.arange(64)
        _INT4PACK_BLOCK = next((blk for blk in (64, 32) if torch.equal(
            _block_rows(packed, ids, 64, blk), codes)), 0)
    return _INT4PACK_BLOCK


def _block_rows(packed: torch.Tensor, ids: torch.Tensor, width: int, blk: int) -> torch.Tensor:
    """Codes [T, width] of rows `ids` of torch's CPU int4 layout with `blk` rows a block:
    [N/blk, width, blk/2] bytes, byte (b, c, j) holding column c of row blk b + j in its
    low nibble and of row blk b + blk/2 + j in its high one."""
    h = blk // 2
    b = packed.view(-1, width, h)[ids // blk, :, ids % h]                # [T, width]
    return torch.where((ids % blk < h)[:, None], b & 15, b >> 4).int()


def _int4pack_rows(packed: torch.Tensor, ids: torch.Tensor, k: int) -> torch.Tensor:
    """Rows `ids` [T] of an int8_g32 layer held in torch's CPU int4 layout (the nibble split,
    2K columns), as int8 codes [T, K]."""
    return _nibble_join(_block_rows(packed, ids.long(), 2 * k, int4pack_block()))


class QuantEmbedding(nn.Module):
    """nn.Embedding over an int8 table with a scale per row, or per group of a row (int8_g32).
    A grouped table is held in the layout its tied head computes from (QuantLinear.sharing):
    on CPU, torch's int4 kernel layout (the nibble split; lookups read rows out of it), where
    the table has a multiple of 64 rows and the layout reads back as `_int4pack_rows`
    expects; otherwise group-major codes [K/g, V, g]."""

    def __init__(self, qw: Int8Weight, dtype: torch.dtype):
        super().__init__()
        self.dtype, self.group, self.shape = dtype, qw.group, tuple(qw.q.shape)
        self.cpu_packed = self.plain = False
        v, k = self.shape
        if qw.group == 32 and qw.q.device.type == "cpu" and v % 64 == 0:
            lin = QuantLinear.from_quantized("int8_g32", qw)     # stored scales kept
            if lin.rows_readable(qw.q):
                self.cpu_packed = True
                self.register_buffer("qweight", lin.qweight)
                self.register_buffer("scales_and_zeros", lin.scales_and_zeros)
                self.register_buffer("scale", qw.scale)
                return
        if qw.group:
            self.register_buffer("qweight", qw.q.view(v, k // qw.group, qw.group).transpose(0, 1).contiguous())
            self.register_buffer("scale", qw.scale)
        else:
            self.register_buffer("qweight", qw.q)
            self.register_buffer("scale", qw.scale.float())

    def to_plain(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Backend cpu: a grouped (int8_g32) table held as plain codes [V, K] and float32
        scales [V, K/32], the layout cpu.c's matmul reads for its tied head; (codes, scales),
        or None for other tables."""
        if self.group != 32 or self.qweight.device.type != "cpu" or self.shape[1] % 32:
            return None
        if not self.plain:
            qw = self.quantized()
            for name in ("qweight", "scale", "scales_and_zeros"):
                self._buffers.pop(name, None)
            self.register_buffer("qweight", qw.q.contiguous())
            self.register_buffer("scale", qw.scale.float().contiguous())
            self.cpu_packed, self.plain = False, True
        return self.qweight, self.scale

    def quantized(self) -> Int8Weight:
        v, k = self.shape
        if self.plain:
            return Int8Weight(self.qweight, self.scale.half(), self.group)
        if self.cpu_packed:
            return Int8Weight(_int4pack_rows(self.qweight, torch.arange(v), k), self.scale, self.group)
        if self.group:
            return Int8Weight(self.qweight.transpose(0, 1).reshape(v, k), self.scale, self.group)
        return Int8Weight(self.qweight, self.scale)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        s = self.scale[ids].float()
        if self.plain:
            q = self.qweight[ids].view(*ids.shape, -1, self.group).float()   # [..., K/g, g]
            return (q * s[..., None]).flatten(-2).to(self.dtype)
        if self.cpu_packed:
            q = _int4pack_rows(self.qweight, ids.flatten(), self.shape[1])
            q = q.view(*ids.shape, -1, self.group).float()              # [..., K/g, g]
            return (q * s[..., None]).flatten(-2).to(self.dtype)
        if self.group:
            q = self.qweight[:, ids].movedim(0, -2).float()            # [..., K/g, g]
            return (q * s[..., None]).flatten(-2).to(self.dtype)
        return (self.qweight[ids].float() * s[..., None]).to(self.dtype)


def scaled_mm_fp8(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, rowwise: bool) -> torch.Tensor:
    """x @ (q * scale).T through torch._scaled_mm, x quantized to e4m3 on the fly (per row when
    the weight has per-channel scales, per tensor otherwise)."""
    xf = x.float()
    if rowwise:
        sx = xf.abs().amax(dim=1, keepdim=True).clamp(min=1e-12) / FP8_MAX      # [M, 1]
        sw = scale.view(1, -1)                                                 # [1, N]
    else:
        sx = xf.abs().amax().clamp(min=1e-12) / FP8_MAX
        sw = scale.reshape(())
    xq = (xf / sx).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    out_dtype = x.dtype if x.dtype != torch.float32 else torch.bfloat16
    return torch._scaled_mm(xq, q.t(), scale_a=sx, scale_b=sw, out_dtype=out_dtype)


class QuantExperts(nn.Module):
    """The experts of an MoE block (engine/moe.py Experts: gate_up_proj [E, 2I, H], down_proj
    [E, H, I]) held as one QuantLinear per expert and projection. Computed by the loop
    engine/kernels/reference.py's `fused_moe` runs for the float ones (`moe_by_expert`: one
    expert at a time, its tokens gathered, scaled by the routing weight, summed in fp32).
    Each QuantLinear runs its own kernel (the table at the top); on CUDA that is the same loop,
    no fused kernel over the experts yet, and its `nonzero` waits on the device (no decode
    graphs: runner.py)."""

    def __init__(self, method: str, gate_up: torch.Tensor, down: torch.Tensor):
        super().__init__()
        self.gate_up = nn.ModuleList(QuantLinear.from_float(method, w) for w in gate_up)
        self.down = nn.ModuleList(QuantLinear.from_float(method, w) for w in down)

    def forward(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                backend: str = "auto") -> torch.Tensor:
        def expert(e: int, xs: torch.Tensor) -> torch.Tensor:
            return self.down[e](silu_and_mul(self.gate_up[e](xs), backend=backend))
        return moe_by_expert(x, topk_weights, topk_ids, len(self.gate_up), expert)


_LINEARS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")


def quantize_model(model: nn.Module, method: str) -> nn.Module:
    """Replace every decoder linear layer of a loaded CausalLM that is still nn.Linear by a
    QuantLinear of `method`, in place; the float weights are dropped. The output head and the
    embedding table become HEAD (int8_g32) under every method (SmolLM2-135M: an fp8 head and
    embedding cost +3.0% perplexity; llama.cpp keeps its output in 8 bits too), one table shared
    with a tied head (a lookup dequantizes the rows it reads), unless the checkpoint already
    held them quantized. An MoE block's experts become a QuantExperts and its shared expert's
    linears QuantLinears; its router and shared-expert gate (tiny, and they decide the routing)
    stay float, as do the norms. 'none' and 'auto' (the loader has already installed what the
    checkpoint holds quantized; an MoE checkpoint's experts are dequantized) leave the model as
    is."""
    if check_method(method) in ("none", "auto"):
        return model
    if HEAD is not None and model.lm_head is not None and not isinstance(model.lm_head, QuantLinear):
        w = model.lm_head.weight.data
        model.lm_head = (QuantLinear.head(quantize_int8(w, 32), keep_scales=False) if HEAD == "int8_g32"
                         else QuantLinear.from_float(HEAD, w))
    if HEAD is not None and not isinstance(model.embed_tokens, QuantEmbedding):
        emb = model.embed_tokens.weight.data
        q8 = quantize_int8(emb, 32 if HEAD == "int8_g32" else 0)
        model.embed_tokens = QuantEmbedding(q8, emb.dtype)
        if model.lm_head is None:   # tied: one int8 table for lookups and logits
            model.lm_head = (QuantLinear.sharing(model.embed_tokens) if q8.group
                             else QuantLinear.from_quantized(HEAD, q8))
    for layer in model.layers:
        experts = getattr(layer.mlp, "experts", None)
        if experts is not None and not isinstance(experts, QuantExperts):
            layer.mlp.experts = QuantExperts(method, experts.gate_up_proj.data, experts.down_proj.data)
        for parent in (layer.self_attn, layer.mlp, getattr(layer.mlp, "shared_expert", None)):
            for name in _LINEARS:
                lin = getattr(parent, name, None)
                if isinstance(lin, nn.Linear):
                    setattr(parent, name, QuantLinear.from_float(
                        method, lin.weight.data, None if lin.bias is None else lin.bias.data))
    return model


def to_cpu_kernels(model: nn.Module) -> None:
    """A CPU model settled on backend cpu (CausalLM.bind_kv_cache): its int8_g32 table and
    layers (GGUF Q8_0, the 8-bit head of every method) move to cpu.c's layout, a tied head
    keeping the embedding's one copy (QuantLinear.to_cpu_kernels)."""
    emb, table, shared = model.embed_tokens, None, None
    if isinstance(emb, QuantEmbedding):
        shared = emb.qweight.data_ptr()
        table = emb.to_plain()
    for m in model.modules():
        if isinstance(m, QuantLinear):
            m.to_cpu_kernels(table if table is not None and m.qweight.data_ptr() == shared else None)


def weight_bytes(model: nn.Module) -> int:
    """Bytes of a model's weights as held (parameters and persistent buffers, each once)."""
    seen, total = set(), 0
    for t in model.state_dict().values():
        if t.data_ptr() not in seen:
            seen.add(t.data_ptr())
            total += t.nbytes
    return total
