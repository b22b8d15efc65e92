"""rms_norm, rotary_embedding, silu_and_mul, write_kv_cache (Triton) against the references,
and the rotary cache builder against Hugging Face."""
import pytest
import torch

from engine.kernels import reference
from engine.kernels.activation import silu_and_mul
from engine.kernels.kv_cache import write_kv_cache
from engine.kernels.norm import rms_norm
from engine.kernels.rope import build_cos_sin_cache
from engine.kernels.rotary import rotary_embedding
from kernel_testlib import DEVICE, assert_close, fresh_generator, on_device, poisoned, randn

DTYPES = [torch.float32, torch.bfloat16]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("fused", [False, True])
def test_rms_norm(dtype, fused):
    gen, seed = fresh_generator()
    x = randn(gen, 2, 5, 200, dtype=dtype)            # 200: not a power of two
    w = randn(gen, 200, dtype=dtype)
    res = randn(gen, 2, 5, 200, dtype=dtype) if fused else None
    want = reference.rms_norm(x, w, 1e-5, res)
    out = poisoned(x).to(DEVICE)
    if fused:
        rout = poisoned(x).to(DEVICE)
        got = rms_norm(*on_device(x, w), 1e-5, *on_device(res), out=out, residual_out=rout)
        assert got[0] is out and got[1] is rout
        assert_close(got[0], want[0], dtype, seed, "rms_norm out")
        assert_close(got[1], want[1], dtype, seed, "rms_norm residual")
    else:
        got = rms_norm(*on_device(x, w), 1e-5, out=out)
        assert_close(got, want, dtype, seed, "rms_norm")


def test_rms_norm_in_place_and_fp32_weight():
    gen, seed = fresh_generator()
    x = randn(gen, 7, 64, dtype=torch.bfloat16)
    res = randn(gen, 7, 64, dtype=torch.bfloat16)
    w = randn(gen, 64)                                 # fp32 weight: output promotes to fp32
    want_out, want_res = reference.rms_norm(x, w, 1e-6, res)
    res_d = res.to(DEVICE)
    out, new_res = rms_norm(*on_device(x, w), 1e-6, res_d, residual_out=res_d)
    assert out.dtype == torch.float32 and new_res is res_d
    assert_close(out, want_out, torch.bfloat16, seed, "fp32 weight")
    assert_close(new_res, want_res, torch.bfloat16, seed, "in-place residual")


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_per_head_on_a_qkv_view(dtype):
    """Qwen3's / GLM's per-head q norm: x [T, H, D] a view into fused qkv rows, which no
    [T*H, D] view covers (it was refused: the Triton backend could not run those models)."""
    gen, seed = fresh_generator()
    qkv = randn(gen, 5, 3 * 4 * 24, dtype=dtype)
    q = qkv[:, :4 * 24].view(5, 4, 24)
    w = randn(gen, 24, dtype=dtype)
    got = rms_norm(on_device(qkv)[0][:, :4 * 24].view(5, 4, 24), *on_device(w), 1e-6)
    assert_close(got, reference.rms_norm(q, w, 1e-6), dtype, seed, "per-head rms_norm")


@pytest.mark.parametrize("dtype", DTYPES)
def test_rotary_embedding_on_qkv_views(dtype):
    gen, seed = fresh_generator()
    t, hq, hk, d = 9, 8, 2, 64
    qkv = randn(gen, t, (hq + 2 * hk) * d, dtype=dtype)   # q and k are strided views of it
    q = qkv[:, :hq * d].view(t, hq, d)
    k = qkv[:, hq * d:(hq + hk) * d].view(t, hk, d)
    cache = build_cos_sin_cache(d, 300, 10000.0)
    pos = torch.randint(0, 300, (t,), generator=gen)
    want_q, want_k = reference.rotary_embedding(pos, q, k, cache)
    qkv_d = qkv.to(DEVICE)
    q_d = qkv_d[:, :hq * d].view(t, hq, d)
    k_d = qkv_d[:, hq * d:(hq + hk) * d].view(t, hk, d)
    pos_d, cache_d = on_device(pos, cache)
    got_q, got_k = rotary_embedding(pos_d.int(), q_d, k_d, cache_d, q_out=poisoned(q_d),
                                    k_out=poisoned(k_d))
    assert_close(got_q, want_q, dtype, seed, "rotary q")
    assert_close(got_k, want_k, dtype, seed, "rotary k")
    rotary_embedding(pos_d, q_d, k_d, cache_d, q_out=q_d, k_out=k_d)             # in place
    assert_close(q_d, want_q, dtype, seed, "rotary in place q")
    assert_close(k_d, want_k, dtype, seed, "rotary in place k")


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_and_mul(dtype):
    gen, seed = fresh_generator()
    x = randn(gen, 3, 4, 2 * 1500, dtype=dtype, scale=3.0)     # I = 1500: two column blocks
    out = silu_and_mul(x.to(DEVICE), out=poisoned(x[..., :1500]).to(DEVICE))
    assert_close(out, reference.silu_and_mul(x), dtype, seed, "silu_and_mul")


@pytest.mark.parametrize("dtype", DTYPES)
def test_write_kv_cache(dtype):
    gen, seed = fresh_generator()
    nb, bs, h, d = 6, 16, 2, 32
    kc = randn(gen, nb, bs, h, d, dtype=dtype)
    vc = randn(gen, nb, bs, h, d, dtype=dtype)
    kv = randn(gen, 11, 2, h, d, dtype=dtype)
    k, v = kv[:, 0], kv[:, 1]                           # non-contiguous token stride
    slots = torch.randperm(nb * bs, generator=gen)[:11]
    slots[[2, 7]] = -1                                  # padding tokens: skipped
    want_k, want_v = kc.clone(), vc.clone()
    reference.write_kv_cache(k, v, want_k, want_v, slots)
    kc, vc = on_device(kc, vc)
    write_kv_cache(*on_device(k, v), kc, vc, slots.int().to(DEVICE))
    kc, vc = kc.cpu(), vc.cpu()
    assert torch.equal(kc, want_k) and torch.equal(vc, want_v), f"seed={seed}"
    # an fp32 source is cast to the cache dtype (the interpreter truncates fp32 -> bf16 where
    # the GPU rounds to nearest, hence a tolerance rather than equality)
    k32, v32 = randn(gen, 11, h, d), randn(gen, 11, h, d)
    reference.write_kv_cache(k32, v32, want_k, want_v, slots)
    kc, vc = on_device(kc, vc)
    write_kv_cache(*on_device(k32, v32), kc, vc, slots.to(DEVICE))
    assert_close(kc, want_k, dtype, seed, "cast k")
    assert_close(vc, want_v, dtype, seed, "cast v")


def test_write_kv_cache_int32_overflow_offsets():
    """> 2^31 elements per cache, slots near the end of the pool (lazily committed memory)."""
    gen, seed = fresh_generator()
    bs, h, d = 16, 2, 64
    nb = (2 ** 31) // (bs * h * d) + 16
    kc = torch.empty(nb, bs, h, d, dtype=torch.bfloat16, device=DEVICE)
    vc = torch.empty(nb, bs, h, d, dtype=torch.bfloat16, device=DEVICE)
    assert kc.numel() > 2 ** 31
    slots = torch.tensor([(nb - 1) * bs + 15, (nb - 5) * bs + 3, -1, (nb - 16) * bs], dtype=torch.int64)
    k = randn(gen, 4, h, d, dtype=torch.bfloat16)
    v = randn(gen, 4, h, d, dtype=torch.bfloat16)
    write_kv_cache(*on_device(k, v), kc, vc, slots.to(DEVICE))
    for i, s in enumerate(slots.tolist()):
        if s >= 0:
            assert torch.equal(kc[s // bs, s % bs].cpu(), k[i]), f"seed={seed} slot={s}"
            assert torch.equal(vc[s // bs, s % bs].cpu(), v[i]), f"seed={seed} slot={s}"


def test_write_kv_cache_checks_shapes():
    kc, k, slots = on_device(torch.zeros(2, 4, 2, 8), torch.zeros(3, 1, 8), torch.zeros(3, dtype=torch.int32))
    with pytest.raises(ValueError, match="k has shape"):
        write_kv_cache(k, k, kc, kc.clone(), slots)


@pytest.mark.parametrize("scaling", [None, {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                            "high_freq_factor": 4.0,
                                            "original_max_position_embeddings": 64}])
def test_cos_sin_cache_matches_hugging_face(scaling):
    transformers = pytest.importorskip("transformers")
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding
    params = {"rope_type": "default", "rope_theta": 500000.0, **(scaling or {})}
    cfg = transformers.LlamaConfig(hidden_size=512, num_attention_heads=4, max_position_embeddings=300,
                                   rope_parameters=params)
    pos = torch.arange(300)
    cos, sin = LlamaRotaryEmbedding(cfg)(torch.zeros(1, 300, 128), pos[None])
    cache = build_cos_sin_cache(128, 300, 500000.0, scaling)
    assert torch.equal(cache[:, :64], cos[0, :, :64]) and torch.equal(cache[:, 64:], sin[0, :, :64])


def test_cos_sin_cache_unknown_scaling():
    with pytest.raises(NotImplementedError, match="dynamic"):     # yarn and linear are known now
        build_cos_sin_cache(64, 8, 10000.0, {"rope_type": "dynamic", "factor": 4.0})
