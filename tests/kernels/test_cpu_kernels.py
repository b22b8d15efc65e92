"""The C kernels (engine/kernels/cpu.c) against the torch references they replace on CPU:
float32 and bfloat16 activations, strided rows, GQA groups, ragged paged contexts, padding
slots and rows. Rotary and the cache write are bitwise; the norm, SiLU and attention sum in
another order or call another exp, so they are compared at float32 tolerance."""
import pytest
import torch

from engine.kernels import cpu as C
from engine.kernels import reference
from engine.kernels.rope import build_cos_sin_cache
from kernel_testlib import assert_close, fresh_generator, paged_cache, randn

pytestmark = pytest.mark.skipif(C.library() is None, reason="no C compiler: the CPU kernels are not built")
F32 = torch.float32


@pytest.mark.parametrize("x_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm(x_dtype, out_dtype, with_residual):
    gen, seed = fresh_generator()
    x = randn(gen, 5, 200, dtype=x_dtype, scale=3.0)      # 200: not a multiple of 16
    w, res = randn(gen, 200), randn(gen, 5, 200) if with_residual else None
    want = reference.rms_norm(x.float(), w, 1e-6, res)
    got = C.rms_norm(x, w, 1e-6, None if res is None else res.clone(), out_dtype=out_dtype)
    if with_residual:
        (got, got_res), (want, want_res) = got, want
        assert torch.equal(got_res, want_res)             # one float32 add, as in torch
    assert got.dtype == out_dtype
    assert_close(got, want.to(out_dtype), out_dtype if out_dtype != F32 else F32, seed, "rms_norm")


def test_rms_norm_strided_rows_and_3d():
    gen, seed = fresh_generator()
    qkv = randn(gen, 4, 3 * 4 * 32)
    q = qkv[:, :4 * 32].view(4, 4, 32)                     # a per-head norm (Qwen3's q_norm)
    w = randn(gen, 32)
    got = C.rms_norm(q, w, 1e-6)
    assert got.shape == q.shape
    assert_close(got, reference.rms_norm(q, w, 1e-6), F32, seed, "per-head rms_norm")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_write_kv_is_bitwise_the_reference(dtype):
    gen, seed = fresh_generator()
    t, hq, hk, d, nb, bs = 9, 6, 2, 64, 6, 16
    qkv = randn(gen, t, (hq + 2 * hk) * d, dtype=dtype)    # q, k, v: strided views of one row
    q = qkv[:, :hq * d].view(t, hq, d)
    k = qkv[:, hq * d:(hq + hk) * d].view(t, hk, d)
    v = qkv[:, (hq + hk) * d:].view(t, hk, d)
    kc, vc = randn(gen, nb, bs, hk, d), randn(gen, nb, bs, hk, d)
    slots = torch.randperm(nb * bs, generator=gen)[:t]
    slots[[1, 6]] = -1                                     # padding tokens: nothing written
    pos = torch.randint(0, 300, (t,), generator=gen)
    cache = build_cos_sin_cache(d, 300, 10000.0)
    want_q, want_k = reference.rotary_embedding(pos, q.float(), k.float(), cache)
    want_kc, want_vc = kc.clone(), vc.clone()
    reference.write_kv_cache(want_k, v.float(), want_kc, want_vc, slots)
    got_q = C.rope_write_kv(pos, q, k, v, cache, kc, vc, slots)
    assert torch.equal(got_q, want_q), seed
    assert torch.equal(kc, want_kc) and torch.equal(vc, want_vc), seed
    # q and k normed apart (Qwen3's q_norm / k_norm: float32) beside a bfloat16 v
    kc2, vc2 = kc.clone(), vc.clone()
    got_q = C.rope_write_kv(pos, q.float(), k.float(), v, cache, kc2, vc2, slots)
    assert torch.equal(got_q, want_q) and torch.equal(kc2, want_kc) and torch.equal(vc2, want_vc), seed


@pytest.mark.parametrize("gqa", [1, 3])
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
def test_decode_attention(gqa, out_dtype):
    gen, seed = fresh_generator()
    lens = [33, 1, 16, 70, 5]                             # block 16: on and off boundaries
    kc, vc, table = paged_cache(gen, lens, 16, 2, 64, F32)
    q = randn(gen, len(lens), 2 * gqa, 64)
    ctx = torch.tensor(lens, dtype=torch.int32)
    got = C.decode_attention(q, kc, vc, table, ctx, 0.125, out_dtype=out_dtype)
    want = reference.paged_decode_attention(q, kc, vc, table, ctx, 0.125)
    assert got.dtype == out_dtype
    assert_close(got, want.to(out_dtype), out_dtype, seed, f"decode attention gqa={gqa}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window_sinks", [False, True])
def test_rope_decode_attention_is_the_two_kernels_bitwise(dtype, window_sinks):
    """The fused decode call equals rope_write_kv then decode_attention bit for bit (q, k,
    v strided views of one qkv row, GQA 3, ragged contexts), caches included; and the op
    (engine.kernels, backend cpu) is the torch reference's within float32 tolerance."""
    import engine.kernels as K
    gen, seed = fresh_generator()
    lens, hk, hq, d, bs = [33, 1, 16, 70], 2, 6, 64, 16
    kc, vc, table = paged_cache(gen, lens, bs, hk, d, F32)
    b = len(lens)
    qkv = randn(gen, b, (hq + 2 * hk) * d, dtype=dtype)
    q = qkv[:, :hq * d].view(b, hq, d)
    k = qkv[:, hq * d:(hq + hk) * d].view(b, hk, d)
    v = qkv[:, (hq + hk) * d:].view(b, hk, d)
    ctx = torch.tensor(lens, dtype=torch.int32)
    pos = (ctx - 1).long()                                  # each query's own position
    slots = torch.stack([table[i, p // bs].long() * bs + p % bs for i, p in enumerate(pos.tolist())])
    cache = build_cos_sin_cache(d, 300, 10000.0)
    extra = dict(window=20, sinks=randn(gen, hq)) if window_sinks else {}
    kc2, vc2, kc3, vc3 = kc.clone(), vc.clone(), kc.clone(), vc.clone()
    qr = C.rope_write_kv(pos, q, k, v, cache, kc, vc, slots)
    want = C.decode_attention(qr, kc, vc, table, ctx, 0.125, torch.bfloat16, **extra)
    got = C.rope_decode_attention(pos, q, k, v, cache, kc2, vc2, slots, table, ctx, 0.125,
                                  torch.bfloat16, **extra)
    assert torch.equal(got, want) and torch.equal(kc2, kc) and torch.equal(vc2, vc), seed
    # the reference in float32 (the C kernels read bfloat16 values as float32)
    op = K.rope_decode_attention(pos, q.float(), k.float(), v.float(), cache, kc3, vc3, slots,
                                 table, ctx, 0.125, backend="torch", **extra)
    assert torch.equal(kc3, kc) and torch.equal(vc3, vc), seed
    assert_close(C.rope_decode_attention(pos, q, k, v, cache, kc2, vc2, slots, table, ctx, 0.125,
                                         **extra), op, F32, seed, "fused decode attention")
    with pytest.raises(ValueError, match="one query per sequence"):
        C.rope_decode_attention(pos[:2], q, k, v, cache, kc2, vc2, slots, table, ctx, 0.125)


def test_decode_attention_padding_rows_are_zero():
    gen, seed = fresh_generator()
    kc, vc, table = paged_cache(gen, [20, 0, 3], 8, 1, 32, F32)
    q = randn(gen, 3, 2, 32)
    got = C.decode_attention(q, kc, vc, table, torch.tensor([20, 0, 3], dtype=torch.int32), 0.2)
    assert torch.equal(got[1], torch.zeros(2, 32))
    want = reference.paged_decode_attention(q, kc, vc, table, torch.tensor([20, 0, 3], dtype=torch.int32), 0.2)
    assert_close(got, want, F32, seed, "padding rows")


@pytest.mark.parametrize("x_dtype", [torch.float32, torch.bfloat16])
def test_silu_and_mul(x_dtype):
    gen, seed = fresh_generator()
    x = randn(gen, 3, 2 * 150, dtype=x_dtype, scale=4.0)
    for out_dtype in (F32, torch.bfloat16):
        got = C.silu_and_mul(x, out_dtype=out_dtype)
        assert_close(got, reference.silu_and_mul(x.float()).to(out_dtype), out_dtype, seed, "silu")


def test_unsupported_inputs_are_refused():
    with pytest.raises(ValueError, match="float32"):
        C.decode_attention(torch.randn(1, 2, 8), torch.zeros(2, 4, 1, 8, dtype=torch.bfloat16),
                           torch.zeros(2, 4, 1, 8, dtype=torch.bfloat16),
                           torch.zeros(1, 1, dtype=torch.int32), torch.tensor([3], dtype=torch.int32), 1.0)
    with pytest.raises(ValueError, match="contiguous rows"):
        C.silu_and_mul(torch.randn(8, 4).t())


def test_rms_norm_updates_the_residual_in_place():
    x, w, res = torch.randn(2, 32), torch.randn(32), torch.randn(2, 32)
    want = x + res
    _, got = C.rms_norm(x, w, 1e-6, res)
    assert got is res and torch.equal(res, want)


def test_the_build_is_cached_per_machine_and_fails_soft(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert C._build() is not None                            # builds into the cache ...
    (so,) = (tmp_path / "pdserve" / "cpu-kernels").glob("*.so")
    mtime = so.stat().st_mtime_ns
    assert C._build() is not None and so.stat().st_mtime_ns == mtime    # ... once
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "other"))
    monkeypatch.setenv("CC", "false")                        # a compiler that fails
    assert C._build() is None and "could not be built" in caplog.text


# AVX-512 blocks of 4 rows and 16 columns, and tails of both (torch's kernel is compared
# where it is defined: N a multiple of 16, as the engine's int8 layers use it)
@pytest.mark.parametrize("n,k,m", [(64, 576, 1), (80, 208, 3), (9, 33, 2), (70, 200, 4)])
def test_int8_matmul_matches_torchs_int8_kernel(n, k, m):
    gen, seed = fresh_generator()
    w = torch.randint(-127, 128, (n, k), dtype=torch.int8, generator=gen)
    w[3] = 0                                                     # a zero row
    scale = (torch.rand(n, generator=gen) / 50).bfloat16()
    x = randn(gen, m, k, dtype=torch.bfloat16)
    got = C.int8_matmul(x, w, scale)
    assert got.dtype == torch.bfloat16 and torch.equal(got[:, 3], torch.zeros(m, dtype=torch.bfloat16))
    if n % 16 == 0:
        want = torch.ops.aten._weight_int8pack_mm(x, w, scale)
        assert_close(got, want, torch.bfloat16, seed, "int8 matmul vs torch's kernel")
    exact = (x.float() @ w.float().T) * scale.float()              # and the float32 product
    assert_close(got, exact, torch.bfloat16, seed, "int8 matmul vs float32")
    assert_close(C.int8_matmul(x.float(), w, scale), exact, torch.bfloat16, seed, "float32 x")


def test_int8_g32_layers_and_tied_table_move_to_the_c_layout():
    """set_backend(cpu): an int8_g32 layer (torch's int4 layout, the nibble split) becomes plain
    codes and float32 scales, the same codes and scales read back, its products float32 to
    summation order for every M; a tied table stays one copy for lookups and logits."""
    import types
    from engine.quant.int8 import quantize_int8
    from engine.quant.int8_g32 import G32Int4Pack, G32Plain
    from engine.quant.linear import QuantEmbedding, QuantLinear, set_backend
    gen, seed = fresh_generator()
    qw = quantize_int8(randn(gen, 128, 96), 32)
    table = qw.dequantize()
    emb = QuantEmbedding(qw, torch.float32)
    tied, layer = emb.tied_head(), QuantLinear.quantize("int8_g32", randn(gen, 64, 96))
    assert isinstance(emb.packed, G32Int4Pack) and isinstance(layer.packed, G32Int4Pack)
    want_layer = layer.dequantize()
    model = types.SimpleNamespace(modules=lambda: [emb, tied, layer])
    e = emb.packed
    before = e.qweight.nbytes + e.scales_and_zeros.nbytes + e.scale.nbytes
    set_backend(model, "cpu")
    assert all(isinstance(m.packed, G32Plain) for m in (emb, tied, layer))
    assert tied.packed is emb.packed                                   # still one copy
    assert emb.packed.qweight.nbytes + emb.packed.scale.nbytes < before    # the bf16 pairs are gone
    held = emb.quantized()
    assert torch.equal(held.q, qw.q) and torch.equal(held.scale, qw.scale)
    assert torch.equal(layer.dequantize(), want_layer)
    ids = torch.tensor([0, 5, 127])
    assert torch.equal(emb(ids), table[ids])
    for m in (1, 3, 9):
        x = randn(gen, m, 96)
        assert_close(tied(x), x @ table.T, F32, seed, f"tied head M={m}")
        assert_close(layer(x), x @ want_layer.T, F32, seed, f"int8_g32 layer M={m}")


@pytest.mark.parametrize("gqa", [1, 3])
@pytest.mark.parametrize("window", [None, 7])
def test_cpu_prefill_attention_is_the_reference(gqa, window):
    """The cpu backend's prefill attention (torch's blocked kernel, engine/kernels/__init__.py
    _flash_prefill) against reference.paged_prefill_attention: ragged chunks that start a
    sequence (causal), follow a cached prefix (the chunk sees it all) or have no tokens, over
    shuffled blocks, with and without a window."""
    import engine.kernels as K
    gen, seed = fresh_generator()
    lens, chunks = [20, 45, 9, 33], [20, 12, 0, 1]          # context and its last chunk
    kc, vc, table = paged_cache(gen, lens, 8, 2, 32, F32)
    cu = torch.tensor([0, *torch.tensor(chunks).cumsum(0).tolist()], dtype=torch.int32)
    q = randn(gen, int(cu[-1]), 2 * gqa, 32)
    ctx = torch.tensor(lens, dtype=torch.int32)
    want = reference.paged_prefill_attention(q, kc, vc, table, cu, ctx, 0.17, window=window)
    got = K.paged_prefill_attention(q, kc, vc, table, cu, ctx, 0.17, window=window, backend="cpu")
    assert_close(got, want, F32, seed, f"prefill attention gqa={gqa} window={window}")
