"""Reusable message buffers for KV transfers (both ends), and where they live.

    staging "host"   : pinned host memory when the cache is on a GPU (plain host memory for
                       a CPU cache); the GPU side is copied in or out on a side stream. Works
                       with any UCX (tcp, shared memory, RDMA).
    staging "device" : GPU memory; UCX's cuda_ipc / cuda_copy transports move it with no
                       host copy. The sender and receiver must both use it: the HELLO says
                       which staging each side uses and a mismatch is refused.

A buffer is out from `acquire` until `release`: it is never handed out twice while out (a
send or a copy may still read it). Released buffers are kept for reuse up to `keep_bytes`;
beyond that they are freed. Nothing here blocks: an empty pool allocates.
"""
from __future__ import annotations

import threading

import torch

STAGING_MODES = ("host", "device")
_ROUND = 1 << 20            # sizes are rounded up to 1 MiB so that similar messages share buffers


def check_staging(mode: str, kv_cache: torch.Tensor) -> str:
    if mode not in STAGING_MODES:
        raise ValueError(f"KV staging must be one of {STAGING_MODES}, got {mode!r}")
    if mode == "device" and not kv_cache.is_cuda:
        raise ValueError("KV staging 'device' needs a CUDA KV cache")
    return mode


class StagingPool:
    def __init__(self, kv_cache: torch.Tensor, mode: str = "host", keep_bytes: int = 1 << 30):
        check_staging(mode, kv_cache)
        self.device = kv_cache.device if mode == "device" else torch.device("cpu")
        self.pin = mode == "host" and kv_cache.is_cuda
        self.keep_bytes = keep_bytes
        self._free: list[torch.Tensor] = []
        self._out: dict[int, torch.Tensor] = {}     # data_ptr -> whole buffer
        self._kept = 0
        self._lock = threading.Lock()               # the engine thread acquires, the loop releases
        self.allocated = 0                          # buffers ever allocated (reuse shows here)

    def acquire(self, nbytes: int) -> torch.Tensor:
        """A uint8 tensor of exactly `nbytes`, not in use by anyone else."""
        with self._lock:
            fits = [b for b in self._free if nbytes <= b.numel() <= 2 * nbytes + _ROUND]
            if fits:
                buf = min(fits, key=torch.Tensor.numel)
                self._free.remove(buf)
                self._kept -= buf.numel()
            else:
                size = max(-(-nbytes // _ROUND), 1) * _ROUND
                buf = torch.empty(size, dtype=torch.uint8, device=self.device, pin_memory=self.pin)
                self.allocated += 1
            self._out[buf.data_ptr()] = buf
        return buf[:nbytes]

    def release(self, view: torch.Tensor, reuse: bool = True) -> None:
        """Give back a buffer from `acquire` once nothing reads or writes it any more;
        `reuse=False` when something might still (a failed send): the pool forgets it."""
        with self._lock:
            buf = self._out.pop(view.data_ptr())
            if reuse and self._kept + buf.numel() <= self.keep_bytes:
                self._free.append(buf)
                self._kept += buf.numel()

    @property
    def in_use(self) -> int:
        return len(self._out)
