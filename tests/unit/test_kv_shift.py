"""The K shift of an 8-bit KV cache (engine/kv_calibration.py): attention over keys stored
minus a constant equals float attention over the original keys (softmax's shift invariance),
with a smaller fp8 error when K sits on a large per-channel offset; the engine's shift is the
mean K of the calibration prompt as the float-cache engine computes it, and calibration
leaves the cache and its scales empty."""
import pytest
import torch

from engine.kernels import reference as R
from engine.kv_calibration import calibration_ids


def _attention_error(shift, offset, gen):
    nb, bs, h, hq, d, n = 8, 8, 2, 4, 32, 60
    k = torch.randn(n, h, d, generator=gen) + offset        # K on a large per-channel offset
    v = torch.randn(n, h, d, generator=gen)
    q = torch.randn(n, hq, d, generator=gen)
    slots = torch.arange(n)
    table = torch.arange(nb, dtype=torch.int32)[None]
    cu, ctx = torch.tensor([0, n], dtype=torch.int32), torch.tensor([n], dtype=torch.int32)
    fk, fv = torch.zeros(nb, bs, h, d), torch.zeros(nb, bs, h, d)
    R.write_kv_cache(k, v, fk, fv, slots)
    want = R.paged_prefill_attention(q, fk, fv, table, cu, ctx, d ** -0.5)
    kc, vc = (torch.zeros(nb, bs, h, d, dtype=torch.float8_e4m3fn) for _ in range(2))
    ks, vs = torch.zeros(nb, h), torch.zeros(nb, h)
    R.write_kv_cache_quant(k, v, kc, vc, ks, vs, slots, shift)
    got = R.paged_prefill_attention(q, kc, vc, table, cu, ctx, d ** -0.5, ks, vs)
    return ((got - want).abs().max() / want.abs().max()).item()


def test_shifted_fp8_keys_give_float_attention_with_less_error():
    gen = torch.Generator().manual_seed(0)
    offset = torch.zeros(2, 32)
    offset[:, [3, 17, 30]] = torch.tensor([12.0, -9.0, 15.0])
    plain = _attention_error(None, offset, torch.Generator().manual_seed(1))
    # a shift near the offset (as calibration finds it, not exactly it)
    shift = (offset + 0.3 * torch.randn(2, 32, generator=gen)).contiguous()
    shifted = _attention_error(shift, offset, torch.Generator().manual_seed(1))
    # the same keys without their offset: fp8's own error, which the shifted cache matches
    # (so the shift itself changed no attention output), where the offset alone triples it
    floor = _attention_error(None, torch.zeros(2, 32), torch.Generator().manual_seed(1))
    assert shifted < 1.25 * floor, (shifted, floor)
    assert plain > 2 * shifted, (shifted, plain)


@pytest.fixture(scope="module")
def model_dir():
    from engine.tiny_model import ensure_default_model
    return str(ensure_default_model())


@pytest.mark.parametrize("kv", ["fp8_e4m3", "int8"])
def test_engine_shift_is_the_calibration_prompts_mean_k(model_dir, kv):
    from engine.offline import LLM
    from engine.sampling_params import SamplingParams
    from engine.kv_calibration import CALIBRATION_TOKENS
    q8 = LLM(model_dir, num_blocks=64, block_size=16, kv_cache_dtype=kv).engine
    shift = q8.runner.k_shift
    c = q8.config.model
    assert shift.shape == (c.num_layers, c.num_kv_heads, c.head_dim) and shift.dtype == torch.float32
    assert not q8.kv_cache.view(torch.int8).any() and not q8.kv_scales.any()   # cleaned up
    for layer, s in zip(q8.model.layers, shift):
        assert torch.equal(layer.self_attn.k_shift, s)
    # the float-cache engine prefills the same ids; every written row of its fresh cache is
    # one of the prompt's tokens (the sampled token is never written)
    f = LLM(model_dir, num_blocks=64, block_size=16)   # 1024 slots
    f.generate([calibration_ids(c.vocab_size)], SamplingParams(temperature=0.0, max_tokens=1))
    k = f.engine.kv_cache[:, 0].flatten(1, 2)                        # [L, slots, H, D]
    written = k.abs().amax((0, 2, 3)) > 0
    assert int(written.sum()) == min(CALIBRATION_TOKENS, c.max_model_len)
    want = k[:, written].mean(1)
    assert shift.abs().max() > 0.1                                   # an offset worth removing
    # within 5% of the largest entry: the 8-bit engine's later layers see K computed from
    # earlier layers' quantized KV (measured: 3.2% of it at most for fp8)
    torch.testing.assert_close(shift, want, atol=0.05 * want.abs().max().item(), rtol=0)
