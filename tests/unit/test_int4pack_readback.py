"""A table's codes read back out of torch's CPU int4 layout by reshapes
(`packing.int4pack_all_rows`, what the backend cpu repack of a tied head uses) equal the
stored codes and what the kernel itself reads back on the identity (`int4pack_codes`)."""
from __future__ import annotations

import pytest
import torch

from engine.kernels import packing as P
from engine.quant.int8 import Int8Weight
from engine.quant.int8_g32 import G32Int4Pack


@pytest.mark.parametrize("n,k", [(64, 32), (256, 96), (1024, 576)])
def test_every_row_reads_back_exactly(n, k):
    if not P.int4pack_block():
        pytest.skip("torch's CPU int4 layout does not read back on this machine")
    g = torch.Generator().manual_seed(n + k)
    q = torch.randint(-128, 128, (n, k), dtype=torch.int8, generator=g)
    q[0, :2] = torch.tensor([-128, 127], dtype=torch.int8)          # the extremes
    scale = (torch.rand(n, k // 32, generator=g) + 0.5).half()
    packed = G32Int4Pack(Int8Weight(q, scale, 32), "auto", keep_scales=True)
    assert packed.rows_ok
    back = packed.quantized()
    assert torch.equal(back.q, q) and torch.equal(back.scale, scale)
    by_kernel = P.nibble_join(P.int4pack_codes(packed.qweight, n, 2 * k))
    assert torch.equal(P.int4pack_all_rows(packed.qweight, n, k), by_kernel)
