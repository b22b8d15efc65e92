"""The fused-dequantization GEMMs (engine/kernels/quant_matmul.py) against dequantize-then-
matmul in fp32: odd shapes, K not a multiple of the tile, group boundaries inside a K tile,
all-zero weight rows, M = 0, and split K (partial sums meeting by atomic add)."""
import pytest
import torch

from engine.kernels import quant_matmul as qm
from engine.quant.fp8 import quantize_fp8
from engine.quant.int4 import quantize_int4
from engine.quant.int8 import quantize_int8
from tests.kernels.kernel_testlib import DEVICE, assert_close, fresh_generator, on_device, randn

SHAPES = [(1, 70, 96), (3, 33, 160), (17, 130, 256), (5, 64, 384)]     # (M, N, K)


def _weight(gen, n, k):
    w = randn(gen, n, k)
    w[n // 3] = 0.0                    # a zero row: scale 0 must give exact zeros
    return w


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("m,n,k", SHAPES)
@pytest.mark.parametrize("kind", ["int8", "fp8"])
def test_w8_matmul(kind, m, n, k, dtype):
    gen, seed = fresh_generator()
    qw = (quantize_int8 if kind == "int8" else quantize_fp8)(_weight(gen, n, k))
    x = randn(gen, m, k, dtype=dtype)
    want = x.float() @ (qw.q.float() * qw.scale[:, None]).T
    xd, qd, sd = on_device(x, qw.q, qw.scale)
    got = qm.w8_matmul(xd, qd, sd)
    assert got.dtype == dtype and got.shape == (m, n)
    assert_close(got, want, dtype, seed, f"{kind} {m}x{n}x{k}")
    assert not got[:, n // 3].float().any()
    assert_close(qm.w8_matmul_reference(x, qw.q, qw.scale), want, dtype, seed, "reference")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("m,n,k", SHAPES)
@pytest.mark.parametrize("group", [32, 128])
def test_int4_matmul(group, m, n, k, dtype):
    if k % group:
        pytest.skip("K is not a multiple of the group")
    gen, seed = fresh_generator()
    w = _weight(gen, n, k)
    w[:, group - 3:group + 3] *= 40.0  # a group boundary with very different ranges each side
    qw = quantize_int4(w, group)
    x = randn(gen, m, k, dtype=dtype)
    codes = torch.stack((qw.packed & 15, qw.packed >> 4), -1).flatten(1).float()   # by hand
    deq = (codes.view(n, k // group, group) * qw.scale.float()[..., None]
           + qw.min.float()[..., None]).view(n, k)
    want = x.float() @ deq.T
    got = qm.int4_matmul(*on_device(x, qw.packed, qw.scale, qw.min), group)
    assert got.dtype == dtype and got.shape == (m, n)
    if dtype == torch.bfloat16:
        # tensor cores take the dequantized weight in bf16: each product may be off by the
        # weight's rounding (unit roundoff 2^-8), the result by its own; the x40 columns make
        # that far larger than a flat tolerance (seen on an H200, not under the interpreter)
        bound = (x.float().abs() @ deq.abs().T) * 2**-8 + want.abs() * 2**-8 + 1e-3
        err = (got.float().cpu() - want).abs()
        assert (err <= bound).all(), f"int4 g{group} {m}x{n}x{k} seed={seed}: {(err - bound).max()}"
    else:
        assert_close(got, want, dtype, seed, f"int4 g{group} {m}x{n}x{k}")
    assert_close(qm.int4_matmul_reference(x, qw.packed, qw.scale, qw.min, group), want, dtype, seed, "reference")


@pytest.mark.parametrize("splits", [2, 3])
def test_split_k_atomic(splits):
    gen, seed = fresh_generator()
    m, n, k = 2, 40, 3 * qm.BLOCK_K + 32
    w, x = _weight(gen, n, k), randn(gen, m, k)
    q8, q4 = quantize_int8(w), quantize_int4(w, 32)
    got = qm.w8_matmul(*on_device(x, q8.q, q8.scale), k_splits=splits)
    assert_close(got, qm.w8_matmul_reference(x, q8.q, q8.scale), torch.float32, seed, "w8 split")
    got = qm.int4_matmul(*on_device(x, q4.packed, q4.scale, q4.min), 32, k_splits=splits)
    assert_close(got, qm.int4_matmul_reference(x, q4.packed, q4.scale, q4.min, 32), torch.float32, seed,
                 "int4 split")


def test_empty_batch_and_bad_input():
    q8 = quantize_int8(torch.randn(16, 64))
    q, s = on_device(q8.q, q8.scale)
    x = torch.zeros(0, 64, device=DEVICE)
    assert qm.w8_matmul(x, q, s).shape == (0, 16)
    with pytest.raises(ValueError, match="features"):
        qm.w8_matmul(torch.zeros(1, 63, device=DEVICE), q, s)
    q4 = quantize_int4(torch.randn(16, 64), 32)
    with pytest.raises(ValueError, match="min"):
        qm.int4_matmul(torch.zeros(1, 64, device=DEVICE), *on_device(q4.packed, q4.scale, q4.scale[:, :1]), 32)
