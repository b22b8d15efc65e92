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
