"""GGUF model files (llama.cpp's format), torch-free.

A GGUF file holds, in one file, what a Hugging Face directory spreads over several:

    metadata   general.architecture, {arch}.block_count, ...  -> `GGUFModel.hf_config()`,
               the config.json the engine's ModelConfig reads
               tokenizer.ggml.*, tokenizer.chat_template     -> `GGUFModel.tokenizer_parts()`
    tensors    blk.N.attn_q.weight, ... typed F32/F16/BF16/Q8_0/Q4_0/Q4_1/Q4_K/Q5_K/Q6_K
               -> `GGUFModel.raw_tensors()`: Hugging Face names, rows in Hugging Face order,
               data still in the file's type (the seam for keeping tensors quantized)
               -> `GGUFModel.tensors()`: the same, dequantized to float32

What differs per architecture (names, metadata, what llama.cpp's converter did to tensors:
Llama's q/k rows permuted per head, experts stacked into 3-D tensors, DeepSeek's kv_b_proj
split) lives in its map: engine/gguf_arch.py (the dense ones, the shared machinery) and
engine/gguf_moe.py (Qwen-MoE, DeepSeek-V3), registered in ARCHITECTURES below. Rows are whole
quantization blocks apart, so row permutations and per-expert slices keep quantized rows.

The header (metadata and tensor table) is parsed here with `struct`: the `gguf` package's
reader builds a numpy view per metadata item and took 7.5 s on SmolLM2's 49k-token
vocabulary, in every process that opened the file; this takes well under a second, and is
done once per file: the parse is cached on disk (engine/gguf_cache.py: keyed by the file's
path, size and mtime, trusted only while the file's header bytes and the entry's checksum
agree), so every later process (both workers and the gateway, every start) reads it. Tensor
data are numpy views of the memory-mapped file, shaped as the `gguf` reader shapes them (its
quantization tables and dequantizers are still used).

Anything this module cannot map (architecture, tensor type, tokenizer model or pre-tokenizer,
rope scaling) is a ValueError naming it. The module imports numpy and `gguf`, never torch:
the gateway reads tokenizers and configs through it.
"""
from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Iterator

import numpy as np

from . import gguf_cache
from .gguf_arch import TENSOR_TYPES, Gemma3, GGUFArch, Llama, RawTensor  # noqa: F401 (RawTensor: re-exported)
from .gguf_moe import Deepseek2, QwenMoe

# GGUF general.architecture -> its map (engine/gguf_arch.py, engine/gguf_moe.py): the Hugging
# Face architecture, config.json and tensors. Mistral files are written as "llama" by
# llama.cpp's converter; a "llama" file with experts is Mixtral.
ARCHITECTURES: dict[str, GGUFArch] = {
    "llama": Llama("LlamaForCausalLM"), "qwen2": Llama("Qwen2ForCausalLM"),
    "qwen3": Llama("Qwen3ForCausalLM"), "qwen2moe": QwenMoe("Qwen2MoeForCausalLM"),
    "qwen3moe": QwenMoe("Qwen3MoeForCausalLM"), "deepseek2": Deepseek2(), "gemma3": Gemma3()}
# tokenizer.ggml.pre -> the text split before byte-level BPE (llama.cpp's pre-tokenizer
# types). None: GPT-2's own split (the ByteLevel pre-tokenizer's regex).
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
PRE_TOKENIZERS = {"default": None, "gpt2": None, "smollm": "digits", "llama-bpe": _LLAMA3_SPLIT,
                  "llama3": _LLAMA3_SPLIT, "qwen2": _QWEN2_SPLIT,
                  "deepseek-r1-qwen": _QWEN2_SPLIT}
_CONTROL, _USER_DEFINED = 3, 4     # tokenizer.ggml.token_type values

def find_gguf(path: str | Path) -> Path | None:
    """The GGUF file `path` names: a *.gguf file, or a directory with no *.safetensors that
    holds exactly one *.gguf. None: `path` is not a GGUF model (a Hugging Face directory).
    A directory with several GGUF files is a ValueError (which one is meant?)."""
    p = Path(path).expanduser()
    if p.is_file() and p.suffix == ".gguf":
        return p
    if not p.is_dir() or any(p.glob("*.safetensors")):
        return None
    found = sorted(p.glob("*.gguf"))
    if len(found) > 1:
        raise ValueError(f"{p} holds several GGUF files ({', '.join(f.name for f in found)}): "
                         "pass the file itself")
    return found[0] if found else None


@dataclass
class GGUFTensor:
    name: str
    type_name: str            # the GGML type's name: F32, Q4_1, ...
    shape: tuple[int, ...]    # as GGUF lists it, the fastest dimension first
    data: np.ndarray          # a view of the file: float rows, or uint8 rows of quantized blocks


# GGUF metadata value types -> struct format (8: string, 9: array)
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
# GGML type number -> (name, values a block, bytes a block), as the `gguf` package has them
_GGML_TYPES = {0: ("F32", 1, 4), 1: ("F16", 1, 2), 30: ("BF16", 1, 2), 8: ("Q8_0", 32, 34),
               2: ("Q4_0", 32, 18), 3: ("Q4_1", 32, 20), 12: ("Q4_K", 256, 144),
               13: ("Q5_K", 256, 176), 14: ("Q6_K", 256, 210), 28: ("F64", 1, 8), 24: ("I8", 1, 1),
               25: ("I16", 1, 2), 26: ("I32", 1, 4), 27: ("I64", 1, 8)}
_FLOATS = {"F32": np.float32, "F16": np.float16, "F64": np.float64, "I8": np.int8,
           "I16": np.int16, "I32": np.int32, "I64": np.int64}


class _Reader:
    """Little-endian reads at a moving offset of a mapped file."""

    def __init__(self, buf, path):
        self.buf, self.path, self.at = buf, path, 0

    def take(self, fmt: str):
        v = struct.unpack_from("<" + fmt, self.buf, self.at)
        self.at += struct.calcsize("<" + fmt)
        return v[0] if len(v) == 1 else v

    def string(self) -> str:
        n = self.take("Q")
        self.at += n
        return self.buf[self.at - n:self.at].decode("utf-8", errors="replace")

    def value(self, kind: int):
        if kind == 8:
            return self.string()
        if kind == 9:
            item, n = self.take("IQ")
            if item in _SCALARS:                              # one unpack for the whole array
                return list(self.take(f"{n}{_SCALARS[item]}")) if n != 1 else [self.take(_SCALARS[item])]
            return [self.value(item) for _ in range(n)]
        if kind not in _SCALARS:
            raise ValueError(f"{self.path}: unknown GGUF metadata type {kind}")
        return self.take(_SCALARS[kind])


def read_gguf(path: str | Path) -> tuple[dict, list[GGUFTensor]]:
    """(metadata {key: value}, tensors) of a GGUF file (versions 2 and 3, little-endian)."""
    with open(path, "rb") as f:
        buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    if buf[:4] != b"GGUF":
        raise ValueError(f"{path}: not a GGUF file (magic {bytes(buf[:4])!r})")
    cached = gguf_cache.load(path, buf)
    if cached is None:
        meta, infos, start, header_len = _parse_header(buf, path)
        gguf_cache.store(path, buf, meta, infos, start, header_len)
    else:
        meta, infos, start = cached
    return meta, [GGUFTensor(name, _ggml_type(kind)[0], dims, _tensor_data(buf, dims, kind, start + offset))
                  for name, dims, kind, offset in infos]


def _ggml_type(kind: int) -> tuple[str, int, int]:
    """(name, values a block, bytes a block) of GGML type number `kind`: the table below,
    else the `gguf` package's (imported only then: it takes a while)."""
    if kind not in _GGML_TYPES:
        from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
        t = GGMLQuantizationType(kind)
        _GGML_TYPES[kind] = (t.name, *GGML_QUANT_SIZES[t])
    return _GGML_TYPES[kind]


def _parse_header(buf, path) -> tuple[dict, list, int, int]:
    """(metadata, [(name, dims, GGML type number, offset)], data start, header bytes read)."""
    r = _Reader(buf, path)
    r.at = 4
    version, n_tensors, n_kv = r.take("IQQ")
    if version not in (2, 3):
        raise ValueError(f"{path}: unsupported GGUF version {version}")
    meta = {}
    for _ in range(n_kv):
        key = r.string()
        meta[key] = r.value(r.take("I"))
    infos = []
    for _ in range(n_tensors):
        name = r.string()
        dims = r.take(f"{r.take('I')}Q")
        dims = (dims,) if isinstance(dims, int) else dims
        kind, offset = r.take("IQ")
        infos.append((name, tuple(dims), kind, offset))
    align = int(meta.get("general.alignment", 32))
    return meta, infos, -(-r.at // align) * align, r.at


def _tensor_data(buf, dims, kind: int, at: int) -> np.ndarray:
    """A tensor's bytes in the file: [rows..., cols] of its float type, or of whole blocks."""
    n = int(np.prod(dims))
    rows = tuple(reversed(dims))
    name, block, size = _ggml_type(kind)
    if name in _FLOATS:
        return np.frombuffer(buf, _FLOATS[name], n, at).reshape(rows)
    return np.frombuffer(buf, np.uint8, n * size // block, at).reshape(*rows[:-1], rows[-1] * size // block)


class GGUFModel:
    """A GGUF file's config, tokenizer and tensors. Use `open_gguf(path)` (cached)."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        try:
            self.meta, self.tensor_table = read_gguf(self.path)
        except (ValueError, OSError, struct.error) as e:
            raise ValueError(f"{self.path}: not a readable GGUF file ({e})") from None
        self.arch, self._config = self.get("general.architecture"), None
        if self.arch not in ARCHITECTURES:
            raise ValueError(f"{self.path.name}: unsupported GGUF architecture {self.arch!r}: "
                             f"supported are {sorted(ARCHITECTURES)}")

    def get(self, key: str, default=None):
        return self.meta.get(key, default)

    def arch_get(self, key: str, default=None):
        """Metadata `{general.architecture}.{key}`."""
        return self.get(f"{self.arch}.{key}", default)

    def hf_config(self) -> dict:
        """The config.json transformers would write for this model."""
        if self._config is None:
            self._config = ARCHITECTURES[self.arch].config(self)
        return dict(self._config)

    def raw_tensors(self) -> Iterator[RawTensor]:
        """Every tensor under its Hugging Face name, still in its stored type, rows in Hugging
        Face order (the architecture's map undoes what llama.cpp's converter did). An
        unsupported type or an unknown tensor name is a ValueError."""
        return ARCHITECTURES[self.arch].tensors(self, self.hf_config())

    def tensors(self) -> Iterator[tuple[str, np.ndarray]]:
        """(Hugging Face name, float32 array) for every tensor."""
        for raw in self.raw_tensors():
            yield raw.name, raw.dequantize()

    def tokenizer_parts(self):
        """(tokenizers.Tokenizer, tokenizer_config dict, chat templates, generation_config)
        rebuilt from tokenizer.ggml.*: only byte-level BPE (`gpt2`) vocabularies."""
        model = self.get("tokenizer.ggml.model")
        if model != "gpt2":
            raise ValueError(f"{self.path.name}: unsupported GGUF tokenizer model {model!r}: "
                             "only byte-level BPE ('gpt2') is supported")
        pre = self.get("tokenizer.ggml.pre", "default")
        if pre not in PRE_TOKENIZERS:
            raise ValueError(f"{self.path.name}: unsupported GGUF pre-tokenizer {pre!r}: "
                             f"supported are {sorted(PRE_TOKENIZERS)}")
        tokens = self.get("tokenizer.ggml.tokens")
        types = self.get("tokenizer.ggml.token_type") or []
        tok = _byte_level_bpe(tokens, self.get("tokenizer.ggml.merges") or [], types,
                              PRE_TOKENIZERS[pre])

        def token(key):
            i = self.get(f"tokenizer.ggml.{key}")
            return None if i is None or i >= len(tokens) else tokens[i]

        config = {"bos_token": token("bos_token_id"), "eos_token": token("eos_token_id"),
                  "pad_token": token("padding_token_id"), "unk_token": token("unknown_token_id"),
                  "add_bos_token": bool(self.get("tokenizer.ggml.add_bos_token", False)),
                  "model_max_length": self.arch_get("context_length")}
        templates = {}
        for key in self.meta:
            if key == "tokenizer.chat_template":
                templates["default"] = self.get(key)
            elif key.startswith("tokenizer.chat_template."):
                templates[key.removeprefix("tokenizer.chat_template.")] = self.get(key)
        eos = self.get("tokenizer.ggml.eos_token_id")
        return tok, config, templates, ({} if eos is None else {"eos_token_id": int(eos)})


def model_name(path: str | Path) -> str:
    """The name a model goes by (ModelConfig.name, the KV compat key's model, the pool a
    gateway checks its workers against): its directory's or GGUF file's name, less `.gguf`."""
    return Path(path).name.removesuffix(".gguf")


def open_gguf(path: str | Path) -> GGUFModel:
    """The GGUF model at `path` (a file, or a directory holding one; see find_gguf), parsed
    once per process and file."""
    f = find_gguf(path)
    if f is None:
        raise ValueError(f"{path}: no GGUF file found")
    return _open(f.resolve())


@lru_cache(maxsize=4)
def _open(f: Path) -> GGUFModel:
    return GGUFModel(f)


def _byte_level_bpe(tokens: list[str], merges: list[str], types: list[int], split):
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers

    tok = Tokenizer(models.BPE({t: i for i, t in enumerate(tokens)},
                               [tuple(m.split(" ", 1)) for m in merges], ignore_merges=False))
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=split is None)
    if split == "digits":        # each digit alone, then GPT-2's split (SmolLM's tokenizer)
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Digits(individual_digits=True),
             pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
    elif split is not None:
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Split(Regex(split), behavior="isolated"), byte_level])
    else:
        tok.pre_tokenizer = byte_level
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False)
                            for t, k in zip(tokens, types) if k == _CONTROL])
    tok.add_tokens([AddedToken(t, special=False, normalized=False)
                    for t, k in zip(tokens, types) if k == _USER_DEFINED])
    return tok
