"""8-bit KV cache: the write path's per-(block, head) scales on a hand-computed example, the
rescale when a later token exceeds a block's scale, a reused block starting afresh; attention
over the 8-bit cache against attention over the same values dequantized into a float cache;
the scales travelling with their blocks over the KV wire; the compat key refusing a mismatch."""
import asyncio

import pytest
import torch

from engine.kernels import reference as R
from kvtransfer import CompatKey, IncompatibleKV, KVReceiver, KVSender, LoopbackTransport
from kvtransfer.wire import SCALE_LAYOUT, block_bytes

KV_DTYPES = [torch.int8, torch.float8_e4m3fn]


def _cache(nb, bs, h, d, dtype):
    return (torch.zeros(nb, bs, h, d, dtype=dtype), torch.zeros(nb, bs, h, d, dtype=dtype),
            torch.zeros(nb, h), torch.zeros(nb, h))


def _dequant(cache, scales):
    return cache.view(torch.int8).view(cache.dtype).float() * scales[:, None, :, None]


def test_int8_write_hand_example():
    kc, vc, ks, vs = _cache(2, 4, 1, 2, torch.int8)
    k = torch.tensor([[[1.27, -0.5]], [[0.3, 0.0]]])      # two tokens into block 1, offsets 0, 1
    R.write_kv_cache_quant(k, -k, kc, vc, ks, vs, torch.tensor([4, 5]))
    assert ks[:, 0].tolist() == pytest.approx([0.0, 0.01]) and torch.equal(vs, ks)
    assert kc[1, :2, 0].tolist() == [[127, -50], [30, 0]]
    assert vc[1, :2, 0].tolist() == [[-127, 50], [-30, 0]]
    # a later token twice as large: the scale doubles and the earlier entries are requantized
    R.write_kv_cache_quant(torch.tensor([[[2.54, 0.01]]]), torch.tensor([[[0.2, 0.0]]]),
                           kc, vc, ks, vs, torch.tensor([6]))
    assert ks[1].tolist() == pytest.approx([0.02]) and vs[1].tolist() == pytest.approx([0.01])
    assert kc[1, :3, 0].tolist() == [[64, -25], [15, 0], [127, 0]]     # 63.5 -> 64, 0.5 -> 0
    assert vc[1, :3, 0].tolist() == [[-127, 50], [-30, 0], [20, 0]]    # V's scale did not grow
    # the block is reused (offset 0 written again): its scale starts afresh, not at 0.02
    R.write_kv_cache_quant(torch.tensor([[[0.1, 0.05]]]), torch.tensor([[[0.1, 0.05]]]),
                           kc, vc, ks, vs, torch.tensor([4]))
    assert ks[1].tolist() == pytest.approx([0.1 / 127])
    assert ks[0].tolist() == [0.0]                                       # block 0 untouched


@pytest.mark.parametrize("dtype", KV_DTYPES)
def test_chunked_writes_then_attention_equals_float_attention_on_dequantized_cache(dtype):
    gen = torch.Generator().manual_seed(0)
    nb, bs, h, hq, d = 12, 4, 2, 4, 16
    kc, vc, ks, vs = _cache(nb, bs, h, d, dtype)
    lens = [11, 6]
    tables = torch.tensor([[3, 7, 1, 0], [9, 4, 0, 0]], dtype=torch.int32)
    ks_all = [torch.randn(n, h, d, generator=gen) * (1 + torch.arange(n)[:, None, None] / 3) for n in lens]
    vs_all = [torch.randn(n, h, d, generator=gen) for n in lens]
    slots = [torch.tensor([int(tables[b, p // bs]) * bs + p % bs for p in range(n)]) for b, n in enumerate(lens)]
    # seq 0 in chunks 5 + 3 + 1 + 1 + 1 (a prefill split mid-block, then decode steps), seq 1 at once
    for lo, hi in [(0, 5), (5, 8), (8, 9), (9, 10), (10, 11)]:
        R.write_kv_cache_quant(ks_all[0][lo:hi], vs_all[0][lo:hi], kc, vc, ks, vs, slots[0][lo:hi])
    R.write_kv_cache_quant(ks_all[1], vs_all[1], kc, vc, ks, vs, torch.cat([slots[1], torch.tensor([-1])])[:6])
    qmax = R.KV_QMAX[dtype]
    for b, n in enumerate(lens):
        for x, cache, sc in ((ks_all[b], kc, ks), (vs_all[b], vc, vs)):
            got = _dequant(cache, sc).view(nb * bs, h, d)[slots[b]]
            blk = slots[b] // bs
            # every (block, head) scale is the amax of what it holds / QMAX
            want_scale = torch.zeros(nb, h).scatter_reduce_(0, blk[:, None].expand(-1, h), x.abs().amax(-1), "amax")
            assert torch.allclose(sc[blk.unique()], want_scale[blk.unique()] / qmax)
            step = sc[blk][..., None]
            # int8: half a step per rounding (a requantized entry was rounded twice or more);
            # fp8 e4m3: 2^-4 relative per rounding, down to its subnormals (2^-9)
            tol = 2.0 * step if dtype == torch.int8 else 0.125 * x.abs() + step * 2 ** -9
            assert ((got - x).abs() <= tol + 1e-6).all()
    fk, fv = _dequant(kc, ks), _dequant(vc, vs)
    q = torch.randn(2, hq, d, generator=gen)
    ctx = torch.tensor(lens, dtype=torch.int32)
    torch.testing.assert_close(R.paged_decode_attention(q, kc, vc, tables, ctx, 0.25, ks, vs),
                               R.paged_decode_attention(q, fk, fv, tables, ctx, 0.25))
    qp = torch.randn(7, hq, d, generator=gen)
    cu = torch.tensor([0, 4, 7], dtype=torch.int32)
    torch.testing.assert_close(R.paged_prefill_attention(qp, kc, vc, tables, cu, ctx, 0.25, ks, vs),
                               R.paged_prefill_attention(qp, fk, fv, tables, cu, ctx, 0.25))


def _run(coro):
    return asyncio.run(asyncio.wait_for(coro, 20))


@pytest.mark.parametrize("dtype", KV_DTYPES)
def test_scales_travel_with_their_blocks(dtype):
    L, NB, BS, H, D = 3, 10, 4, 2, 8
    src = torch.randn(L, 2, NB, BS, H, D).mul(10).to(dtype)
    src_scales = torch.rand(L, 2, NB, H)
    dst = torch.zeros_like(src)
    dst_scales = torch.zeros(L, 2, NB, H)

    async def main():
        rx = KVReceiver(dst, CompatKey.from_cache(dst, "m", dst_scales), LoopbackTransport(), kv_scales=dst_scales)
        addr = await rx.start()
        tx = KVSender(src, CompatKey.from_cache(src, "m", src_scales), LoopbackTransport(), kv_scales=src_scales)
        rx.reserve("t", [6, 2, 9])
        h = await tx.open("t", addr, [1, 5, 3], [6, 2, 9])
        for layer in range(L):
            await tx.push_layer(h, layer)
        stats = await tx.finish(h, timeout=5)
        assert (await rx.wait("t", 5)).state.name == "DONE"
        await tx.close(); await rx.close()
        return stats

    stats = _run(main())
    raw = lambda t: t.view(torch.int8)
    assert torch.equal(raw(dst[:, :, [6, 2, 9]]), raw(src[:, :, [1, 5, 3]]))
    assert torch.equal(dst_scales[:, :, [6, 2, 9]], src_scales[:, :, [1, 5, 3]])
    others = [i for i in range(NB) if i not in (6, 2, 9)]
    assert not dst_scales[:, :, others].any() and not raw(dst[:, :, others]).any()
    assert stats.bytes_sent == L * 3 * block_bytes(src, src_scales)
    # SmolLM2's block (16 tokens, 3 KV heads of 64) in 8 bits with its scales: <= 0.52x bf16
    shape = (1, 2, 1, 16, 3, 64)
    assert (block_bytes(torch.zeros(shape, dtype=dtype), torch.zeros(1, 2, 1, 3))
            <= 0.52 * block_bytes(torch.zeros(shape, dtype=torch.bfloat16)))


def test_compat_key_names_kv_dtype_and_scale_layout():
    c8 = torch.zeros(2, 2, 4, 4, 2, 8, dtype=torch.float8_e4m3fn)
    k8 = CompatKey.from_cache(c8, "m", torch.zeros(2, 2, 4, 2))
    kb = CompatKey.from_cache(torch.zeros(2, 2, 4, 4, 2, 8, dtype=torch.bfloat16), "m")
    assert (k8.dtype, k8.kv_scales, kb.kv_scales) == ("float8_e4m3fn", SCALE_LAYOUT, "none")
    with pytest.raises(IncompatibleKV) as e:
        k8.check(kb, "prefill", "decode")
    assert "dtype: prefill='float8_e4m3fn' decode='bfloat16'" in str(e.value)
    assert f"kv_scales: prefill={SCALE_LAYOUT!r} decode='none'" in str(e.value)
    with pytest.raises(ValueError, match="needs its kv_scales"):
        CompatKey.from_cache(c8, "m")
    with pytest.raises(ValueError, match="kv_scales must be"):
        CompatKey.from_cache(c8, "m", torch.zeros(2, 2, 4, 3))
    from services.protoconv import compat_from_proto, compat_to_proto
    assert compat_from_proto(compat_to_proto(k8)) == k8
