"""Paged prefill attention (Triton) against the torch reference."""
import pytest
import torch

from engine.kernels import reference
from engine.kernels.prefill_attention import paged_prefill_attention
from kernel_testlib import DEVICE, assert_close, fresh_generator, on_device, paged_cache, poisoned, randn


def _run(q_lens, context_lens, hq, hkv, d, block_size, dtype, max_q_len=None):
    gen, seed = fresh_generator()
    k_cache, v_cache, table = paged_cache(gen, context_lens, block_size, hkv, d, dtype)
    cu = torch.tensor([0] + q_lens, dtype=torch.int32).cumsum(0, dtype=torch.int32)
    q = randn(gen, int(cu[-1]), hq, d, dtype=dtype)
    ctx = torch.tensor(context_lens, dtype=torch.int32)
    scale = d ** -0.5
    out = poisoned(q).to(DEVICE)
    got = paged_prefill_attention(*on_device(q, k_cache, v_cache, table, cu, ctx), scale, out=out,
                                  max_q_len=max_q_len)
    assert got is out
    want = reference.paged_prefill_attention(q, k_cache, v_cache, table, cu, ctx, scale)
    assert_close(got, want, dtype, seed, f"prefill q_lens={q_lens} ctx={context_lens} hq={hq} hkv={hkv}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("gqa", [1, 2, 4])
def test_ragged_chunks_with_prefix(dtype, gqa):
    # seq 0: whole prompt (no prefix); seq 1: chunk after a 50-token cached prefix;
    # seq 2: one decode-like row; seq 3: empty chunk (skipped); seq 4: chunk crossing tiles
    _run([37, 20, 1, 0, 70], [37, 70, 9, 5, 101], hq=2 * gqa, hkv=2, d=32, block_size=16,
         dtype=dtype)


def test_gqa_not_power_of_two_and_odd_head_dim():
    # G = 3 packs 21 tokens x 3 heads into a 64-row tile; head_dim 40 is masked to 64
    _run([45, 8], [45, 30], hq=6, hkv=2, d=40, block_size=8, dtype=torch.float32, max_q_len=45)


def test_cu_seqlens_shape_checked():
    q, kc, table, cu, ctx = on_device(torch.randn(4, 2, 16), torch.randn(2, 4, 2, 16),
                                      torch.zeros(1, 2, dtype=torch.int32),
                                      torch.tensor([0, 2, 4], dtype=torch.int32),
                                      torch.tensor([4], dtype=torch.int32))
    with pytest.raises(ValueError, match="cu_seqlens_q"):
        paged_prefill_attention(q, kc, kc.clone(), table, cu, ctx, 1.0)


def _dense_causal(q, k, v, scale):
    """One sequence's causal attention over contiguous k/v [L, H_kv, D] with torch SDPA
    (queries are the last q rows): an oracle that never sees the block table."""
    hq, hkv = q.shape[1], k.shape[1]
    qpos = torch.arange(k.shape[0] - q.shape[0], k.shape[0]).unsqueeze(1)
    mask = torch.arange(k.shape[0]).unsqueeze(0) <= qpos
    o = torch.nn.functional.scaled_dot_product_attention(
        q.float().transpose(0, 1), k.float().transpose(0, 1), v.float().transpose(0, 1),
        attn_mask=mask.to(q.device), scale=scale, enable_gqa=hq != hkv)
    return o.transpose(0, 1)


@pytest.mark.parametrize("chunk", [16, 23])
def test_chunked_prefill_equals_one_shot(chunk):
    """A prompt run chunk by chunk (each chunk's K/V written to the paged cache first, then
    attending to every earlier chunk through the block table) gives the same rows as causal
    attention over the whole prompt at once. Odd prompt length, block size 16, GQA 4."""
    gen, seed = fresh_generator()
    L, hq, hkv, d, bs = 77, 8, 2, 32, 16
    k_all, v_all = randn(gen, L, hkv, d), randn(gen, L, hkv, d)
    q_all = randn(gen, L, hq, d)
    k_cache, v_cache, table = paged_cache(gen, [L], bs, hkv, d, torch.float32)
    for p in range(L):                              # the prompt's own K/V, position p
        blk = table[0, p // bs]
        k_cache[blk, p % bs], v_cache[blk, p % bs] = k_all[p], v_all[p]
    want = _dense_causal(q_all, k_all, v_all, d ** -0.5)
    k_cache, v_cache, table = on_device(k_cache, v_cache, table)
    got = torch.empty(L, hq, d, device=DEVICE)
    for s in range(0, L, chunk):
        e = min(s + chunk, L)
        cu = torch.tensor([0, e - s], dtype=torch.int32, device=DEVICE)
        ctx = torch.tensor([e], dtype=torch.int32, device=DEVICE)
        got[s:e] = paged_prefill_attention(q_all[s:e].to(DEVICE), k_cache, v_cache, table, cu, ctx,
                                           d ** -0.5)
    assert_close(got, want, torch.float32, seed, f"chunk {chunk}")


def test_prefix_hit_tail_rows():
    # a prefix hit of 3 full blocks (48 tokens) then 29 new rows, beside a fresh prompt of 1 token
    _run([29, 1], [77, 1], hq=8, hkv=2, d=64, block_size=16, dtype=torch.bfloat16)


@pytest.mark.skipif(DEVICE.type != "cuda", reason="the autotuned launch runs on CUDA only")
@pytest.mark.parametrize("q_lens,ctx", [([1024, 300], [1024, 700]), ([2048], [2048])])
def test_autotuned_long_chunks_cuda(q_lens, ctx):
    """Chunks long enough for the autotuned launch (GQA 32/8, head dim 128, bf16, block 16),
    against torch SDPA on each sequence's gathered K/V."""
    gen, seed = fresh_generator()
    hq, hkv, d, bs = 32, 8, 128, 16
    k_cache, v_cache, table = paged_cache(gen, ctx, bs, hkv, d, torch.bfloat16)
    cu = torch.tensor([0] + q_lens, dtype=torch.int32).cumsum(0, dtype=torch.int32)
    q = randn(gen, int(cu[-1]), hq, d, dtype=torch.bfloat16)
    got = paged_prefill_attention(*on_device(q, k_cache, v_cache, table, cu,
                                             torch.tensor(ctx, dtype=torch.int32)), d ** -0.5)
    for b, L in enumerate(ctx):
        blocks = table[b, :(L + bs - 1) // bs].long()
        kb = k_cache[blocks].flatten(0, 1)[:L].cuda()
        vb = v_cache[blocks].flatten(0, 1)[:L].cuda()
        want = _dense_causal(q[cu[b]:cu[b + 1]].cuda(), kb, vb, d ** -0.5)
        assert_close(got[cu[b]:cu[b + 1]], want, torch.bfloat16, seed, f"seq {b} q_lens={q_lens}")
