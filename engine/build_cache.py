"""What a worker builds at every start and can reuse at the next, cached on disk beside the
GGUF header cache (engine/gguf_cache.py), keyed by everything the result depends on:

    $XDG_CACHE_HOME/pdserve/built/<kind>-<sha256(model path)[:12]>-<key[:20]>.<ext>
      model   the loaded, quantized CausalLM (load_model + quantize_model: the GGUF codes
              read, the int4 linears packed, the int8_g32 table built; 1.1-1.5 s of the
              default model's start-up on one thread, 3-7 s with both workers loading at
              once), its kernel backend settled (the C kernels' layouts: 0.37 s) and its
              bfloat16 copies made (engine/quant/amx.py: 0.31 s), as torch.save wrote it
              (.pt), read back with mmap (~0.1 s; the pages are the file's: the workers
              share them), beside a .json stamp
              {version, key, size, crc32} of that file
      other   a JSON entry {version, key, crc32, payload} (the prefill worker's warm-up
              cost: prefill_worker/server.py)

The key (`engine_key`) is a SHA-256 over: this format's version, the kind, the model's
files as they are now (resolved path, size, mtime_ns of the GGUF file, or of the
directory's config.json and *.safetensors), the whole ModelConfig, the engine options that
shape the result (dtype, device, kernel backend, quantization, ... as the caller names
them), the engine's own sources (engine/**/*.py and *.c: a change to any packing code is a
miss), torch's and Python's versions, and the CPU (its model name and flags line, as for
the CPU kernels' cache). An entry is used only when its stamp carries the same key and its
bytes have the recorded size and CRC-32; anything else (missing, torn, corrupt, another
key) is a miss: the caller builds again and the entry is rewritten (atomically: a
temporary file, then rename; the .pt before its stamp). Writing an entry removes the
entries of the same kind for the same model path (one per model and kind: a code change
does not pile up 120 MB files) and those of models that no longer exist. A cache that
cannot be written costs only the build. Only CPU models are cached (device "cpu").

The .pt entry is a pickle: it is trusted as the code is (a file in the user's own cache,
written by this code); never point XDG_CACHE_HOME at a directory others can write.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import platform
import sys
import tempfile
import zlib
from pathlib import Path
from typing import Callable

from .paths import cache_dir

log = logging.getLogger(__name__)

VERSION = 1
_ENGINE = Path(__file__).resolve().parent


def cpu_id() -> str:
    """The CPU's model name and flags lines (what code or layouts built here may rely on)."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return platform.processor() or platform.machine()
    pick = [next((x for x in lines if x.startswith(k)), "") for k in ("model name", ("flags", "Features"))]
    return "\n".join(pick)


def code_id() -> str:
    """SHA-256 of the engine's own sources (every .py and .c under engine/)."""
    h = hashlib.sha256()
    for f in sorted(p for p in _ENGINE.rglob("*") if p.suffix in (".py", ".c")):
        h.update(str(f.relative_to(_ENGINE)).encode() + b"\0" + f.read_bytes() + b"\0")
    return h.hexdigest()


def model_files(model_dir: str | Path) -> list[Path]:
    """The files a model is read from: its GGUF file, or its config.json and *.safetensors."""
    from .gguf import find_gguf
    f = find_gguf(model_dir)
    if f is not None:
        return [Path(f).resolve()]
    d = Path(model_dir).resolve()
    return sorted(p for p in d.iterdir() if p.name == "config.json" or p.suffix == ".safetensors")


def engine_key(kind: str, model_config, **parts) -> str:
    """The key of `kind` built from the model `model_config` (a ModelConfig) with `parts`
    (the options that shape it, JSON-able or str-able)."""
    files = [(str(p), p.stat().st_size, p.stat().st_mtime_ns) for p in model_files(model_config.model_dir)]
    torch = sys.modules.get("torch")
    text = json.dumps({"version": VERSION, "kind": kind, "files": files,
                       "model": dataclasses.asdict(model_config), "parts": parts, "code": code_id(),
                       "torch": getattr(torch, "__version__", ""), "python": sys.version,
                       "cpu": cpu_id()}, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()


def entry(kind: str, model_dir: str | Path, key: str, ext: str) -> Path:
    """Where the entry of `kind` for `model_dir` under `key` lives."""
    who = hashlib.sha256(str(Path(model_dir).resolve()).encode()).hexdigest()[:12]
    return cache_dir() / "built" / f"{kind}-{who}-{key[:20]}.{ext}"


def _crc(path: Path) -> int:
    crc = 0
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            crc = zlib.crc32(chunk, crc)
    return crc


def _replace(path: Path, write: Callable[[str], None]) -> None:
    """`write(tmp)` a temporary file beside `path`, then rename it to `path`."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
    os.close(fd)
    try:
        write(tmp)
        os.replace(tmp, path)
    finally:
        Path(tmp).unlink(missing_ok=True)


def _prune(kind: str, keep: Path) -> None:
    """Drop the other entries of `keep`'s kind and model, and those of models that are gone."""
    prefix = keep.name.rpartition("-")[0] + "-"          # <kind>-<model hash>-
    for f in keep.parent.glob(f"{kind}-*"):
        if f.name.endswith(".tmp") or f.stem == keep.stem:
            continue
        if f.name.startswith(prefix) or (f.suffix == ".json" and _model_gone(f)):
            for g in (f.with_suffix(".pt"), f.with_suffix(".json")):
                g.unlink(missing_ok=True)


def _model_gone(stamp: Path) -> bool:
    try:
        return not all(Path(p).exists() for p in json.loads(stamp.read_text()).get("files", []))
    except (OSError, ValueError, AttributeError):
        return True


def read_json(kind: str, model_dir, key: str) -> dict | None:
    """The payload of a JSON entry, if it is there and trusted; else None."""
    path = entry(kind, model_dir, key, "json")
    try:
        body = json.loads(path.read_text())
        payload = json.dumps(body["payload"], sort_keys=True)
        if body.get("version") != VERSION or body.get("key") != key:
            raise ValueError("another key")
        if zlib.crc32(payload.encode()) != body.get("crc32"):
            raise ValueError("checksum mismatch")
        return body["payload"]
    except FileNotFoundError:
        return None
    except (OSError, ValueError, TypeError, KeyError) as e:
        log.info("build cache %s: not used (%s)", path.name, e)
        return None


def write_json(kind: str, model_dir, key: str, payload: dict, files: list[str] = ()) -> None:
    """Store a JSON entry (best effort: a cache that cannot be written is logged, skipped)."""
    path = entry(kind, model_dir, key, "json")
    text = json.dumps(payload, sort_keys=True)
    body = {"version": VERSION, "key": key, "crc32": zlib.crc32(text.encode()),
            "files": list(files), "payload": payload}
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        _replace(path, lambda tmp: Path(tmp).write_text(json.dumps(body)))
        _prune(kind, path)
    except (OSError, TypeError, ValueError) as e:
        log.info("build cache %s not written: %s", path.name, e)


def build_model(config):
    """The model entry's recipe: loaded and quantized, on the kernel backend the KV cache will
    settle it on (CausalLM.settle_backend: the C kernels' layouts), with its bfloat16 copies
    (engine/quant/amx.py)."""
    from .loader import load_model
    from .quant import amx
    from .quant.quantize import quantize_model
    model = quantize_model(load_model(config.model, config.torch_dtype, config.device,
                                      config.kernel_backend, config.quantization), config.quantization)
    model.settle_backend(config.device, config.kv_torch_dtype)
    amx.attach(model, config.amx_weights, config.amx_weights_max_gb, config.amx_min_rows, config.device)
    return model


def cached_model(config, build: Callable[[], object]):
    """The model `build()` makes for EngineConfig `config`, from the cache when an entry with
    its key is there and intact, else built and stored. Returns (model, "hit" | "miss" |
    "off": not a CPU model)."""
    if config.device != "cpu":
        return build(), "off"
    import torch
    key = engine_key("model", config.model, dtype=str(config.torch_dtype), device=config.device,
                     kernel_backend=config.kernel_backend, quantization=config.quantization,
                     kv_dtype=str(config.kv_torch_dtype), amx_weights=config.amx_weights,
                     amx_weights_max_gb=config.amx_weights_max_gb, amx_min_rows=config.amx_min_rows)
    pt = entry("model", config.model.model_dir, key, "pt")
    model = _load_model(pt, key)
    if model is not None:
        return model, "hit"
    model = build()
    try:
        pt.parent.mkdir(parents=True, exist_ok=True)
        _replace(pt, lambda tmp: torch.save(model, tmp))
        stamp = {"version": VERSION, "key": key, "size": pt.stat().st_size, "crc32": _crc(pt),
                 "files": [str(p) for p in model_files(config.model.model_dir)]}
        _replace(pt.with_suffix(".json"), lambda tmp: Path(tmp).write_text(json.dumps(stamp)))
        _prune("model", pt)
    except Exception as e:      # noqa: BLE001 -- a model that cannot be pickled is just not cached
        log.info("build cache: model not cached (%r)", e)
        pt.unlink(missing_ok=True)
    return model, "miss"


def _load_model(pt: Path, key: str):
    import torch
    try:
        stamp = json.loads(pt.with_suffix(".json").read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as e:
        log.info("build cache %s: unreadable stamp (%s); building again", pt.name, e)
        return None
    try:
        if stamp.get("version") != VERSION or stamp.get("key") != key:
            raise ValueError("another key")
        if pt.stat().st_size != stamp.get("size") or _crc(pt) != stamp.get("crc32"):
            raise ValueError("size or checksum mismatch")
        return torch.load(pt, mmap=True, weights_only=False)
    except Exception as e:      # noqa: BLE001 -- a torn or foreign entry is a miss, never fatal
        log.info("build cache %s: not used (%r); building again", pt.name, e)
        return None
