"""The Triton 8-bit KV-cache write (kv_cache.write_kv_cache_quant) against
reference.write_kv_cache_quant: after every write of a sequence -- fresh blocks, chunks that
continue a block, decode tokens that grow a block's scale (its earlier codes requantized),
skipped slots (-1), one block's tokens scattered through a batch, rounding ties, K minus a
K shift -- the codes and the scales are equal bit for bit."""
import pytest
import torch

from engine.kernels import reference
from engine.kernels.kv_cache import write_kv_cache_quant
from kernel_testlib import DEVICE, assert_close, fresh_generator, on_device, randn

NB, BS, H, D = 7, 8, 3, 24       # head_dim 24: masked to 32 in the kernel

# (slots, per-token magnitude): the magnitudes make later tokens exceed a block's scale
STEPS = [
    ([24, 25, 26, 27, 28, 29, 30, 31, 0, 1, 2, 3, 4, -1, -1], 1.0),   # prefill into blocks 3, 0
    ([5], 50.0),                                     # decode: block 0 grows, requantized
    ([6], 0.01),                                     # smaller: scale kept
    ([7, 40, -1, 41, 8, 42], 1.0),                   # three sequences, block 5 fresh, block 1 fresh
    ([43, 9, 44, 10, 45], 30.0),                     # block 5 and 1 interleaved, both grow
    ([11, 12, 13, 14, 15, 16], 200.0),               # a chunk finishing block 1, starting block 2
    ([-1, -1], 1.0),                                 # nothing written
    ([32, 33], 0.5),                                 # block 4 reused: fresh, stale scale ignored
]


def _close_all(got, want, seed, what):
    kc, vc, ks, vs = (t.cpu() for t in got)
    rkc, rvc, rks, rvs = want
    for name, a, b in (("k codes", kc, rkc), ("v codes", vc, rvc)):
        diff = (a.view(torch.int8) != b.view(torch.int8)).sum().item()
        assert diff == 0, f"{what} seed={seed}: {diff} {name} differ"
    for name, a, b in (("k scales", ks, rks), ("v scales", vs, rvs)):
        assert torch.equal(a.view(torch.int32), b.view(torch.int32)), f"{what} seed={seed}: {name}"


@pytest.mark.parametrize("kv_dtype,dtype,shifted", [
    (torch.float8_e4m3fn, torch.float32, False), (torch.float8_e4m3fn, torch.bfloat16, False),
    (torch.int8, torch.float32, False), (torch.int8, torch.bfloat16, False),
    (torch.float8_e4m3fn, torch.bfloat16, True), (torch.int8, torch.float32, True)])
def test_write_sequence_bit_exact(kv_dtype, dtype, shifted):
    gen, seed = fresh_generator()
    # the K shift (reference.py): an offset per (head, channel) as large as the values
    shift = randn(gen, H, D, scale=3.0) if shifted else None
    # stale contents (a reused pool): random codes and scales
    codes = torch.randint(-100, 100, (2, NB, BS, H, D), generator=gen, dtype=torch.int8)
    rkc, rvc = (c.to(kv_dtype) if kv_dtype == torch.int8 else (c.float() / 4).to(kv_dtype)
                for c in codes)
    rks, rvs = torch.rand(2, NB, H, generator=gen) * 3
    kc, vc, ks, vs = on_device(*(t.clone() for t in (rkc, rvc, rks, rvs)))  # the kernel's copy
    grew = 0
    for i, (slots, mag) in enumerate(STEPS):
        slot_mapping = torch.tensor(slots, dtype=torch.int32)
        k = randn(gen, len(slots), H, D, dtype=dtype, scale=mag)
        v = randn(gen, len(slots), H, D, dtype=dtype, scale=mag)
        before = rks.clone()
        reference.write_kv_cache_quant(k, v, rkc, rvc, rks, rvs, slot_mapping, shift)
        write_kv_cache_quant(*on_device(k, v), kc, vc, ks, vs, slot_mapping.to(DEVICE),
                             None if shift is None else on_device(shift)[0])
        _close_all((kc, vc, ks, vs), (rkc, rvc, rks, rvs), seed, f"{kv_dtype} {dtype} step {i}")
        written = {s // BS for s in slots if s >= 0}
        fresh = {s // BS for s in slots if s >= 0 and s % BS == 0}
        grew += sum(int((rks[b] > before[b]).any()) for b in written - fresh)
        if shift is not None and i == len(STEPS) - 1:   # the codes stand for k - shift, v
            at = slot_mapping.long()
            deq = rkc.float().view(-1, H, D)[at] * rks.repeat_interleave(BS, 0)[at][..., None]
            err = (deq - (k.float() - shift)).abs().max() / (k.float() - shift).abs().max()
            assert err < 0.07, f"seed={seed}: K codes are not of k - shift ({err:.3f})"
    assert grew >= 3            # the requantizing branch ran (blocks 0, 1, 5 at least)


@pytest.mark.parametrize("kv_dtype", [torch.float8_e4m3fn, torch.int8])
def test_rounding_ties(kv_dtype):
    # amax 127 (int8) / 448 (fp8) gives scale 1.0 exactly: the other values are the codes
    # before rounding, halves included (torch.round and the fp8 cast round half to even)
    qmax = reference.KV_QMAX[kv_dtype]
    vals = torch.tensor([qmax, 0.5, 1.5, 2.5, -0.5, -2.5, 3.5, -126.5, 17.0625, 0.0, 5.25,
                         -9.875, 100.5, 101.5, 0.03125, 7.5], dtype=torch.float32)
    k = vals.view(1, 1, 16).expand(2, 1, 16).contiguous()
    k[1] = -k[1]
    want_kc, want_vc = torch.zeros(2, 2, 1, 16, dtype=kv_dtype), torch.zeros(2, 2, 1, 16, dtype=kv_dtype)
    want_s = torch.zeros(2, 1), torch.zeros(2, 1)
    slots = torch.tensor([0, 3], dtype=torch.int32)
    reference.write_kv_cache_quant(k, k, want_kc, want_vc, *want_s, slots)
    kc, vc, ks, vs = on_device(torch.zeros_like(want_kc), torch.zeros_like(want_vc),
                               torch.zeros(2, 1), torch.zeros(2, 1))
    write_kv_cache_quant(*on_device(k, k), kc, vc, ks, vs, slots.to(DEVICE))
    assert ks[0, 0].item() == 1.0
    _close_all((kc, vc, ks, vs), (want_kc, want_vc, *want_s), 0, "ties")


def test_bad_arguments_raise():
    k = torch.randn(2, H, D, device=DEVICE)
    kc = torch.zeros(NB, BS, H, D, dtype=torch.int8, device=DEVICE)
    s = torch.zeros(NB, H, device=DEVICE)
    slots = torch.tensor([0, 1], dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match="k_cache has dtype"):
        write_kv_cache_quant(k, k, kc.float(), kc.float(), s, s, slots)
    with pytest.raises(ValueError, match="v_scales has shape"):
        write_kv_cache_quant(k, k, kc, kc.clone(), s, s[:, :2], slots)
    with pytest.raises(ValueError, match="slot_mapping has shape"):
        write_kv_cache_quant(k, k, kc, kc.clone(), s, s, slots[:1])


@pytest.mark.parametrize("kv_dtype", [torch.float8_e4m3fn, torch.int8])
def test_rotary_then_quantized_write_dispatch(kv_dtype):
    # rotary_embedding_write_kv on the Triton path with scales: the Triton rotary, then the
    # quantized write, against the torch path (reference rotary, reference quantized write).
    # V is not rotated: its codes and scales are bit-identical. K goes through two rotary
    # implementations that may round differently in the last bit (on CPU they agree bit for
    # bit; a GPU's fused multiply-adds may not): scales within 1e-6 relative, K codes within
    # one code step (1 for int8; an e4m3 ulp, 2^(e-3) at exponent e >= -6, for fp8).
    import engine.kernels as K
    from engine.kernels.rope import build_cos_sin_cache
    gen, seed = fresh_generator()
    t, hq = 11, 6
    qkv = randn(gen, t, (hq + 2 * H) * D)                      # q, k, v: strided views of it
    q, k, v = (x.view(t, -1, D) for x in qkv.split([hq * D, H * D, H * D], dim=1))
    slots = torch.tensor([16, 17, 18, -1, 19, 3, 40, 41, 42, -1, 20])
    pos = torch.randint(0, 100, (t,), generator=gen)
    cos_sin = build_cos_sin_cache(D, 100, 10000.0)
    want = [torch.zeros(NB, BS, H, D, dtype=kv_dtype) for _ in range(2)] + \
        [torch.zeros(NB, H) for _ in range(2)]
    got = [x.clone().to(DEVICE) for x in want]
    want_q = K.rotary_embedding_write_kv(pos, q, k, v, cos_sin, want[0], want[1], slots,
                                         k_scales=want[2], v_scales=want[3], backend="torch")
    qkv_d = qkv.clone().to(DEVICE)
    q_d, k_d, v_d = (x.view(t, -1, D) for x in qkv_d.split([hq * D, H * D, H * D], dim=1))
    got_q = K.rotary_embedding_write_kv(*on_device(pos), q_d, k_d, v_d, *on_device(cos_sin),
                                        got[0], got[1], *on_device(slots), k_scales=got[2],
                                        v_scales=got[3], backend="triton")
    assert_close(got_q, want_q, torch.float32, seed, "rotated q")
    kc, vc, ks, vs = (x.cpu() for x in got)
    assert torch.equal(vc.view(torch.int8), want[1].view(torch.int8)), f"seed={seed}"
    assert torch.equal(vs, want[3]), f"seed={seed}"
    torch.testing.assert_close(ks, want[2], atol=0, rtol=1e-6)
    a, b = kc.float(), want[0].float()
    top = torch.maximum(a.abs(), b.abs()).clamp(min=2 ** -6)
    step = 1.0 if kv_dtype == torch.int8 else torch.exp2(torch.floor(torch.log2(top)) - 3)
    assert bool(((a - b).abs() <= step).all()), f"seed={seed}"
