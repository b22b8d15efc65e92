"""How much memory the KV cache may take: `kv_cache_blocks` from kv_cache_memory_gb, or
from `gpu_memory_utilization` of the device memory free once the weights are loaded.

`free_device_memory(device)` is the one place that asks the device; tests replace it with a
fake to check the sizing without a GPU.
"""
from __future__ import annotations

import logging

import torch

log = logging.getLogger(__name__)


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


def kv_cache_blocks(config) -> int:
    """Blocks for an engine's cache (an engine.config.EngineConfig): kv_cache_memory_gb, or
    gpu_memory_utilization of the device memory free now that the weights are loaded; never
    more than max_num_seqs full contexts."""
    mc, cc = config.model, config.cache
    parts, heads, dim = mc.kv_block_shape()
    per_block = mc.num_layers * parts * cc.block_size * heads * dim * config.kv_torch_dtype.itemsize
    if cc.gpu_memory_utilization:
        budget = kv_cache_bytes(config.device, cc.gpu_memory_utilization)
        source = f"{cc.gpu_memory_utilization:.0%} of the free device memory"
    else:
        budget, source = int(cc.kv_cache_memory_gb * 2**30), f"{cc.kv_cache_memory_gb} GiB"
    enough = config.scheduler.max_num_seqs * -(-mc.max_model_len // cc.block_size)
    blocks = min(budget // per_block, enough)
    if blocks < 1:
        raise ValueError(f"no room for one KV block ({per_block} bytes) in {source} "
                         f"({budget} bytes)")
    log.info("KV cache: %d blocks of %d tokens (%.2f GiB, from %s)", blocks, cc.block_size,
             blocks * per_block / 2**30, source)
    return blocks
