"""Backend selection in engine.kernels: each call names its backend; nothing is process-wide."""
import pytest
import torch

import engine.kernels as K
from engine.config import EngineOptions
from engine.kernels import reference
from kernel_testlib import fresh_generator, on_device, randn


def test_auto_uses_torch_on_cpu(monkeypatch):
    assert not K.use_triton(torch.zeros(1))                  # "auto" is the default
    assert not K.use_triton(torch.zeros(1), "auto")
    monkeypatch.setattr(K, "_triton_op", lambda *a: pytest.fail("Triton chosen for a CPU tensor"))
    gen, seed = fresh_generator()
    x = randn(gen, 3, 16)
    assert torch.equal(K.silu_and_mul(x), reference.silu_and_mul(x)), f"seed={seed}"
    out = torch.full((3, 8), float("nan"))
    assert K.silu_and_mul(x, out=out) is out and torch.equal(out, reference.silu_and_mul(x))


def test_forced_backends():
    gen, seed = fresh_generator()
    x, w = randn(gen, 4, 32), randn(gen, 32)
    assert K.use_triton(x, "triton")
    got = K.rms_norm(*on_device(x, w), 1e-6, backend="triton").cpu()
    assert not K.use_triton(x, "torch")
    torch.testing.assert_close(got, reference.rms_norm(x, w, 1e-6), msg=lambda m: f"seed={seed}: {m}")


def test_forced_torch_never_launches_triton(monkeypatch):
    monkeypatch.setattr(K, "_triton_op", lambda *a: pytest.fail("Triton chosen with backend='torch'"))
    gen, seed = fresh_generator()
    x, w = on_device(randn(gen, 4, 32), randn(gen, 32))
    torch.testing.assert_close(K.rms_norm(x, w, 1e-6, backend="torch").cpu(),
                               reference.rms_norm(x.cpu(), w.cpu(), 1e-6),
                               msg=lambda m: f"seed={seed}: {m}")


def test_bad_backend_name(tmp_path):
    from engine.config import ModelConfig
    from engine.models.llama import LlamaForCausalLM as CausalLM
    from tests.hf_models import make_hf_model
    with pytest.raises(ValueError, match="unknown kernel backend 'cuda'"):
        EngineOptions(kernel_backend="cuda")                # rejected where the config is built
    cfg = ModelConfig.from_dir(make_hf_model("llama", tmp_path / "m"))
    with pytest.raises(ValueError, match="unknown kernel backend 'cuda'"), torch.device("meta"):
        CausalLM(cfg, "cuda")                               # and by the model that carries it
    with torch.device("meta"):
        assert CausalLM(cfg, "triton").backend == "triton"
