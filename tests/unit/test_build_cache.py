"""The build cache (engine/build_cache.py): a second engine of the same model comes from the
cached model and generates the same greedy tokens as the built one (a tiny tied Llama stored
as Q4_1, the default model's layout: int4 linears, an int8_g32 table and head; and the
default model itself where it is cached); another CPU, another model file (rewritten), other
engine options or other engine sources are misses; a corrupt, truncated or foreign entry is
ignored (built again, rewritten); a key change leaves one entry per model and kind; the JSON
entries (the prefill warm-up's cost) likewise."""
from __future__ import annotations

import json
import os

import pytest

from engine import LLM, SamplingParams, build_cache
from tests.gguf_files import tiny_hf_dir, write_gguf

PROMPTS = ["Hello there", "The capital of France is"]
GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    hf = tiny_hf_dir("llama-tied", tmp_path_factory.mktemp("hf"), initializer_range=0.2)
    path = tmp_path_factory.mktemp("gguf") / "m.gguf"
    write_gguf(hf, path, "Q4_1", pre="gpt2")
    return path


@pytest.fixture
def model(source, tmp_path, monkeypatch):
    """A copy of the file, with the build cache in a fresh folder (the CPU kernels' own cache
    stays where it is: not compiled again)."""
    monkeypatch.setattr(build_cache, "cache_dir", lambda: tmp_path / "cache")
    path = tmp_path / "m.gguf"
    path.write_bytes(source.read_bytes())
    return path


def _run(path, **kw):
    llm = LLM(path, num_blocks=32, block_size=8, **kw)
    return llm.engine.model_cache, [list(o.token_ids) for o in llm.generate(PROMPTS, GREEDY)]


def _entries(kind="model"):
    return sorted((build_cache.cache_dir() / "built").glob(f"{kind}-*"))


def test_the_second_engine_comes_from_the_cache_and_generates_the_same_tokens(model):
    how, built = _run(model)
    assert how == "miss" and [p.suffix for p in _entries()] == [".json", ".pt"]
    how, again = _run(model)
    assert how == "hit" and again == built and len(built[0]) == 10


def test_another_cpu_options_or_sources_are_misses(model, monkeypatch):
    _, built = _run(model)
    monkeypatch.setattr(build_cache, "cpu_id", lambda: "flags : another cpu")
    assert _run(model) == ("miss", built)
    assert _run(model, kernel_backend="torch")[0] == "miss"
    monkeypatch.setattr(build_cache, "code_id", lambda: "other engine sources")
    assert _run(model)[0] == "miss"
    assert len(_entries()) == 2            # one entry (a .pt and its stamp) per model and kind


def test_a_rewritten_model_file_is_a_miss(model, tmp_path):
    _, built = _run(model)
    hf = tiny_hf_dir("llama-tied", tmp_path / "hf2", initializer_range=0.3)
    write_gguf(hf, model, "Q4_1", pre="gpt2")     # same path, other weights
    how, other = _run(model)
    assert how == "miss" and other != built


@pytest.mark.parametrize("damage", ["flip", "truncate", "stamp"])
def test_a_corrupt_entry_is_ignored_and_rewritten(model, damage):
    _, built = _run(model)
    pt = next(p for p in _entries() if p.suffix == ".pt")
    if damage == "flip":
        with open(pt, "r+b") as f:
            f.seek(os.path.getsize(pt) // 2)
            byte = f.read(1)
            f.seek(-1, 1)
            f.write(bytes([byte[0] ^ 0xFF]))
    elif damage == "truncate":
        os.truncate(pt, os.path.getsize(pt) // 3)
    else:
        pt.with_suffix(".json").write_text("{not json")
    assert _run(model) == ("miss", built)
    assert _run(model) == ("hit", built)        # rewritten by the miss


def test_json_entries_keep_their_key_and_refuse_damage(model):
    from engine.config import EngineConfig, EngineOptions
    mc = EngineConfig.build(model, EngineOptions()).model
    key = build_cache.engine_key("prefill-cost", mc, threads=1)
    assert key != build_cache.engine_key("prefill-cost", mc, threads=2)
    assert build_cache.read_json("prefill-cost", model, key) is None
    build_cache.write_json("prefill-cost", model, key, {"samples": [[256, 0.5]]}, [str(model)])
    assert build_cache.read_json("prefill-cost", model, key) == {"samples": [[256, 0.5]]}
    entry, = _entries("prefill-cost")
    body = json.loads(entry.read_text())
    body["payload"]["samples"][0][1] = 0.1                   # edited: its checksum disagrees
    entry.write_text(json.dumps(body))
    assert build_cache.read_json("prefill-cost", model, key) is None
    entry.write_text("garbage")
    assert build_cache.read_json("prefill-cost", model, key) is None
    other = build_cache.engine_key("prefill-cost", mc, threads=2)
    build_cache.write_json("prefill-cost", model, other, {"samples": []}, [str(model)])
    assert [p.name for p in _entries("prefill-cost")] == [build_cache.entry(
        "prefill-cost", model, other, "json").name]          # the other key's entry replaced it


def test_the_default_model_from_the_cache_generates_the_same_tokens(tmp_path, monkeypatch, default_model_dir):
    files = sorted(default_model_dir.glob("*.gguf"))
    monkeypatch.setattr(build_cache, "cache_dir", lambda: tmp_path / "cache")
    how, built = _run(files[0])
    assert how == "miss"
    assert _run(files[0]) == ("hit", built)
