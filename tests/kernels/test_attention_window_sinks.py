"""Sliding windows and attention sinks in the paged attention ops.

The torch reference is first checked against transformers' own definitions (its
sliding_window_causal_mask_function for the window's off-by-one, GPT-OSS's
eager_attention_forward for the sinks) on a dense, contiguous context; then the Triton
kernels (under TRITON_INTERPRET=1 on CPU) and the C decode kernel against the reference,
float and 8-bit caches, decode and prefill (a cached prefix, chunked queries), windows
smaller and larger than the context, sinks on and off."""
import types

import pytest
import torch

from engine.kernels import cpu as C
from engine.kernels import reference
from engine.kernels.decode_attention import paged_decode_attention
from engine.kernels.prefill_attention import paged_prefill_attention
from kernel_testlib import DEVICE, assert_close, fresh_generator, on_device, paged_cache, poisoned, randn

F32 = torch.float32


def _fill(k_cache, v_cache, table, k, v):
    """Write one sequence's contiguous k/v [L, H_kv, D] into its paged blocks."""
    bs = k_cache.shape[1]
    for p in range(k.shape[0]):
        k_cache[table[p // bs], p % bs], v_cache[table[p // bs], p % bs] = k[p], v[p]


def _transformers_attention(q, k, v, scale, window, sinks):
    """q [M, H_q, D] (the last M positions of L), k/v [L, H_kv, D]: transformers' mask
    function and (with sinks) GPT-OSS's eager attention; without sinks, Gemma 3's."""
    from transformers.masking_utils import causal_mask_function, sliding_window_causal_mask_function
    from transformers.models.gemma3.modeling_gemma3 import eager_attention_forward as plain
    from transformers.models.gpt_oss.modeling_gpt_oss import eager_attention_forward as with_sinks
    L, M = k.shape[0], q.shape[0]
    fn = causal_mask_function if window is None else sliding_window_causal_mask_function(window)
    qi = torch.arange(L - M, L)[:, None]
    allowed = fn(0, 0, qi, torch.arange(L)[None, :])                     # [M, L] bool
    mask = torch.zeros(M, L).masked_fill(~allowed, float("-inf"))[None, None]
    module = types.SimpleNamespace(num_key_value_groups=q.shape[1] // k.shape[1], training=False,
                                   sinks=sinks, head_dim=q.shape[2])
    args = (module, q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None], mask)
    out, _ = with_sinks(*args, scaling=scale) if sinks is not None else plain(*args, scaling=scale)
    return out[0]                                                         # [M, H_q, D]


@pytest.mark.parametrize("window", [None, 1, 5, 30])
@pytest.mark.parametrize("with_sinks", [False, True])
def test_reference_is_transformers_window_and_sinks(window, with_sinks):
    gen, seed = fresh_generator()
    L, M, hq, hkv, d, bs = 23, 9, 4, 2, 16, 8
    k, v, q = randn(gen, L, hkv, d), randn(gen, L, hkv, d), randn(gen, M, hq, d)
    sinks = randn(gen, hq, scale=2.0) if with_sinks else None
    kc, vc, table = paged_cache(gen, [L], bs, hkv, d, F32)
    _fill(kc, vc, table[0], k, v)
    want = _transformers_attention(q, k, v, d ** -0.5, window, sinks)
    cu = torch.tensor([0, M], dtype=torch.int32)
    ctx = torch.tensor([L], dtype=torch.int32)
    got = reference.paged_prefill_attention(q, kc, vc, table, cu, ctx, d ** -0.5, window=window,
                                            sinks=sinks)
    assert_close(got, want, F32, seed, f"prefill reference window={window}")
    got = reference.paged_decode_attention(q[-1:], kc, vc, table, ctx, d ** -0.5, window=window,
                                           sinks=sinks)
    assert_close(got, want[-1:], F32, seed, f"decode reference window={window}")


def _sinks(gen, hq, on):
    return randn(gen, hq, scale=2.0) if on else None


def _kv8(gen, context_lens, bs, hkv, d, kv_dtype):
    k, v, table = paged_cache(gen, context_lens, bs, hkv, d, F32)
    kc, vc = torch.empty(k.shape, dtype=kv_dtype), torch.empty(v.shape, dtype=kv_dtype)
    ks, vs = torch.zeros(k.shape[0], hkv), torch.zeros(k.shape[0], hkv)
    reference.write_kv_cache_quant(k.flatten(0, 1), v.flatten(0, 1), kc, vc, ks, vs,
                                   torch.arange(k.shape[0] * bs))
    return kc, vc, table, ks, vs


def _caches(gen, context_lens, bs, hkv, d, dtype, kv_dtype):
    if kv_dtype is None:
        return (*paged_cache(gen, context_lens, bs, hkv, d, dtype), None, None)
    return _kv8(gen, context_lens, bs, hkv, d, kv_dtype)


# windows below, at and above the contexts; partition 32 splits the longer contexts
DECODE_CTX = [33, 1, 70, 7, 45, 0]


@pytest.mark.parametrize("window", [1, 6, 40, 1000])
@pytest.mark.parametrize("with_sinks", [False, True])
@pytest.mark.parametrize("kv_dtype", [None, torch.int8])
def test_triton_decode(window, with_sinks, kv_dtype):
    gen, seed = fresh_generator()
    hq, hkv, d, bs = 4, 2, 32, 8
    kc, vc, table, ks, vs = _caches(gen, DECODE_CTX, bs, hkv, d, F32, kv_dtype)
    q = randn(gen, len(DECODE_CTX), hq, d)
    ctx = torch.tensor(DECODE_CTX, dtype=torch.int32)
    sinks = _sinks(gen, hq, with_sinks)
    scales = {} if ks is None else dict(k_scales=ks.to(DEVICE), v_scales=vs.to(DEVICE))
    for partition in (32, 128):                     # split-K and one partition
        got = paged_decode_attention(*on_device(q, kc, vc, table, ctx), d ** -0.5, out=poisoned(q).to(DEVICE),
                                     partition_size=partition, max_context_len=128, window=window,
                                     sinks=None if sinks is None else sinks.to(DEVICE), **scales)
        want = reference.paged_decode_attention(q, kc, vc, table, ctx, d ** -0.5, ks, vs,
                                                window=window, sinks=sinks)
        assert_close(got, want, F32, seed, f"decode window={window} sinks={with_sinks} "
                                           f"kv={kv_dtype} partition={partition}")


@pytest.mark.parametrize("window", [1, 20, 70, 1000])
@pytest.mark.parametrize("with_sinks", [False, True])
@pytest.mark.parametrize("kv_dtype", [None, torch.int8])
def test_triton_prefill_with_prefix(window, with_sinks, kv_dtype):
    # seq 0: a whole prompt; seq 1: a chunk after a 50-token cached prefix; seq 2: one row;
    # seq 3: an empty chunk; seq 4: a chunk crossing query and key tiles; GQA 2
    q_lens, context_lens = [37, 20, 1, 0, 70], [37, 70, 9, 5, 101]
    gen, seed = fresh_generator()
    hq, hkv, d, bs = 4, 2, 32, 16
    kc, vc, table, ks, vs = _caches(gen, context_lens, bs, hkv, d, F32, kv_dtype)
    cu = torch.tensor([0] + q_lens, dtype=torch.int32).cumsum(0, dtype=torch.int32)
    q = randn(gen, int(cu[-1]), hq, d)
    ctx = torch.tensor(context_lens, dtype=torch.int32)
    sinks = _sinks(gen, hq, with_sinks)
    scales = {} if ks is None else dict(k_scales=ks.to(DEVICE), v_scales=vs.to(DEVICE))
    got = paged_prefill_attention(*on_device(q, kc, vc, table, cu, ctx), d ** -0.5, out=poisoned(q).to(DEVICE),
                                  window=window, sinks=None if sinks is None else sinks.to(DEVICE),
                                  **scales)
    want = reference.paged_prefill_attention(q, kc, vc, table, cu, ctx, d ** -0.5, ks, vs,
                                             window=window, sinks=sinks)
    assert_close(got, want, F32, seed, f"prefill window={window} sinks={with_sinks} kv={kv_dtype}")


@pytest.mark.parametrize("window", [5, 16])
def test_chunked_windowed_prefill_equals_one_shot(window):
    """A prompt run in chunks of 13 through the Triton kernel (the earlier chunks read back
    through the block table) gives the rows of the reference over the whole prompt."""
    gen, seed = fresh_generator()
    L, hq, hkv, d, bs = 45, 4, 1, 16, 8
    kc, vc, table = paged_cache(gen, [L], bs, hkv, d, F32)
    q = randn(gen, L, hq, d)
    sinks = randn(gen, hq)
    ctx = torch.tensor([L], dtype=torch.int32)
    want = reference.paged_prefill_attention(q, kc, vc, table, torch.tensor([0, L], dtype=torch.int32),
                                             ctx, d ** -0.5, window=window, sinks=sinks)
    kc, vc, table, sk = on_device(kc, vc, table, sinks)
    for s in range(0, L, 13):
        e = min(s + 13, L)
        cu = torch.tensor([0, e - s], dtype=torch.int32, device=DEVICE)
        got = paged_prefill_attention(q[s:e].to(DEVICE), kc, vc, table, cu,
                                      torch.tensor([e], dtype=torch.int32, device=DEVICE),
                                      d ** -0.5, window=window, sinks=sk)
        assert_close(got, want[s:e], F32, seed, f"chunk {s}:{e} window={window}")


@pytest.mark.skipif(C.library() is None, reason="no C compiler: the CPU kernels are not built")
@pytest.mark.parametrize("window", [None, 1, 6, 40])
@pytest.mark.parametrize("with_sinks", [False, True])
def test_cpu_decode(window, with_sinks):
    gen, seed = fresh_generator()
    hq, hkv, d, bs = 6, 2, 24, 8
    kc, vc, table = paged_cache(gen, DECODE_CTX, bs, hkv, d, F32)
    q = randn(gen, len(DECODE_CTX), hq, d)
    ctx = torch.tensor(DECODE_CTX, dtype=torch.int32)
    sinks = _sinks(gen, hq, with_sinks)
    got = C.decode_attention(q, kc, vc, table, ctx, d ** -0.5, window=window, sinks=sinks)
    want = reference.paged_decode_attention(q, kc, vc, table, ctx, d ** -0.5, window=window, sinks=sinks)
    assert_close(got, want, F32, seed, f"cpu decode window={window} sinks={with_sinks}")


def test_bad_window_and_sinks_refused():
    q, kc, table, ctx = on_device(torch.randn(2, 4, 16), torch.randn(4, 8, 2, 16),
                                  torch.zeros(2, 2, dtype=torch.int32), torch.ones(2, dtype=torch.int32))
    with pytest.raises(ValueError, match="window"):
        paged_decode_attention(q, kc, kc.clone(), table, ctx, 1.0, window=0)
    with pytest.raises(ValueError, match="sinks has shape"):
        paged_decode_attention(q, kc, kc.clone(), table, ctx, 1.0, sinks=torch.zeros(3, device=DEVICE))
