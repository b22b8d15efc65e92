"""KV cache sizing from the device's free memory (gpu_memory_utilization), with a fake
device-memory query: the block count follows the fraction, is logged, and is exported."""
from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client import generate_latest

from engine import memory
from engine.config import CacheConfig
from engine.llm_engine import LLMEngine
from services.metrics import Metrics

GIB = 2**30


@pytest.fixture(scope="module")
def model_dir():
    from engine.tiny_model import ensure_default_model
    return ensure_default_model()


def _bytes_per_block(model_dir: Path, block_size: int) -> int:
    """From config.json, as the cache is laid out: layers x (K, V) x tokens x KV heads x
    head dim, float32 (the CPU default dtype)."""
    c = json.loads((model_dir / "config.json").read_text())
    head_dim = c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]
    kv_heads = c.get("num_key_value_heads") or c["num_attention_heads"]
    return c["num_hidden_layers"] * 2 * block_size * kv_heads * head_dim * 4


@pytest.fixture
def fake_device(monkeypatch):
    """The device reports `state["free"]` of 80 GiB free; the calls are recorded."""
    state = {"free": 8 * GIB, "calls": []}

    def query(device):
        state["calls"].append(device)
        return state["free"], 80 * GIB

    monkeypatch.setattr(memory, "free_device_memory", query)
    return state


@pytest.mark.parametrize("fraction,free_mib", [(0.5, 64), (0.25, 64), (0.9, 3)])
def test_block_count_follows_the_fraction_of_free_memory(model_dir, fake_device, caplog,
                                                         fraction, free_mib):
    fake_device["free"] = free_mib * 2**20
    with caplog.at_level(logging.INFO, logger="engine.memory"):
        eng = LLMEngine.from_model_dir(model_dir, block_size=16, max_num_seqs=100_000,
                                       gpu_memory_utilization=fraction)
    expected = int(free_mib * 2**20 * fraction) // _bytes_per_block(model_dir, 16)
    assert fake_device["calls"] == ["cpu"]
    assert eng.num_blocks == expected > 0
    assert eng.kv_cache.shape[2] == expected
    assert any(f"{expected} blocks" in r.getMessage() for r in caplog.records), caplog.text
    m = Metrics("decode")
    m.set_engine_stats(eng.stats())
    samples = {s.name: s.value for f in text_string_to_metric_families(
        generate_latest(m.registry).decode()) for s in f.samples}
    assert samples["pdserve:kv_cache_blocks"] == expected


def test_too_little_free_memory_is_a_clear_error(model_dir, fake_device):
    fake_device["free"] = 1000
    with pytest.raises(ValueError, match="no room for one KV block"):
        LLMEngine.from_model_dir(model_dir, gpu_memory_utilization=0.5)


def test_fraction_unset_keeps_the_fixed_size(model_dir, fake_device):
    eng = LLMEngine.from_model_dir(model_dir, block_size=16, max_num_seqs=100_000,
                                   kv_cache_memory_gb=0.001)
    assert fake_device["calls"] == []
    assert eng.num_blocks == int(0.001 * GIB) // _bytes_per_block(model_dir, 16)


def test_real_query_refuses_a_cpu_device():
    with pytest.raises(ValueError, match="CUDA"):
        memory.free_device_memory("cpu")


@pytest.mark.parametrize("bad", [-0.1, 1.0, 1.5])
def test_fraction_out_of_range(bad):
    with pytest.raises(ValueError, match="gpu_memory_utilization"):
        CacheConfig(gpu_memory_utilization=bad)
