"""kvtransfer.staging.StagingPool: buffers of several sizes are kept and handed out again
(the H200 run found `list.remove` comparing tensors element-wise once two sizes were free)."""
import torch

from kvtransfer.staging import StagingPool


def test_buffers_of_several_sizes_are_reused_by_size():
    pool = StagingPool(torch.zeros(2, 2, 4, 16, 2, 8), "host")
    a, b = pool.acquire(9_000_000), pool.acquire(34_000_000)
    pa, pb = a.data_ptr(), b.data_ptr()
    pool.release(a)
    pool.release(b)
    big = pool.acquire(33_000_000)                # only the big one fits: no compare of the two
    small = pool.acquire(8_000_000)
    assert (big.data_ptr(), small.data_ptr()) == (pb, pa)
    assert big.numel() == 33_000_000 and small.numel() == 8_000_000
    assert pool.allocated == 2 and pool.in_use == 2
    pool.release(big, reuse=False)                 # a failed send: forgotten, never reused
    pool.acquire(33_000_000)
    assert pool.allocated == 3
