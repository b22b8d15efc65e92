"""kvtransfer.wire: header round trip, compat key checks."""
import pytest
import torch

from kvtransfer.wire import (HEADER_BYTES, PROTOCOL_VERSION, CompatKey, Header, IncompatibleKV,
                             MsgType, WireError, ids_bytes, layer_body_bytes)


def test_header_round_trip():
    h = Header(MsgType.LAYER, "req-1/t", layer=31, block_offset=5, num_blocks=7, body_bytes=1 << 33)
    data = h.pack()
    assert len(data) == HEADER_BYTES == 96
    assert Header.unpack(data) == h


def test_header_rejects_garbage_and_long_ids():
    with pytest.raises(WireError, match="magic"):
        Header.unpack(b"XXXX" + bytes(92))
    with pytest.raises(WireError, match="96"):
        Header.unpack(bytes(10))
    with pytest.raises(ValueError, match="64 bytes"):
        Header(MsgType.LAYER, "x" * 65).pack()


def test_compat_check_names_both_sides():
    a = CompatKey("llama", "bfloat16", 16, 32, 8, 128)
    b = CompatKey("llama", "float16", 32, 32, 8, 128)
    a.check(CompatKey.from_json(a.to_json()))
    with pytest.raises(IncompatibleKV) as e:
        a.check(b, "prefill", "decode")
    msg = str(e.value)
    assert "dtype: prefill='bfloat16' decode='float16'" in msg
    assert "block_size: prefill=16 decode=32" in msg
    assert msg.split("); ")[0].count(": ") == 2  # only the two differing fields listed


def test_compat_from_cache_and_sizes():
    cache = torch.zeros(3, 2, 10, 4, 2, 8, dtype=torch.bfloat16)
    key = CompatKey.from_cache(cache, "m")
    assert key == CompatKey("m", "bfloat16", 4, 3, 2, 8, PROTOCOL_VERSION,
                            layout="gqa(kv_heads=2, head_dim=8)")
    assert ids_bytes(1) == 64 and ids_bytes(16) == 64 and ids_bytes(17) == 128
    assert layer_body_bytes(cache, 3) == 64 + 3 * 2 * 4 * 2 * 8 * 2
    with pytest.raises(ValueError, match="shape"):
        CompatKey.from_cache(torch.zeros(3, 10, 4), "m")


def test_layout_names_latent_windows_and_sinks(tmp_path):
    """The handshake's layout string (ModelConfig.kv_layout) names what two caches must share
    beyond their shapes: MLA's ranks, each layer's window, sinks; a one-part latent cache
    sizes its blocks as one part."""
    from engine.config import MlaConfig, ModelConfig
    base = dict(model_dir="m", architecture="x", vocab_size=8, hidden_size=8, intermediate_size=8,
                num_layers=3, num_heads=2, num_kv_heads=1, head_dim=4, rms_norm_eps=1e-6,
                rope_theta=1e4, rope_scaling=None, max_position_embeddings=64,
                tie_word_embeddings=False, qkv_bias=False, qk_norm=False, max_model_len=64)
    assert ModelConfig(**base).kv_layout() == "gqa(kv_heads=1, head_dim=4)"
    hybrid = ModelConfig(**base, sliding_window=8, attention_sinks=True,
                         layer_types=["sliding_attention", "full_attention", "sliding_attention"])
    assert hybrid.kv_layout() == "gqa(kv_heads=1, head_dim=4, window=8 on layers 0,2, sinks)"
    assert ModelConfig(**base, sliding_window=8).kv_layout() == "gqa(kv_heads=1, head_dim=4, window=8 on all layers)"
    mla = ModelConfig(**base, mla=MlaConfig(None, 32, 16, 8, 16))
    assert mla.kv_layout() == "mla(kv_lora_rank=32, rope_dim=8)" and mla.kv_block_shape() == (1, 1, 40)
    cache = torch.zeros(3, 1, 10, 4, 1, 40)
    key = CompatKey.from_cache(cache, "m", layout=mla.kv_layout())
    assert layer_body_bytes(cache, 3) == 64 + 3 * 4 * 40 * 4
    other = CompatKey.from_cache(torch.zeros(3, 2, 10, 4, 1, 20), "m", layout="gqa(kv_heads=1, head_dim=20)")
    with pytest.raises(IncompatibleKV) as e:
        key.check(other, "prefill", "decode")
    assert "layout: prefill='mla(kv_lora_rank=32, rope_dim=8)' decode='gqa(kv_heads=1, head_dim=20)'" in str(e.value)
