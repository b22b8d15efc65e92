"""Paged MLA decode attention, the Triton kernel (mla_decode.py, under TRITON_INTERPRET=1 on
CPU) and cpu.c's kernel, against the torch reference (reference.py).

The cache is one latent row per token shared by every head; block tables are random
permutations of the pool (kernel_testlib.paged_cache), context lengths mostly not multiples
of the block size, and the head counts both below and past one program's head group."""
import pytest
import torch

from engine.kernels import cpu as C
from engine.kernels.mla_decode import paged_mla_decode_attention
from engine.kernels.reference import paged_mla_decode_attention as reference
from kernel_testlib import DEVICE, assert_close, fresh_generator, on_device, paged_cache, randn


def _inputs(gen, context_lens, h, d, block_size, dtype):
    k_cache, _, table = paged_cache(gen, context_lens, block_size, 1, d, dtype)
    kv_cache = k_cache.view(k_cache.shape[0], block_size, d)      # one row per token, no heads
    q = randn(gen, len(context_lens), h, d, dtype=dtype)
    return q, kv_cache, table, torch.tensor(context_lens, dtype=torch.int32)


def _run(context_lens, h, d, v_dim, block_size, dtype, partition, max_context_len=None):
    gen, seed = fresh_generator()
    q, kv_cache, table, ctx = _inputs(gen, context_lens, h, d, block_size, dtype)
    scale = d ** -0.5
    out = torch.full((len(context_lens), h, v_dim), float("nan"), dtype=dtype, device=DEVICE)
    got = paged_mla_decode_attention(*on_device(q, kv_cache, table, ctx), scale, v_dim, out=out,
                                     partition_size=partition, max_context_len=max_context_len)
    assert got is out
    want = reference(q, kv_cache, table, ctx, scale, v_dim)
    assert want.shape == (len(context_lens), h, v_dim) and want.dtype == dtype
    assert_close(got, want, dtype, seed, f"mla ctx={context_lens} h={h} d={d} v={v_dim}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("context_lens, h", [
    ([33, 1, 32, 65, 7, 45], 16),    # 32, 64 on a partition boundary, 33, 65 one past
    ([50], 5),                       # batch 1, fewer heads than one program's group (masked)
    ([19, 64, 3], 20),               # two head groups, the second partial
])
def test_triton_split_k(dtype, context_lens, h):
    # D = 32 + 16 (latent + rotary), block_size 16, partitions of 32 keys
    _run(context_lens, h, d=48, v_dim=32, block_size=16, dtype=dtype, partition=32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_single_partition(dtype):
    # max_context_len <= partition: one program per (request, head group) writes out directly
    _run([5, 16, 17, 3], h=8, d=48, v_dim=32, block_size=8, dtype=dtype, partition=32,
         max_context_len=32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_deepseek_v3_width(dtype):
    # DeepSeek-V3's row: kv_lora_rank 512 + qk_rope_head_dim 64
    _run([37, 70], h=16, d=576, v_dim=512, block_size=16, dtype=dtype, partition=32)


def test_triton_auto_partition_and_odd_widths():
    # partition None (auto_partition over the head groups); a bucket longer than any context;
    # latent 24 and rotary 8 are no powers of two (masked to 32 and 16); block_size 4
    _run([130, 9], h=4, d=32, v_dim=24, block_size=4, dtype=torch.float32, partition=None,
         max_context_len=512)


def test_triton_padding_request_gets_zeros():
    gen, seed = fresh_generator()
    q, kv_cache, table, ctx = _inputs(gen, [20, 1], 2, 48, 16, torch.float32)
    ctx[1] = 0
    for partition in (16, 64):                     # split and single-partition paths
        got = paged_mla_decode_attention(*on_device(q, kv_cache, table, ctx), 0.2, 32,
                                         partition_size=partition, max_context_len=32).cpu()
        assert_close(got, reference(q, kv_cache, table, ctx, 0.2, 32), torch.float32, seed, "ctx 0")
        assert torch.all(got[1] == 0)


def test_triton_bad_arguments_raise():
    q, kv, table, ctx = on_device(torch.randn(2, 4, 48), torch.randn(4, 16, 48),
                                  torch.zeros(2, 2, dtype=torch.int32), torch.ones(2, dtype=torch.int32))
    with pytest.raises(ValueError, match="block_tables"):
        paged_mla_decode_attention(q, kv, table.long(), ctx, 1.0, 32)
    with pytest.raises(ValueError, match="kv_cache row width"):
        paged_mla_decode_attention(q, kv[..., :40], table, ctx, 1.0, 32)
    with pytest.raises(ValueError, match="kv_cache.*dims"):
        paged_mla_decode_attention(q, kv.view(4, 16, 1, 48), table, ctx, 1.0, 32)
    with pytest.raises(ValueError, match="v_dim"):
        paged_mla_decode_attention(q, kv, table, ctx, 1.0, 49)
    with pytest.raises(ValueError, match="kv_cache has dtype"):
        paged_mla_decode_attention(q, kv.bfloat16(), table, ctx, 1.0, 32)
    with pytest.raises(ValueError, match="context_lens"):
        paged_mla_decode_attention(q, kv, table, ctx[:1], 1.0, 32)
    with pytest.raises(ValueError, match="partition_size"):
        paged_mla_decode_attention(q, kv, table, ctx, 1.0, 32, partition_size=48)


def test_triton_int32_overflow_offsets():
    """A pool of > 2^31 elements with the requests' blocks near its end: block_id * row
    stride only fits in int64. torch.empty is lazily committed, so only the written blocks
    become resident (a few hundred KB)."""
    gen, seed = fresh_generator()
    bs, d, v_dim = 16, 48, 32
    nb = (2 ** 31) // (bs * d) + 64
    kv_cache = torch.empty(nb, bs, d, dtype=torch.bfloat16, device=DEVICE)
    assert kv_cache.numel() > 2 ** 31
    blocks = [[nb - 1, nb - 7, nb - 3], [nb - 30, nb - 2, nb - 2]]   # row 2 uses 2 blocks
    for blk in {x for row in blocks for x in row}:
        kv_cache[blk] = randn(gen, bs, d, dtype=torch.bfloat16)
    table = torch.tensor(blocks, dtype=torch.int32)
    ctx = torch.tensor([40, 17], dtype=torch.int32)
    q = randn(gen, 2, 16, d, dtype=torch.bfloat16)
    got = paged_mla_decode_attention(*on_device(q), kv_cache, *on_device(table, ctx), d ** -0.5,
                                     v_dim, partition_size=32)
    used = sorted({x for row in blocks for x in row})
    remap = {x: i for i, x in enumerate(used)}
    small = torch.tensor([[remap[x] for x in row] for row in blocks], dtype=torch.int32)
    want = reference(q, kv_cache[used].cpu(), small, ctx, d ** -0.5, v_dim)
    assert_close(got, want, torch.bfloat16, seed, "int64 offsets")


needs_c = pytest.mark.skipif(C.library() is None, reason="no C compiler: the CPU kernels are not built")


@needs_c
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("context_lens, h, d, v_dim, block_size", [
    ([33, 1, 32, 200, 7, 0], 16, 48, 32, 16),   # ragged, a padding request (zeros)
    ([130], 6, 40, 24, 8),     # batch 1; 4 heads at a time + 2; widths no multiples of 16 (tails)
    ([70, 129], 16, 576, 512, 16),              # DeepSeek-V3's row; 129 crosses two C tiles
])
def test_cpu_matches_reference(out_dtype, context_lens, h, d, v_dim, block_size):
    gen, seed = fresh_generator()
    q, kv_cache, table, ctx = _inputs(gen, context_lens, h, d, block_size, torch.float32)
    want = reference(q, kv_cache, table, ctx, d ** -0.5, v_dim)
    got = C.mla_decode_attention(q, kv_cache, table, ctx, d ** -0.5, v_dim, out_dtype)
    assert got.dtype == out_dtype and got.shape == want.shape
    assert_close(got, want.to(out_dtype), out_dtype, seed, f"cpu mla ctx={context_lens}")
    if 0 in context_lens:
        assert torch.all(got[context_lens.index(0)] == 0)


@needs_c
def test_cpu_large_scores_stay_finite():
    # scores of +-hundreds: the running max must be subtracted before exp (as in the reference)
    gen, seed = fresh_generator()
    q, kv_cache, table, ctx = _inputs(gen, [150, 40], 4, 48, 16, torch.float32)
    q *= 30.0
    want = reference(q, kv_cache, table, ctx, 1.0, 32)
    got = C.mla_decode_attention(q, kv_cache, table, ctx, 1.0, 32)
    assert torch.isfinite(got).all()
    assert_close(got, want, torch.float32, seed, "cpu mla, large scores")


@needs_c
def test_cpu_bad_arguments_raise():
    q, kv = torch.randn(2, 4, 48), torch.randn(4, 16, 48)
    table, ctx = torch.zeros(2, 2, dtype=torch.int32), torch.full((2,), 20, dtype=torch.int32)
    with pytest.raises(ValueError, match="q: a contiguous float32"):
        C.mla_decode_attention(q.bfloat16(), kv, table, ctx, 1.0, 32)
    with pytest.raises(ValueError, match="kv_cache"):
        C.mla_decode_attention(q, kv[..., :40], table, ctx, 1.0, 32)
    with pytest.raises(ValueError, match="v_dim"):
        C.mla_decode_attention(q, kv, table, ctx, 1.0, 0)
    with pytest.raises(ValueError, match="int32"):
        C.mla_decode_attention(q, kv, table.long(), ctx, 1.0, 32)
    with pytest.raises(ValueError, match="block_tables entry"):           # block 4 of 4
        C.mla_decode_attention(q, kv, torch.tensor([[0, 4], [1, 2]], dtype=torch.int32), ctx, 1.0, 32)
    with pytest.raises(ValueError, match="context_lens"):                  # 40 > 2 blocks of 16
        C.mla_decode_attention(q, kv, table, torch.tensor([40, 1], dtype=torch.int32), 1.0, 32)
