"""rotary_embedding_write_kv (Triton, one launch) against the references it fuses:
reference.rotary_embedding then reference.write_kv_cache, on q/k/v views of one qkv row."""
import pytest
import torch

import engine.kernels as K
from engine.kernels import reference
from engine.kernels.rope import build_cos_sin_cache
from engine.kernels.rotary_kv import rotary_embedding_write_kv
from kernel_testlib import DEVICE, assert_close, fresh_generator, on_device, poisoned, randn


def _inputs(gen, dtype, t=9, hq=8, hk=2, d=64, nb=6, bs=16):
    qkv = randn(gen, t, (hq + 2 * hk) * d, dtype=dtype)       # q, k, v: strided views of it
    q = qkv[:, :hq * d].view(t, hq, d)
    k = qkv[:, hq * d:(hq + hk) * d].view(t, hk, d)
    v = qkv[:, (hq + hk) * d:].view(t, hk, d)
    kc, vc = randn(gen, nb, bs, hk, d, dtype=dtype), randn(gen, nb, bs, hk, d, dtype=dtype)
    slots = torch.randperm(nb * bs, generator=gen)[:t]
    slots[[1, 6]] = -1                                          # padding tokens: no write
    pos = torch.randint(0, 300, (t,), generator=gen)
    return qkv, q, k, v, kc, vc, slots, pos


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotary_write_kv_matches_the_two_references(dtype):
    gen, seed = fresh_generator()
    qkv, q, k, v, kc, vc, slots, pos = _inputs(gen, dtype)
    cache = build_cos_sin_cache(64, 300, 10000.0)
    want_q, want_k = reference.rotary_embedding(pos, q, k, cache)
    want_kc, want_vc = kc.clone(), vc.clone()
    reference.write_kv_cache(want_k, v, want_kc, want_vc, slots)
    qkv_d = qkv.to(DEVICE)
    hq, hk, d = 8, 2, 64
    q_d = qkv_d[:, :hq * d].view(-1, hq, d)
    k_d = qkv_d[:, hq * d:(hq + hk) * d].view(-1, hk, d)
    v_d = qkv_d[:, (hq + hk) * d:].view(-1, hk, d)
    kc_d, vc_d, pos_d, slots_d, cache_d = on_device(kc, vc, pos, slots, cache)
    got_q = rotary_embedding_write_kv(pos_d, q_d, k_d, v_d, cache_d, kc_d, vc_d, slots_d,
                                      q_out=poisoned(q_d))
    assert_close(got_q, want_q, dtype, seed, "q")
    assert_close(kc_d, want_kc, dtype, seed, "k cache")
    assert torch.equal(vc_d.cpu(), want_vc), f"seed={seed}: v is copied, never rounded"
    # the dispatching op gives the same on its torch path
    kc2, vc2 = kc.clone(), vc.clone()
    q2 = K.rotary_embedding_write_kv(pos, q, k, v, cache, kc2, vc2, slots, backend="torch")
    assert torch.equal(q2, want_q) and torch.equal(kc2, want_kc) and torch.equal(vc2, want_vc)


def test_rotary_write_kv_checks_shapes():
    gen, _ = fresh_generator()
    _, q, k, v, kc, vc, slots, pos = on_device(*_inputs(gen, torch.float32))
    cache = build_cos_sin_cache(64, 300, 10000.0).to(DEVICE)
    with pytest.raises(ValueError, match="v has shape"):
        rotary_embedding_write_kv(pos, q, k, v[:, :1], cache, kc, vc, slots)
    with pytest.raises(ValueError, match="slot_mapping has shape"):
        rotary_embedding_write_kv(pos, q, k, v, cache, kc, vc, slots[:3])
