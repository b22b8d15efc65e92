"""Decode steps replayed from CUDA graphs, one graph per (batch bucket, context bucket).

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

Attention gets `max_context_len` = the context bucket (CONTEXT_BUCKET_BASE, x4, ...,
max_model_len) that holds the batch's longest context: the split-K grid is fixed per graph,
and a 1k-token batch does not launch the partitions of a 128k one. Logits land in one
static [max_batch, V] fp32 buffer that every graph writes (its rows are valid until the next
`run`). On CPU (tests) `capture` is skipped and `run` executes the same padded forward
eagerly, which checks the padding and bucketing without a GPU.
"""
from __future__ import annotations

import torch

from .models.base import CausalLM
from .models.layers import AttentionMetadata

BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, 256, 320, 384, 448, 512)
CONTEXT_BUCKET_BASE = 1024


def context_buckets(max_model_len: int) -> list[int]:
    """1024, 4096, 16384, ... below max_model_len, then max_model_len itself."""
    out, c = [], CONTEXT_BUCKET_BASE
    while c < max_model_len:
        out.append(c)
        c *= 4
    return out + [max_model_len]


class DecodeGraphs:
    def __init__(self, model: CausalLM, max_batch: int, max_blocks_per_seq: int, device):
        self.model = model
        self.buckets = [b for b in BUCKETS if b < max_batch] + [max_batch]
        self.max_batch = max_batch
        self.context_buckets = context_buckets(model.config.max_model_len)
        dev = torch.device(device)
        self.use_graphs = dev.type == "cuda"
        self.input_ids = torch.zeros(max_batch, dtype=torch.int64, device=dev)
        self.positions = torch.zeros(max_batch, dtype=torch.int64, device=dev)
        self.slot_mapping = torch.full((max_batch,), -1, dtype=torch.int64, device=dev)
        self.block_tables = torch.zeros(max_batch, max_blocks_per_seq, dtype=torch.int32, device=dev)
        self.context_lens = torch.zeros(max_batch, dtype=torch.int32, device=dev)
        self.cu_seqlens_q = torch.arange(max_batch + 1, dtype=torch.int32, device=dev)
        self.logits = torch.zeros(max_batch, model.config.vocab_size, dtype=torch.float32, device=dev)
        self.graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}
        self.replays: dict[tuple[int, int], int] = {}     # (batch, context) bucket -> runs
        self.pool = None

    def bucket(self, n: int) -> int | None:
        return next((b for b in self.buckets if b >= n), None)

    def context_bucket(self, max_context_len: int) -> int:
        return next(c for c in self.context_buckets if c >= max_context_len)

    def _forward(self, b: int, c: int) -> None:
        meta = AttentionMetadata(self.slot_mapping[:b], self.block_tables[:b], self.context_lens[:b],
                                 self.cu_seqlens_q[:b + 1], max_q_len=1, max_context_len=c)
        h = self.model(self.input_ids[:b], self.positions[:b], meta)
        self.logits[:b].copy_(self.model.compute_logits(h))

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every (batch, context) bucket, largest first so smaller graphs reuse its
        memory pool. The padded inputs point every row at slot -1 / context 0, so capture
        writes no KV."""
        if not self.use_graphs:
            return
        self.slot_mapping.fill_(-1)
        self.context_lens.zero_()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        keys = [(b, c) for b in reversed(self.buckets) for c in reversed(self.context_buckets)]
        with torch.cuda.stream(stream):
            for key in keys:                             # compile Triton kernels, warm caches
                self._forward(*key)
        torch.cuda.current_stream().wait_stream(stream)
        for key in keys:
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g, pool=self.pool):
                self._forward(*key)
            if self.pool is None:
                self.pool = g.pool()
            self.graphs[key] = g
        torch.cuda.synchronize()

    @torch.inference_mode()
    def run(self, input_ids: torch.Tensor, positions: torch.Tensor,
            meta: AttentionMetadata) -> torch.Tensor:
        """Logits [n, V] of a decode-only batch of n <= max_batch rows (a view of the static
        buffer: valid until the next run)."""
        n, b, c = self.stage(input_ids, positions, meta)
        self.replays[b, c] = self.replays.get((b, c), 0) + 1
        if (b, c) in self.graphs:
            self.graphs[b, c].replay()
        else:
            self._forward(b, c)
        return self.logits[:n]

    def stage(self, input_ids: torch.Tensor, positions: torch.Tensor,
              meta: AttentionMetadata) -> tuple[int, int, int]:
        """Copy a batch into the static buffers, padding rows after it; -> (rows, batch
        bucket, context bucket)."""
        n, b = input_ids.shape[0], self.bucket(input_ids.shape[0])
        c = self.context_bucket(meta.max_context_len)
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
        return n, b, c
