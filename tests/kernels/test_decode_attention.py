"""Paged decode attention (Triton, split-K) against the torch reference."""

import pytest
import torch

from engine.kernels import reference
from engine.kernels.decode_attention import paged_decode_attention
from kernel_testlib import DEVICE, assert_close, fresh_generator, on_device, paged_cache, poisoned, randn


def _run(context_lens, hq, hkv, d, block_size, dtype, partition, max_context_len=None):
    gen, seed = fresh_generator()
    k_cache, v_cache, table = paged_cache(gen, context_lens, block_size, hkv, d, dtype)
    q = randn(gen, len(context_lens), hq, d, dtype=dtype)
    ctx = torch.tensor(context_lens, dtype=torch.int32)
    scale = d ** -0.5
    out = poisoned(q).to(DEVICE)
    got = paged_decode_attention(*on_device(q, k_cache, v_cache, table, ctx), scale, out=out,
                                 partition_size=partition, max_context_len=max_context_len)
    assert got is out
    want = reference.paged_decode_attention(q, k_cache, v_cache, table, ctx, scale)
    assert_close(got, want, dtype, seed, f"decode ctx={context_lens} hq={hq} hkv={hkv}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("gqa", [1, 2, 4])
def test_ragged_split_k(dtype, gqa):
    # partition 32: 32 and 64 sit exactly on a boundary, 33 and 65 one past; 1 and 7 are
    # shorter than a block; block_size 16 does not divide 7, 33, 45
    _run([33, 1, 32, 65, 7, 45, 64], hq=2 * gqa, hkv=2, d=32, block_size=16, dtype=dtype,
         partition=32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_single_partition_path(dtype):
    # max_context_len <= partition: one program per (seq, kv head) writes out directly
    _run([5, 16, 17, 3], hq=8, hkv=2, d=64, block_size=8, dtype=dtype, partition=32,
         max_context_len=32)


@pytest.mark.parametrize("batch_ctx", [[700, 3, 257], [130]])
def test_auto_partition(batch_ctx):
    # partition_size None: sized from batch, KV heads and max_context_len (split-K fills the
    # machine at small batches); the bucket (max_context_len) is longer than every context
    _run(batch_ctx, hq=4, hkv=2, d=32, block_size=16, dtype=torch.float32, partition=None,
         max_context_len=1024)


def test_auto_partition_sizes():
    from engine.kernels.decode_attention import auto_partition
    assert auto_partition(1, 8, 8192, 132) == 128          # 64 splits x 8 heads = 512 programs
    assert auto_partition(64, 8, 8192, 132) == 512         # big batches keep long partitions
    assert auto_partition(1, 8, 100, 132) == 64            # never below the minimum


def test_odd_head_dim_and_default_max_len():
    # head_dim 48 (masked to 64), block_size 4, default max_context_len from the table width
    _run([9, 23, 2], hq=3, hkv=1, d=48, block_size=4, dtype=torch.float32, partition=16)


def test_padding_sequence_gets_zeros():
    gen, seed = fresh_generator()
    k_cache, v_cache, table = paged_cache(gen, [20, 1], 16, 1, 32, torch.float32)
    q = randn(gen, 2, 2, 32)
    ctx = torch.tensor([20, 0], dtype=torch.int32)
    out = paged_decode_attention(*on_device(q, k_cache, v_cache, table, ctx), 0.2,
                                 out=poisoned(q).to(DEVICE), partition_size=16).cpu()
    want = reference.paged_decode_attention(q, k_cache, v_cache, table, ctx, 0.2)
    assert_close(out, want, torch.float32, seed, "ctx 0 row")
    assert torch.all(out[1] == 0)


def test_bad_arguments_raise():
    q, kc, table, ctx = on_device(torch.randn(2, 4, 32), torch.randn(4, 16, 2, 32),
                                  torch.zeros(2, 2, dtype=torch.int32), torch.ones(2, dtype=torch.int32))
    with pytest.raises(ValueError, match="block_tables"):
        paged_decode_attention(q, kc, kc.clone(), table.long(), ctx, 1.0)
    with pytest.raises(ValueError, match="multiple of KV heads"):
        paged_decode_attention(q[:, :3], kc, kc.clone(), table, ctx, 1.0)
    with pytest.raises(ValueError, match="dtype"):
        paged_decode_attention(q, kc.half(), kc.half(), table, ctx, 1.0)
    with pytest.raises(ValueError, match="partition_size"):
        paged_decode_attention(q, kc, kc.clone(), table, ctx, 1.0, partition_size=48)


def test_int32_overflow_offsets():
    """A pool of > 2^31 elements per cache with the sequence's blocks near its end: block_id *
    block_stride only fits in int64. torch.empty is lazily committed, so only the written
    blocks become resident (~ a few MB)."""
    gen, seed = fresh_generator()
    bs, hkv, d = 16, 2, 64
    per_block = bs * hkv * d
    nb = (2 ** 31) // per_block + 64
    k_cache = torch.empty(nb, bs, hkv, d, dtype=torch.bfloat16, device=DEVICE)
    v_cache = torch.empty(nb, bs, hkv, d, dtype=torch.bfloat16, device=DEVICE)
    assert k_cache.numel() > 2 ** 31
    lens = [40, 17]
    blocks = [[nb - 1, nb - 7, nb - 3], [nb - 30, nb - 2, nb - 2]]   # row 2 uses 2 blocks
    table = torch.tensor(blocks, dtype=torch.int32)
    for row in blocks:
        for blk in row:
            k_cache[blk] = randn(gen, bs, hkv, d, dtype=torch.bfloat16)
            v_cache[blk] = randn(gen, bs, hkv, d, dtype=torch.bfloat16)
    q = randn(gen, 2, 4, d, dtype=torch.bfloat16)
    ctx = torch.tensor(lens, dtype=torch.int32)
    got = paged_decode_attention(*on_device(q), k_cache, v_cache, *on_device(table, ctx), d ** -0.5,
                                 out=poisoned(q).to(DEVICE), partition_size=32)
    # the reference reads the same blocks through a small CPU copy of the used ones
    used = sorted({blk for row in blocks for blk in row})
    remap = {blk: i for i, blk in enumerate(used)}
    small_table = torch.tensor([[remap[x] for x in row] for row in blocks], dtype=torch.int32)
    want = reference.paged_decode_attention(q, k_cache[used].cpu(), v_cache[used].cpu(), small_table,
                                            ctx, d ** -0.5)
    assert_close(got, want, torch.bfloat16, seed, "int64 offsets")
