"""Weight layouts the quantized matmuls read, and their exact inverses (torch only).

  nibbles     [N, K] codes 0..15 <-> [N, K/2] uint8, even k in the low nibble (the Triton
              int4 kernel's layout, and engine.quant's stored one)
  nibble split of int8 codes: q = 16 hi + lo, hi = q >> 4 in [-8, 7], lo = q & 15, so an int8
              weight with a scale per 32 values (GGUF Q8_0) runs on an int4 kernel:
              x @ W.T = [x, x] @ [hi part | lo part].T
  q4 runs     [N, K/2] bytes in runs of 32 values, value j low and j + 16 high in byte j of
              its run (GGUF's Q4 order): cpu_int4.c's layout (`to_q4_runs`, `from_q4_runs`)
  int4pack    torch's CPU int4 kernel (aten._weight_int4pack_mm_for_cpu) takes its own packed
              layout (`to_int4pack`) and bfloat16 (scale, zero) pairs [K/g, N, 2] and computes
              (code - 8) * scale + zero; the codes are read back through the kernel itself
              (`int4pack_codes`) or, for a few rows, from the bytes (`int4pack_rows`: the block
              size is the kernel's ISA's, `int4pack_block`)
"""
from __future__ import annotations

import torch


def pack_int4(codes: torch.Tensor) -> torch.Tensor:
    """[N, K] codes 0..15 -> [N, K/2] uint8, even k in the low nibble."""
    c = codes.to(torch.uint8)
    return c[:, 0::2] | (c[:, 1::2] << 4)


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """[N, K/2] uint8 -> [N, K] int32 codes."""
    lo, hi = packed & 0xF, packed >> 4
    return torch.stack((lo, hi), dim=-1).flatten(1).to(torch.int32)


def nibble_split(q: torch.Tensor) -> torch.Tensor:
    """int8 [N, K] -> codes 0..15 [N, 2K]: (q >> 4) + 8, then q & 15 (q = 16 hi + lo)."""
    q = q.to(torch.int32)
    return torch.cat(((q >> 4) + 8, q & 15), dim=1)


def nibble_join(c: torch.Tensor) -> torch.Tensor:
    """The inverse of nibble_split: codes [N, 2K] -> int8 [N, K]."""
    k = c.shape[1] // 2
    return (16 * (c[:, :k] - 8) + c[:, k:]).to(torch.int8)


def split_scales(scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Scales [N, K/32] of int8 codes -> the int4 kernel's scale and min [N, 2K/32] for the
    nibble split (w = code * scale + min): hi groups 16 s and -128 s, lo groups s and 0 (exact)."""
    return torch.cat((16 * scale, scale), dim=1), torch.cat((-128 * scale, torch.zeros_like(scale)), dim=1)


def to_int4pack(codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """Codes [N, K] 0..15 with the kernel's scale and zero [N, K/g] -> (packed weight,
    bfloat16 scales_and_zeros [K/g, N, 2]) for aten._weight_int4pack_mm_for_cpu."""
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 1)
    return packed, torch.stack((scale.T, zero.T), dim=-1).contiguous().bfloat16()


def int4pack_codes(packed: torch.Tensor, n: int, k: int) -> torch.Tensor:
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


def int4pack_all_codes(packed: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """Every code [N, K] (uint8, 0..15) held in torch's CPU int4 layout, by reshapes (no
    gather, no matmul; N a multiple of the block, `int4pack_block()` nonzero)."""
    blk = int4pack_block()
    b = packed.view(n // blk, k, blk // 2)                           # [N/blk, K, blk/2]
    c = torch.cat((b & 15, b >> 4), dim=2)                           # [N/blk, K, blk] codes
    return c.transpose(1, 2).reshape(n, k)


def int4pack_all_rows(packed: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """Every row of nibble-split int8 codes held in torch's CPU int4 layout, as int8 codes
    [N, K]: `int4pack_rows` of all N at once, by reshapes (`int4pack_all_codes`)."""
    c = int4pack_all_codes(packed, n, 2 * k)                         # [N, 2K] codes
    # q = 16 (hi - 8) + lo as a byte: its high nibble (hi - 8) mod 16 = hi ^ 8, its low lo
    return (((c[:, :k] ^ 8) << 4) | c[:, k:]).view(torch.int8)


def to_q4_runs(codes: torch.Tensor) -> torch.Tensor:
    """[N, K] codes 0..15 -> [N, K/2] uint8 in runs of 32 values: byte j of a run holds value
    j in its low nibble and value j + 16 in its high one (GGUF's Q4 order; cpu_int4.c's)."""
    n, k = codes.shape
    c = codes.to(torch.uint8).view(n, k // 32, 2, 16)
    return (c[:, :, 0] | (c[:, :, 1] << 4)).view(n, k // 2)


def from_q4_runs(runs: torch.Tensor) -> torch.Tensor:
    """The inverse of to_q4_runs: [N, K/2] bytes -> [N, K] int32 codes."""
    n = runs.shape[0]
    b = runs.view(n, -1, 16)
    return torch.stack((b & 15, b >> 4), dim=2).reshape(n, -1).to(torch.int32)


def int4pack_rows(packed: torch.Tensor, ids: torch.Tensor, k: int) -> torch.Tensor:
    """Rows `ids` [T] of nibble-split int8 codes held in torch's CPU int4 layout (2K
    columns), as int8 codes [T, K]."""
    return nibble_join(_block_rows(packed, ids.long(), 2 * k, int4pack_block()))
