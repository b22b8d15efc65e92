"""Where pdserve keeps what it builds or fetches on a machine (stdlib only: engine.config
re-exports it, and engine/gguf_cache.py, below engine.config, uses it)."""
from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    """Where pdserve keeps what it builds or fetches on a machine (the CPU kernels, the
    default models): $XDG_CACHE_HOME/pdserve, by default ~/.cache/pdserve. The one rule."""
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "pdserve"
