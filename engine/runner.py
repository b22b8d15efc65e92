"""Turns a `SchedulerOutput` into model inputs, runs the model, returns the logits to sample.

Batch layout (all scheduled tokens of all requests, flat):

    request   |  A (prefill chunk, 5 tok) |  B (decode) |  C (decode) |
    input_ids |  a5 a6 a7 a8 a9           |  b17        |  c3         |
    positions |  5  6  7  8  9            |  17         |  3          |
    cu_q      |  0                        5             6             7
    ctx_lens  |  10                       |  18         |  4          |
    slot      |  block_ids[p // bs] * bs + p % bs for each position p

A request "samples" when its chunk reaches its last known token: the logits at that row
predict the next token. Prompt logprobs use the logits at every prompt row.
"""
from __future__ import annotations

import math
import mmap
from array import array
from dataclasses import dataclass

import torch

from .cuda_graph import DecodeGraphs
from .kv_calibration import bind_k_shift, k_shift, wants_shift
from .kv_connector import KVConnector
from .models.base import CausalLM
from .models.layers import AttentionMetadata
from .quant.linear import QuantExperts
from .scheduler import SchedulerOutput


class StepAbandoned(Exception):
    """Raised between two layers when every request of the step was abandoned (`stop`):
    the step's work is dropped, nothing of it is kept (see LLMEngine.step)."""


@dataclass
class ModelOutput:
    logits: torch.Tensor                          # [num_sampling, V] fp32, on the model's device
    sample_rows: list                             # ScheduledRequest per logits row
    prompt_logits: dict                           # request_id -> ([n, V] logits, [n] target ids, first_pos)
    spec_logits: dict                             # request_id -> [k + 1, V] fp32 (speculating requests)


def lazy_zeros(shape: tuple[int, ...], dtype: torch.dtype, device) -> torch.Tensor:
    """torch.zeros(shape), whose pages on CPU are committed as they are first written: an
    anonymous mapping (zero pages from the kernel) where torch.zeros writes every byte (a
    0.5 GiB cache: a quarter to half a second of start-up on a busy machine)."""
    if torch.device(device).type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    n = math.prod(shape) * dtype.itemsize
    if n == 0:
        return torch.zeros(shape, dtype=dtype)
    return torch.frombuffer(mmap.mmap(-1, n), dtype=dtype).view(shape)   # holds the mapping


class ModelRunner:
    def __init__(self, model: CausalLM, num_blocks: int, block_size: int, dtype, device="cpu",
                 max_num_seqs: int = 256, decode_graphs: bool | None = None,
                 kv_dtype: torch.dtype | None = None):
        """`decode_graphs`: replay decode steps from CUDA graphs (None: on CUDA with the Triton
        kernels, whose launches never wait on the device, unlike the torch references; True
        on CPU runs the same padded static-buffer path eagerly, for tests). `kv_dtype`: the
        cache's dtype (default `dtype`); an 8-bit one comes with per-(block, head) scales and,
        for K and V without attention sinks, a K shift (kv_calibration.py)."""
        c = model.config
        self.model, self.block_size, self.device = model, block_size, device
        self.num_blocks = num_blocks
        # [layers, K|V, blocks, block_size, kv heads, head_dim], or MLA's one latent part
        # [layers, 1, blocks, block_size, 1, latent] (ModelConfig.kv_block_shape); zeros
        # are lazily committed
        kv_dtype = kv_dtype or dtype
        parts, heads, dim = c.kv_block_shape()
        self.kv_cache = lazy_zeros((c.num_layers, parts, num_blocks, block_size, heads, dim),
                                   kv_dtype, device)
        # [layers, parts, blocks, heads] fp32, written with the blocks (kernels/reference.py)
        self.kv_scales = None if kv_dtype.is_floating_point and kv_dtype.itemsize > 1 else \
            torch.zeros(c.num_layers, parts, num_blocks, heads, device=device)
        model.bind_kv_cache(self.kv_cache, self.kv_scales)
        # [layers, kv heads, head_dim] fp32 subtracted from K before it is quantized
        self.k_shift = None
        if wants_shift(model, self.kv_cache, self.kv_scales):
            self.k_shift = k_shift(model, self.kv_cache, self.kv_scales)
            bind_k_shift(model, self.k_shift)
        if decode_graphs is None:   # the 8-bit cache's write path and quantized experts sync
            decode_graphs = (torch.device(device).type == "cuda" and model.backend != "torch"
                             and self.kv_scales is None
                             and not any(isinstance(m, QuantExperts) for m in model.modules()))
        self.graphs = None
        if decode_graphs:
            self.graphs = DecodeGraphs(model, max_num_seqs, -(-c.max_model_len // block_size), device)
            self.graphs.capture()

    def prepare(self, out: SchedulerOutput) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        """Plain Python lists, then one tensor each: per-request tensor ops cost more than
        the arithmetic at decode batch sizes. The block table (batch x width ids, the largest)
        goes through array('i'): torch.tensor converts a list element by element."""
        bs = self.block_size
        ids, pos, slots, ctx, cu, tables = [], [], [], [], [0], []
        width = max(len(s.request.block_ids) for s in out.scheduled)
        for s in out.scheduled:
            r, end = s.request, s.start + s.num_new_tokens
            blocks = r.block_ids
            ids.extend(r.token_ids(s.start, end - len(s.spec_token_ids)))
            ids.extend(s.spec_token_ids)
            pos.extend(range(s.start, end))
            slots.extend(blocks[p // bs] * bs + p % bs for p in range(s.start, end))
            tables.extend(blocks)                       # one flat list: one tensor, no nesting
            tables.extend([0] * (width - len(blocks)))
            ctx.append(end)
            cu.append(cu[-1] + s.num_new_tokens)
        dev = self.device
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=dev),
            block_tables=torch.frombuffer(array("i", tables), dtype=torch.int32).view(-1, width).to(dev),
            context_lens=torch.tensor(ctx, dtype=torch.int32, device=dev),
            cu_seqlens_q=torch.tensor(cu, dtype=torch.int32, device=dev),
            max_q_len=max(s.num_new_tokens for s in out.scheduled), max_context_len=max(ctx))
        return (torch.tensor(ids, dtype=torch.int64, device=dev),
                torch.tensor(pos, dtype=torch.int64, device=dev), meta)

    def execute(self, out: SchedulerOutput, kv_connector: KVConnector | None = None,
                stop=None) -> ModelOutput:
        """Run the scheduled tokens; `kv_connector` is told as each layer's KV is written
        (save_kv_layer) and waited for once the forward pass is done (wait_for_save).
        `stop()`, asked after each layer of an eager forward pass: True raises StepAbandoned."""
        if kv_connector is None:
            return self._execute(out, None, stop)
        mo = self._execute(out, lambda i: kv_connector.save_kv_layer(i, out), stop)
        kv_connector.wait_for_save(out)
        return mo

    @torch.inference_mode()
    def _execute(self, out: SchedulerOutput, layer_hook, stop=None) -> ModelOutput:
        input_ids, positions, meta = self.prepare(out)
        if (self.graphs is not None and meta.decode_only and layer_hook is None
                and len(out.scheduled) <= self.graphs.max_batch):
            # every decode row samples; no prompt logprobs in a decode step
            return ModelOutput(self.graphs.run(input_ids, positions, meta), list(out.scheduled), {}, {})
        if stop is not None:
            if layer_hook is None and self.model.one_call(meta):   # no layer to stop after
                if stop():
                    raise StepAbandoned("every request of the step was abandoned (before it)")
            else:
                layer_hook = _stopping(layer_hook, stop)
        hidden = self.model(input_ids, positions, meta, layer_hook)
        cu = meta.cu_seqlens_q.tolist()
        rows = [b for b, s in enumerate(out.scheduled) if s.samples and not s.spec_token_ids]
        logits = self.model.compute_logits(hidden[[cu[b + 1] - 1 for b in rows]])
        spec_logits = {}
        spec = [(b, s) for b, s in enumerate(out.scheduled) if s.spec_token_ids]
        if spec:
            # the last known token's row and every proposed token's row
            at = [r for b, s in spec for r in range(cu[b + 1] - len(s.spec_token_ids) - 1, cu[b + 1])]
            lg, off = self.model.compute_logits(hidden[at]).cpu(), 0
            for b, s in spec:
                n = len(s.spec_token_ids) + 1
                spec_logits[s.request.request_id], off = lg[off:off + n], off + n
        prompt_logits = {}
        for b, s in enumerate(out.scheduled):
            r = s.request
            if r.sampling_params.prompt_logprobs is None or s.start >= r.num_prompt_tokens - 1:
                continue
            # rows predicting prompt tokens start+1 .. min(end, P-1)
            n = min(s.start + s.num_new_tokens, r.num_prompt_tokens - 1) - s.start
            h = hidden[cu[b]:cu[b] + n]
            targets = torch.tensor(r.prompt_token_ids[s.start + 1:s.start + 1 + n])
            prompt_logits[r.request_id] = (self.model.compute_logits(h).cpu(), targets, s.start + 1)
        return ModelOutput(logits, [out.scheduled[b] for b in rows], prompt_logits, spec_logits)


def _stopping(layer_hook, stop):
    """`layer_hook`, after a check of `stop()` (StepAbandoned when it says so)."""
    def hook(i: int) -> None:
        if stop():
            raise StepAbandoned(f"every request of the step was abandoned (at layer {i})")
        if layer_hook is not None:
            layer_hook(i)
    return hook
