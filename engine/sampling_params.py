"""Per-request sampling parameters (vLLM's names and defaults where they exist)."""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from .structured import StructuredOutput


@dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0          # 0 => greedy
    top_p: float = 1.0
    top_k: int = 0                    # 0 or -1 => disabled
    min_p: float = 0.0
    seed: int | None = None           # per-request generator => reproducible
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    max_tokens: int | None = 16       # None => up to the context length
    min_tokens: int = 0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None       # None: no logprobs; k >= 0: sampled token's + top-k
    prompt_logprobs: int | None = None
    logit_bias: dict[int, float] = field(default_factory=dict)
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    structured: StructuredOutput | None = None   # constrain output (JSON schema, regex, Lark)
    speculative: bool = True          # False: never speculate for this request (the worker's
                                      # --speculative decides whether any request does)

    def __post_init__(self):
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        self.logit_bias = {int(k): float(v) for k, v in (self.logit_bias or {}).items()}
        if self.top_k == -1:
            self.top_k = 0
        self.validate()

    def validate(self) -> None:
        def bad(name, why):
            raise ValueError(f"invalid sampling parameter {name}={getattr(self, name)!r}: {why}")
        if self.n < 1:
            bad("n", "must be >= 1")
        for name in ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty",
                     "repetition_penalty"):
            if not math.isfinite(getattr(self, name)):
                bad(name, "must be a finite number")
        if self.temperature < 0:
            bad("temperature", "must be >= 0")
        if not 0 < self.top_p <= 1:
            bad("top_p", "must be in (0, 1]")
        if self.top_k < 0:
            bad("top_k", "must be >= 0 (0 or -1 disables it)")
        if not 0 <= self.min_p <= 1:
            bad("min_p", "must be in [0, 1]")
        if not -2 <= self.presence_penalty <= 2:
            bad("presence_penalty", "must be in [-2, 2]")
        if not -2 <= self.frequency_penalty <= 2:
            bad("frequency_penalty", "must be in [-2, 2]")
        if self.repetition_penalty <= 0:
            bad("repetition_penalty", "must be > 0")
        if self.max_tokens is not None and self.max_tokens < 1:
            bad("max_tokens", "must be >= 1")
        if self.min_tokens < 0:
            bad("min_tokens", "must be >= 0")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            bad("min_tokens", "must be <= max_tokens")
        if self.logprobs is not None and not 0 <= self.logprobs <= 20:
            bad("logprobs", "must be in [0, 20]")
        if self.prompt_logprobs is not None and not 0 <= self.prompt_logprobs <= 20:
            bad("prompt_logprobs", "must be in [0, 20]")
        if any(s == "" for s in self.stop):
            bad("stop", "stop strings must be non-empty")
        if self.structured is not None and not isinstance(self.structured, StructuredOutput):
            bad("structured", "must be an engine.structured.StructuredOutput")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0
