"""The configuration both workers share: which model, how its engine is sized, how the
process serves. Each worker's config extends it with its own fields (see prefill_worker/ and
decode_worker/config.py); the CLI options are generated from the dataclass fields."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class WorkerConfig:
    model_dir: str = field(metadata={"aliases": ["--model"], "help": "Hugging Face model directory"})
    host: str = "127.0.0.1"
    worker_id: str = ""                  # empty: "<role>-<host>:<port>"
    block_size: int = 16
    num_blocks: int | None = None        # None: sized from kv_cache_memory_gb
    kv_cache_memory_gb: float = 0.5
    max_model_len: int | None = None
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 128
    enable_prefix_caching: bool = True
    device: str = "cpu"
    dtype: str = "auto"
    kernel_backend: str = "auto"
    num_threads: int = 1                 # torch intra-op threads (CPU)
    drain_timeout_s: float = 30.0
    metrics_port: int = 0                # /metrics (plain text) on this port; 0 = off
    trace_file: str = ""                 # append finished spans as JSON lines (tests); OTLP: OTEL_* env

    # fields each subclass checks as positive seconds / as ports
    _positive = ("drain_timeout_s",)
    _ports = ("metrics_port",)

    def __post_init__(self):
        if not self.model_dir:
            raise ValueError("model_dir is required")
        for name in self._positive:
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        for name in self._ports:
            if not 0 <= getattr(self, name) < 65536:
                raise ValueError(f"{name} must be in [0, 65536), got {getattr(self, name)}")
        if self.num_threads < 1:
            raise ValueError("num_threads must be >= 1")

    def build_engine(self, kv_connector=None, step_observers=()):
        """The LLMEngine this config describes (loads the model: call it off the event loop),
        with the worker's seams (engine/kv_connector.py, engine/step_observer.py)."""
        from engine.llm_engine import LLMEngine
        return LLMEngine.from_model_dir(
            self.model_dir, block_size=self.block_size, num_blocks=self.num_blocks,
            max_model_len=self.max_model_len, max_num_batched_tokens=self.max_num_batched_tokens,
            max_num_seqs=self.max_num_seqs, enable_prefix_caching=self.enable_prefix_caching,
            device=self.device, dtype=self.dtype, kernel_backend=self.kernel_backend,
            kv_cache_memory_gb=self.kv_cache_memory_gb, kv_connector=kv_connector,
            step_observers=step_observers)
