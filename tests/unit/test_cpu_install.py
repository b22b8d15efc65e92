"""A CPU install without Triton: pdserve's own dependencies leave triton out (the `gpu` extra
carries it, and `dev`, which CI installs, takes that extra, so the kernel tests still run
there); a Triton kernel asked for without triton says how to get it."""
from __future__ import annotations

import sys
import tomllib
from pathlib import Path

import pytest
import torch

import engine.kernels as K

ROOT = Path(__file__).resolve().parents[2]


def test_triton_is_the_gpu_extra_and_dev_takes_it():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert not [d for d in project["dependencies"] if d.startswith("triton")]
    assert [d.split(";")[0].split(">=")[0] for d in project["optional-dependencies"]["gpu"]] == ["triton"]
    assert "pdserve[gpu]" in project["optional-dependencies"]["dev"]


def test_a_triton_kernel_without_triton_says_how_to_get_it(monkeypatch):
    monkeypatch.setitem(sys.modules, "triton", None)        # import triton: ModuleNotFoundError
    monkeypatch.delitem(sys.modules, "engine.kernels.norm", raising=False)
    with pytest.raises(ModuleNotFoundError, match=r"pip install 'pdserve\[gpu\]'") as e:
        K.rms_norm(torch.ones(2, 4), torch.ones(4), 1e-6, backend="triton")
    assert e.value.name == "triton"
    assert K.rms_norm(torch.ones(2, 4), torch.ones(4), 1e-6, backend="torch").shape == (2, 4)
