"""The engine's KV-saving seam: what a worker plugs in to ship KV while the model runs.

The shape of vLLM v1's KV connector (worker side), reduced to what pdserve needs:

    LLMEngine(config, kv_connector=c)
        the runner allocates the paged cache -> c.register_kv_caches(kv_cache, model_name, kv_scales)
    each step() that runs the model:
        layer 0's KV written      -> c.save_kv_layer(0, scheduler_output)
        ...                          (the next layer computes meanwhile)
        layer L-1's KV written    -> c.save_kv_layer(L-1, scheduler_output)
        forward pass done         -> c.wait_for_save(scheduler_output)
        sample, update requests

Every call runs on the engine's thread, inside step(); none may block for long (a send is
queued, not awaited) and none should raise: an exception aborts the step, and with it every
request of the engine. A connector decides per scheduled request whether it saves anything
(the prefill worker's saves, in each chunk, the blocks that chunk completed).

An engine with a connector never replays decode steps from CUDA graphs (the graphs have no
per-layer call-outs); the prefill role, the only one with a connector, has no decode steps.
"""
from __future__ import annotations

import abc

import torch

from .scheduler import SchedulerOutput


class KVConnector(abc.ABC):
    @abc.abstractmethod
    def register_kv_caches(self, kv_cache: torch.Tensor, model_name: str,
                           kv_scales: torch.Tensor | None = None, layout: str = "") -> None:
        """Called once, from LLMEngine.__init__, when the cache exists:
        kv_cache [layers, parts, blocks, block_size, heads, dim] (K and V per KV head, or
        MLA's one latent); `model_name` names the model in compatibility keys; `kv_scales`
        [layers, parts, blocks, heads] fp32 are an 8-bit cache's scales, which travel with
        their blocks; `layout` names the layout (ModelConfig.kv_layout)."""

    @abc.abstractmethod
    def save_kv_layer(self, layer: int, scheduler_output: SchedulerOutput) -> None:
        """Layer `layer`'s KV of every request in `scheduler_output` is in the cache."""

    def wait_for_save(self, scheduler_output: SchedulerOutput) -> None:
        """Every layer of this step was handed to save_kv_layer; return once the step's
        saves no longer read the cache blocks the step wrote. The default returns at once:
        for a connector whose save_kv_layer copies what it sends before returning."""
