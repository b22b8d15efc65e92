"""Copies of one layer's blocks between a KV cache and a LAYER message body: the sender's
gather, the receiver's scatter. The body's layout is wire.py's:

    | int32 destination block ids, padded to 64 bytes | K, V [2, n, bs, heads, dim] | scales |
                                                          (cache dtype)   (8-bit cache only,
                                                                           [2, n, heads] fp32)

A CPU cache is copied at once (`stream` None). A CUDA cache is copied on the side's own
`stream`, never on the compute stream: the gather first waits for an event recorded on the
compute stream (after the layer's kernels); each returns the event that says its copy is
done, for whoever hands the body on (the sender's writer) or back (the receiver's settle).
"""
from __future__ import annotations

import torch

from .wire import ids_bytes, payload_views


def layer_pairs(kv_cache: torch.Tensor, kv_scales: torch.Tensor | None, layer: int,
                body: torch.Tensor, n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(the cache's part, the body's part) for K and V, and for the scales of an 8-bit cache:
    the cache's [2, num_blocks, ...] of `layer`, the body's [2, n, ...]."""
    payload, scales = payload_views(body, kv_cache, kv_scales, n)
    pairs = [(kv_cache[layer], payload)]
    if scales is not None:
        pairs.append((kv_scales[layer], scales))
    return pairs


def gather(kv_cache: torch.Tensor, kv_scales: torch.Tensor | None, layer: int,
           src_index: torch.Tensor, dst_ids: list[int], body: torch.Tensor,
           stream: "torch.cuda.Stream | None") -> "torch.cuda.Event | None":
    """Fill `body` with [dst_ids | blocks `src_index` of `layer`]. On CUDA the copy is queued
    on `stream` after everything the compute stream queued so far, and its event returned."""
    n = len(dst_ids)
    off = ids_bytes(n)
    ids = torch.zeros(off // 4, dtype=torch.int32)
    ids[:n] = torch.tensor(dst_ids, dtype=torch.int32)
    pairs = layer_pairs(kv_cache, kv_scales, layer, body, n)
    if stream is None:           # CPU cache: gather straight into the message buffer
        body[:off].view(torch.int32).copy_(ids)
        for src, dst in pairs:
            torch.index_select(src, 1, src_index, out=dst)
        return None
    after_layer = torch.cuda.current_stream(kv_cache.device).record_event()
    with torch.cuda.stream(stream):
        stream.wait_event(after_layer)
        src_index.record_stream(stream)       # set_source may drop the handle's index
        body[:off].view(torch.int32).copy_(ids, non_blocking=True)
        for src, dst in pairs:
            if dst.is_cuda:                   # staging "device": one gather, no host copy
                torch.index_select(src, 1, src_index, out=dst)
            else:                             # gather on the GPU, one copy to pinned host
                dst.copy_(src.index_select(1, src_index), non_blocking=True)
        return stream.record_event()


def body_block_ids(body: torch.Tensor, n: int, stream: "torch.cuda.Stream | None") -> list[int]:
    """The destination block ids a body names (read on `stream` when it is in GPU memory:
    staging "device", never on the decode step's stream)."""
    head = body[:4 * n]
    if head.is_cuda:
        with torch.cuda.stream(stream):
            head = head.cpu()
    return head.view(torch.int32).tolist()


def scatter(kv_cache: torch.Tensor, kv_scales: torch.Tensor | None, layer: int,
            block_ids: list[int], body: torch.Tensor,
            stream: "torch.cuda.Stream | None") -> "torch.cuda.Event | None":
    """Write the body's blocks into blocks `block_ids` of `layer`: one indexed copy per part,
    `kv_cache[layer].index_copy_(1, ids, payload)`. On CUDA it is queued on `stream` and its
    event returned."""
    pairs = layer_pairs(kv_cache, kv_scales, layer, body, len(block_ids))
    if stream is None:
        idx = torch.tensor(block_ids, dtype=torch.long)
        for dst, src in pairs:
            if dst.element_size() == 1:     # torch's CPU index_copy_ has no float8 kernel
                dst, src = dst.view(torch.uint8), src.view(torch.uint8)
            dst.index_copy_(1, idx, src)
        return None
    with torch.cuda.stream(stream):
        idx = torch.tensor(block_ids, dtype=torch.long, device=kv_cache.device)
        for dst, src in pairs:
            if dst.element_size() == 1:
                dst, src = dst.view(torch.uint8), src.view(torch.uint8)
            dst.index_copy_(1, idx, src.to(dst.device, non_blocking=True))
        return stream.record_event()
