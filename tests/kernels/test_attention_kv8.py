"""Triton paged decode and prefill attention over an 8-bit KV cache (fp8_e4m3 and int8 codes
with per-(block, KV head) scales) against the torch reference reading the same cache."""
import pytest
import torch

from engine.kernels import reference
from engine.kernels.decode_attention import paged_decode_attention
from engine.kernels.prefill_attention import paged_prefill_attention
from kernel_testlib import DEVICE, assert_close, fresh_generator, on_device, paged_cache, poisoned, randn

KV8 = [torch.float8_e4m3fn, torch.int8]


def _quantized_cache(gen, context_lens, block_size, hkv, d, kv_dtype):
    """paged_cache's random float caches quantized by the reference's own write: every slot
    of the pool written in one call (each block fresh, its scale its amax / QMAX), heads
    given spread-out magnitudes so that the scales differ per (block, head)."""
    k, v, table = paged_cache(gen, context_lens, block_size, hkv, d, torch.float32)
    nb = k.shape[0]
    spread = torch.rand(nb, 1, hkv, 1, generator=gen) * 4 + 0.1
    k, v = k * spread, v * spread.flip(2)
    kc = torch.empty(k.shape, dtype=kv_dtype)
    vc = torch.empty(v.shape, dtype=kv_dtype)
    ks, vs = torch.zeros(nb, hkv), torch.zeros(nb, hkv)
    slots = torch.arange(nb * block_size)
    reference.write_kv_cache_quant(k.flatten(0, 1), v.flatten(0, 1), kc, vc, ks, vs, slots)
    assert bool((ks > 0).all()) and bool((vs > 0).all())
    return kc, vc, ks, vs, table


def _decode(context_lens, hq, hkv, d, block_size, dtype, kv_dtype, partition, max_context_len=None):
    gen, seed = fresh_generator()
    kc, vc, ks, vs, table = _quantized_cache(gen, context_lens, block_size, hkv, d, kv_dtype)
    q = randn(gen, len(context_lens), hq, d, dtype=dtype)
    ctx = torch.tensor(context_lens, dtype=torch.int32)
    scale = d ** -0.5
    out = poisoned(q).to(DEVICE)
    got = paged_decode_attention(*on_device(q, kc, vc, table, ctx), scale, out=out,
                                 partition_size=partition, max_context_len=max_context_len,
                                 k_scales=ks.to(DEVICE), v_scales=vs.to(DEVICE))
    assert got is out
    want = reference.paged_decode_attention(q, kc, vc, table, ctx, scale, ks, vs)
    assert_close(got, want, dtype, seed, f"decode {kv_dtype} ctx={context_lens} hq={hq} hkv={hkv}")


def _prefill(q_lens, context_lens, hq, hkv, d, block_size, dtype, kv_dtype):
    gen, seed = fresh_generator()
    kc, vc, ks, vs, table = _quantized_cache(gen, context_lens, block_size, hkv, d, kv_dtype)
    cu = torch.tensor([0] + q_lens, dtype=torch.int32).cumsum(0, dtype=torch.int32)
    q = randn(gen, int(cu[-1]), hq, d, dtype=dtype)
    ctx = torch.tensor(context_lens, dtype=torch.int32)
    scale = d ** -0.5
    out = poisoned(q).to(DEVICE)
    got = paged_prefill_attention(*on_device(q, kc, vc, table, cu, ctx), scale, out=out,
                                  k_scales=ks.to(DEVICE), v_scales=vs.to(DEVICE))
    assert got is out
    want = reference.paged_prefill_attention(q, kc, vc, table, cu, ctx, scale, ks, vs)
    assert_close(got, want, dtype, seed,
                 f"prefill {kv_dtype} q_lens={q_lens} ctx={context_lens} hq={hq} hkv={hkv}")


@pytest.mark.parametrize("kv_dtype", KV8)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("gqa", [1, 4])
def test_decode_ragged_split_k(kv_dtype, dtype, gqa):
    # partition 32 over block_size 16: boundaries at 32/64, one past at 33/65, contexts
    # shorter than a block (1, 7), lengths the block size does not divide (33, 45)
    _decode([33, 1, 32, 65, 7, 45], hq=2 * gqa, hkv=2, d=32, block_size=16, dtype=dtype,
            kv_dtype=kv_dtype, partition=32)


@pytest.mark.parametrize("kv_dtype", KV8)
def test_decode_single_partition_odd_head_dim(kv_dtype):
    # one partition (out written directly); head_dim 48 masked to 64; G = 3
    _decode([5, 16, 17, 3], hq=6, hkv=2, d=48, block_size=8, dtype=torch.float32,
            kv_dtype=kv_dtype, partition=32, max_context_len=32)


@pytest.mark.parametrize("kv_dtype", KV8)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("gqa", [1, 2])
def test_prefill_ragged_chunks_with_prefix(kv_dtype, dtype, gqa):
    # seq 0: whole prompt; seq 1: a chunk after a 50-token cached prefix (prefix hit or an
    # earlier chunk: the same case); seq 2: one row; seq 3: empty chunk; seq 4: crosses tiles
    _prefill([37, 20, 1, 0, 70], [37, 70, 9, 5, 101], hq=2 * gqa, hkv=2, d=32, block_size=16,
             dtype=dtype, kv_dtype=kv_dtype)


@pytest.mark.parametrize("kv_dtype", KV8)
def test_prefill_gqa_three_odd_head_dim(kv_dtype):
    _prefill([45, 8], [45, 30], hq=6, hkv=2, d=40, block_size=8, dtype=torch.float32,
             kv_dtype=kv_dtype)


def test_scales_checked():
    q, kc, table, ctx = on_device(torch.randn(2, 4, 32), torch.zeros(4, 16, 2, 32, dtype=torch.int8),
                                  torch.zeros(2, 2, dtype=torch.int32), torch.ones(2, dtype=torch.int32))
    ks = torch.ones(4, 2, device=DEVICE)
    with pytest.raises(ValueError, match="dtype"):                 # 8-bit cache without scales
        paged_decode_attention(q, kc, kc.clone(), table, ctx, 1.0)
    with pytest.raises(ValueError, match="come together"):
        paged_decode_attention(q, kc, kc.clone(), table, ctx, 1.0, k_scales=ks)
    with pytest.raises(ValueError, match="k_scales has shape"):
        paged_decode_attention(q, kc, kc.clone(), table, ctx, 1.0, k_scales=ks[:3], v_scales=ks)
    with pytest.raises(ValueError, match="dtype"):                 # scales with a float cache
        paged_decode_attention(q, kc.float(), kc.float(), table, ctx, 1.0, k_scales=ks, v_scales=ks)
