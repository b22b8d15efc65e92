"""How much device memory the KV cache may take (the `gpu_memory_utilization` sizing).

`free_device_memory(device)` is the one place that asks the device; tests replace it with a
fake to check the sizing without a GPU.
"""
from __future__ import annotations

import torch


def free_device_memory(device: str) -> tuple[int, int]:
    """(free, total) bytes of `device`'s memory, as the driver reports them now."""
    dev = torch.device(device)
    if dev.type != "cuda":
        raise ValueError(f"gpu_memory_utilization sizes the KV cache from a CUDA device's free "
                         f"memory; device {device!r} has none to query: use kv_cache_memory_gb")
    torch.cuda.synchronize(dev)
    return torch.cuda.mem_get_info(dev)


def kv_cache_bytes(device: str, fraction: float) -> int:
    """The KV cache's share of the memory free now (call it once the weights are loaded):
    `fraction` of it; the rest stays for activations, CUDA graphs and the allocator."""
    free, _total = free_device_memory(device)
    return int(free * fraction)
