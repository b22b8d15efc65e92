"""Decode steps replayed from CUDA graphs, one graph per batch-size bucket.

A decode step launches hundreds of small kernels; on a slow host the launches, not the GPU,
set the pace (eager transformers: 87 ms/step where the bandwidth floor is 3.8 ms). So the
whole decode forward, logits included, is captured once per bucket and replayed.

Static buffers (the graph reads its inputs from fixed addresses):

    rows        0 .. n-1 : the live batch          n .. bucket-1 : padding
    input_ids   tokens                             0
    positions   positions                          0
    slot        cache slots                        -1   (the KV write skips them)
    block_table block ids (0-padded columns)       0
    context_len lengths                            0    (attention writes zeros)

Attention gets `max_context_len = max_model_len`, a constant, so the split-K kernel's grid
never changes between capture and replay. On CPU (tests) `capture` is skipped and `run`
executes the same padded forward eagerly, which checks the padding logic without a GPU.
"""
from __future__ import annotations

import torch

from .model import AttentionMetadata, CausalLM

BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, 256, 320, 384, 448, 512)


class DecodeGraphs:
    def __init__(self, model: CausalLM, max_batch: int, max_blocks_per_seq: int, device):
        self.model = model
        self.buckets = [b for b in BUCKETS if b < max_batch] + [max_batch]
        self.max_batch = max_batch
        self.max_context_len = model.config.max_model_len
        dev = torch.device(device)
        self.use_graphs = dev.type == "cuda"
        self.input_ids = torch.zeros(max_batch, dtype=torch.int64, device=dev)
        self.positions = torch.zeros(max_batch, dtype=torch.int64, device=dev)
        self.slot_mapping = torch.full((max_batch,), -1, dtype=torch.int64, device=dev)
        self.block_tables = torch.zeros(max_batch, max_blocks_per_seq, dtype=torch.int32, device=dev)
        self.context_lens = torch.zeros(max_batch, dtype=torch.int32, device=dev)
        self.cu_seqlens_q = torch.arange(max_batch + 1, dtype=torch.int32, device=dev)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.logits: dict[int, torch.Tensor] = {}
        self.pool = None

    def bucket(self, n: int) -> int | None:
        return next((b for b in self.buckets if b >= n), None)

    def _forward(self, b: int) -> torch.Tensor:
        meta = AttentionMetadata(self.slot_mapping[:b], self.block_tables[:b], self.context_lens[:b],
                                 self.cu_seqlens_q[:b + 1], max_q_len=1,
                                 max_context_len=self.max_context_len)
        h = self.model(self.input_ids[:b], self.positions[:b], meta)
        return self.model.compute_logits(h)

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every bucket, largest first so smaller graphs reuse its memory pool. The
        padded inputs point every row at slot -1 / context 0, so capture writes no KV."""
        if not self.use_graphs:
            return
        self.slot_mapping.fill_(-1)
        self.context_lens.zero_()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for b in reversed(self.buckets):
                for _ in range(2):                       # compile Triton kernels, warm caches
                    self._forward(b)
        torch.cuda.current_stream().wait_stream(stream)
        for b in reversed(self.buckets):
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g, pool=self.pool):
                self.logits[b] = self._forward(b)
            if self.pool is None:
                self.pool = g.pool()
            self.graphs[b] = g
        torch.cuda.synchronize()

    @torch.inference_mode()
    def run(self, input_ids: torch.Tensor, positions: torch.Tensor,
            meta: AttentionMetadata) -> torch.Tensor:
        """Logits [n, V] of a decode-only batch of n <= max_batch rows."""
        n, b = input_ids.shape[0], self.bucket(input_ids.shape[0])
        w = meta.block_tables.shape[1]
        if w > self.block_tables.shape[1]:
            raise ValueError(f"block table of width {w} exceeds the captured {self.block_tables.shape[1]}")
        self.input_ids[:n].copy_(input_ids)
        self.input_ids[n:b].zero_()
        self.positions[:n].copy_(positions)
        self.positions[n:b].zero_()
        self.slot_mapping[:n].copy_(meta.slot_mapping)
        self.slot_mapping[n:b].fill_(-1)
        self.block_tables[:b].zero_()
        self.block_tables[:n, :w].copy_(meta.block_tables)
        self.context_lens[:n].copy_(meta.context_lens)
        self.context_lens[n:b].zero_()
        if b in self.graphs:
            self.graphs[b].replay()
            return self.logits[b][:n]
        return self._forward(b)[:n]
