"""Partial rotary (GLM-4.5, MiniMax-M2: a cos/sin table narrower than the head, R < D): the
reference against transformers' own apply_rotary_pos_emb; the Triton rotary kernels (under
TRITON_INTERPRET=1 on CPU), the C kernel and every dispatcher backend against the reference;
the pass-through columns copied exactly."""
import pytest
import torch

import engine.kernels as K
from engine.kernels import cpu as C
from engine.kernels import reference
from engine.kernels.rope import build_cos_sin_cache
from engine.kernels.rotary import rotary_embedding
from engine.kernels.rotary_kv import rotary_embedding_write_kv
from kernel_testlib import DEVICE, assert_close, fresh_generator, on_device, poisoned, randn

# (head_dim, rotary dim): GLM-4.5 rotates half of each head; MiniMax-M2 64 of 128; an odd pass
SHAPES = [(64, 32), (32, 16), (48, 40), (64, 64)]


def _inputs(gen, dtype, d, t=9, hq=8, hk=2, nb=6, bs=16):
    qkv = randn(gen, t, (hq + 2 * hk) * d, dtype=dtype)       # q, k, v: strided views of it
    views = (qkv[:, :hq * d].view(t, hq, d), qkv[:, hq * d:(hq + hk) * d].view(t, hk, d),
             qkv[:, (hq + hk) * d:].view(t, hk, d))
    kc, vc = randn(gen, nb, bs, hk, d, dtype=dtype), randn(gen, nb, bs, hk, d, dtype=dtype)
    slots = torch.randperm(nb * bs, generator=gen)[:t]
    slots[[1, 6]] = -1                                          # padding tokens: no write
    return qkv, views, kc, vc, slots, torch.randint(0, 300, (t,), generator=gen)


def _views(qkv, hq, hk, d):
    return (qkv[:, :hq * d].view(-1, hq, d), qkv[:, hq * d:(hq + hk) * d].view(-1, hk, d),
            qkv[:, (hq + hk) * d:].view(-1, hk, d))


@pytest.mark.parametrize("d,r", SHAPES)
def test_reference_is_transformers_partial_rotary(d, r):
    from transformers.models.glm4_moe.modeling_glm4_moe import apply_rotary_pos_emb
    gen, seed = fresh_generator()
    _, (q, k, _), *_, pos = _inputs(gen, torch.float32, d)
    table = build_cos_sin_cache(r, 300, 10000.0)
    cos = torch.cat((table[pos][:, : r // 2],) * 2, -1)      # transformers' cat(freqs, freqs)
    sin = torch.cat((table[pos][:, r // 2:],) * 2, -1)
    # transformers: [batch, heads, seq, D] with cos/sin [batch, seq, R]
    want_q, want_k = apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None],
                                          cos[None], sin[None])
    got_q, got_k = reference.rotary_embedding(pos, q, k, table)
    torch.testing.assert_close(got_q, want_q[0].transpose(0, 1), rtol=1e-6, atol=1e-6,
                               msg=lambda m: f"seed={seed}: {m}")
    torch.testing.assert_close(got_k, want_k[0].transpose(0, 1), rtol=1e-6, atol=1e-6)
    assert torch.equal(got_q[..., r:], q[..., r:]) and torch.equal(got_k[..., r:], k[..., r:])


@pytest.mark.parametrize("d,r", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_rotary_partial(d, r, dtype):
    gen, seed = fresh_generator()
    qkv, (q, k, _), *_, pos = _inputs(gen, dtype, d)
    table = build_cos_sin_cache(r, 300, 10000.0)
    want_q, want_k = reference.rotary_embedding(pos, q, k, table)
    q_d, k_d, _ = _views(qkv.to(DEVICE), 8, 2, d)
    pos_d, table_d = on_device(pos, table)
    got_q, got_k = rotary_embedding(pos_d, q_d, k_d, table_d, q_out=poisoned(q_d), k_out=poisoned(k_d))
    assert_close(got_q, want_q, dtype, seed, "q")
    assert_close(got_k, want_k, dtype, seed, "k")
    assert torch.equal(got_q[..., r:].cpu(), q[..., r:]), f"seed={seed}: pass-through copied"


@pytest.mark.parametrize("d,r", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_rotary_write_kv_partial(d, r, dtype):
    gen, seed = fresh_generator()
    qkv, (q, k, v), kc, vc, slots, pos = _inputs(gen, dtype, d)
    table = build_cos_sin_cache(r, 300, 10000.0)
    want_q, want_k = reference.rotary_embedding(pos, q, k, table)
    want_kc, want_vc = kc.clone(), vc.clone()
    reference.write_kv_cache(want_k, v, want_kc, want_vc, slots)
    q_d, k_d, v_d = _views(qkv.to(DEVICE), 8, 2, d)
    kc_d, vc_d, pos_d, slots_d, table_d = on_device(kc, vc, pos, slots, table)
    got_q = rotary_embedding_write_kv(pos_d, q_d, k_d, v_d, table_d, kc_d, vc_d, slots_d,
                                      q_out=poisoned(q_d))
    assert_close(got_q, want_q, dtype, seed, "q")
    assert_close(kc_d, want_kc, dtype, seed, "k cache")
    assert torch.equal(vc_d.cpu(), want_vc), f"seed={seed}: v is copied whole"
    assert torch.equal(kc_d[..., r:].cpu(), want_kc[..., r:]), f"seed={seed}: k pass-through"


@pytest.mark.skipif(C.library() is None, reason="no C compiler: the CPU kernels are not built")
@pytest.mark.parametrize("d,r", SHAPES)
def test_c_rope_write_kv_partial_is_bitwise_the_reference(d, r):
    gen, seed = fresh_generator()
    _, (q, k, v), kc, vc, slots, pos = _inputs(gen, torch.float32, d)
    table = build_cos_sin_cache(r, 300, 10000.0)
    want_q, want_k = reference.rotary_embedding(pos, q, k, table)
    want_kc, want_vc = kc.clone(), vc.clone()
    reference.write_kv_cache(want_k, v, want_kc, want_vc, slots)
    got_q = C.rope_write_kv(pos, q, k, v, table, kc, vc, slots)
    assert torch.equal(got_q, want_q), seed
    assert torch.equal(kc, want_kc) and torch.equal(vc, want_vc), seed


@pytest.mark.parametrize("backend", ["torch", "triton", "cpu"])
def test_every_backend_of_the_dispatcher(backend):
    if backend == "cpu" and C.library() is None:
        pytest.skip("no C compiler")
    gen, seed = fresh_generator()
    d, r = 64, 32
    qkv, (q, k, v), kc, vc, slots, pos = _inputs(gen, torch.float32, d)
    table = build_cos_sin_cache(r, 300, 10000.0)
    want_q, want_k = reference.rotary_embedding(pos, q, k, table)
    want_kc, want_vc = kc.clone(), vc.clone()
    reference.write_kv_cache(want_k, v, want_kc, want_vc, slots)
    dev = DEVICE if backend == "triton" else torch.device("cpu")
    q_d, k_d, v_d = _views(qkv.to(dev), 8, 2, d)
    kc_d, vc_d, pos_d, slots_d, table_d = (t.to(dev) for t in (kc, vc, pos, slots, table))
    rows = K.rope_rows(pos_d, table_d, backend=backend)
    got_q = K.rotary_embedding_write_kv(pos_d, q_d, k_d, v_d, table_d, kc_d, vc_d, slots_d,
                                        rows=rows, backend=backend)
    assert_close(got_q, want_q, torch.float32, seed, backend)
    assert_close(kc_d, want_kc, torch.float32, seed, backend)
    assert torch.equal(vc_d.cpu(), want_vc)


@pytest.mark.parametrize("width", [65, 66, 0])
def test_a_table_the_head_cannot_take_is_refused(width):
    gen, _ = fresh_generator()
    qkv, (q, k, v), kc, vc, slots, pos = _inputs(gen, torch.float32, 64)
    table = torch.zeros(300, width)
    q_d, k_d, v_d = _views(qkv.to(DEVICE), 8, 2, 64)
    with pytest.raises(ValueError, match="rotary dimension must be even and at most head_dim 64"):
        rotary_embedding(*on_device(pos), q_d, k_d, table.to(DEVICE))
    with pytest.raises(ValueError, match="rotary dimension must be even and at most head_dim 64"):
        rotary_embedding_write_kv(*on_device(pos), q_d, k_d, v_d, table.to(DEVICE),
                                  *on_device(kc, vc, slots))
