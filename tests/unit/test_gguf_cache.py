"""The GGUF header cache (engine/gguf_cache.py): a second read of a file comes from the cache
and equals the parse; a changed file (rewritten, or edited in place with its size and mtime
kept), a corrupt or truncated entry, or an entry of another format version is never trusted
(the header is parsed again and the entry rewritten); an unwritable cache costs only the
parse. The files are written by the tests (tests/gguf_files.py, the `gguf` package's writer)."""
from __future__ import annotations

import json
import os

import numpy as np
import pytest

from engine import gguf, gguf_cache
from tests.gguf_files import tiny_hf_dir, write_gguf


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    """A tiny Llama GGUF file (Q8_0 weights, a vocabulary, a chat template), written once."""
    hf = tiny_hf_dir("llama", tmp_path_factory.mktemp("hf"))
    path = tmp_path_factory.mktemp("gguf") / "m.gguf"
    write_gguf(hf, path, "Q8_0", pre="gpt2", chat_template="{{ messages }}")
    return path


@pytest.fixture
def cached(source, tmp_path, monkeypatch):
    """A copy of the file, its cache under a fresh XDG_CACHE_HOME, and a count of parses."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    path = tmp_path / "m.gguf"
    path.write_bytes(source.read_bytes())
    parses = []
    real = gguf._parse_header
    monkeypatch.setattr(gguf, "_parse_header", lambda buf, p: parses.append(p) or real(buf, p))
    return path, parses


def _same(a, b) -> None:
    assert a[0] == b[0]
    assert [(t.name, t.type_name, t.shape) for t in a[1]] == [(t.name, t.type_name, t.shape) for t in b[1]]
    assert all(t.data.dtype == u.data.dtype and np.array_equal(t.data, u.data) for t, u in zip(a[1], b[1]))


def test_the_second_read_comes_from_the_cache_and_equals_the_parse(cached):
    path, parses = cached
    first = gguf.read_gguf(path)
    assert len(parses) == 1 and gguf_cache.cache_file(path).exists()
    again = gguf.read_gguf(path)
    assert len(parses) == 1                      # not parsed again
    _same(first, again)
    assert first[0]["tokenizer.chat_template"] == "{{ messages }}"
    assert isinstance(first[0]["tokenizer.ggml.tokens"], list)


def test_a_rewritten_file_is_parsed_again(cached, source):
    path, parses = cached
    gguf.read_gguf(path)
    hf = tiny_hf_dir("llama", path.parent / "hf2")
    write_gguf(hf, path, "Q8_0", pre="gpt2", chat_template="{{ other }}")   # same path, new file
    meta, _ = gguf.read_gguf(path)
    assert len(parses) == 2 and meta["tokenizer.chat_template"] == "{{ other }}"
    gguf.read_gguf(path)
    assert len(parses) == 2                      # the new entry is used from then on


def test_a_file_edited_in_place_with_its_size_and_mtime_kept_is_parsed_again(cached):
    path, parses = cached
    gguf.read_gguf(path)
    st = path.stat()
    data = bytearray(path.read_bytes())
    at = data.index(b"{{ messages }}")
    data[at:at + 14] = b"{{ changed! }}"        # same length: same size
    path.write_bytes(bytes(data))
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))      # and the same mtime
    meta, _ = gguf.read_gguf(path)
    assert len(parses) == 2 and meta["tokenizer.chat_template"] == "{{ changed! }}"


@pytest.mark.parametrize("damage", ["flip a payload byte", "truncate", "garbage", "empty",
                                    "other version"])
def test_a_corrupt_entry_is_rebuilt_not_trusted(cached, damage):
    path, parses = cached
    want = gguf.read_gguf(path)
    entry = gguf_cache.cache_file(path)
    raw = entry.read_bytes()
    head, payload = raw.split(b"\n", 1)
    if damage == "flip a payload byte":          # still valid JSON: only the checksum tells
        at = payload.index(b"{{ messages }}")
        raw = head + b"\n" + payload[:at] + b"{{ massages }}" + payload[at + 14:]
    elif damage == "truncate":
        raw = raw[:len(raw) // 2]
    elif damage == "garbage":
        raw = b"\x00\xff not json \n at all"
    elif damage == "empty":
        raw = b""
    else:
        raw = json.dumps({**json.loads(head), "version": gguf_cache.VERSION + 1}).encode() + b"\n" + payload
    entry.write_bytes(raw)
    got = gguf.read_gguf(path)
    assert len(parses) == 2                      # parsed again, not read from the damaged entry
    _same(want, got)
    assert got[0]["tokenizer.chat_template"] == "{{ messages }}"
    gguf.read_gguf(path)
    assert len(parses) == 2                      # and the entry was rewritten whole


def test_an_unwritable_cache_costs_only_the_parse(cached, tmp_path, monkeypatch):
    path, parses = cached
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("a file where the cache folder would be")
    monkeypatch.setenv("XDG_CACHE_HOME", str(blocker))
    a, b = gguf.read_gguf(path), gguf.read_gguf(path)
    assert len(parses) == 2
    _same(a, b)


def test_entries_of_files_that_are_gone_are_dropped(cached, tmp_path):
    path, _ = cached
    other = tmp_path / "other.gguf"
    other.write_bytes(path.read_bytes())
    gguf.read_gguf(other)
    assert gguf_cache.cache_file(other).exists()
    other.unlink()
    gguf.read_gguf(path)                         # a miss writes an entry, and prunes
    assert not gguf_cache.cache_file(other).exists() and gguf_cache.cache_file(path).exists()


def test_the_type_table_is_the_gguf_packages():
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
    for kind, (name, block, size) in gguf._GGML_TYPES.items():
        t = GGMLQuantizationType(kind)
        assert (t.name, *GGML_QUANT_SIZES[t]) == (name, block, size)
