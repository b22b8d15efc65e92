"""A request's whole state lives on one `Request`; schedulers only move it between queues.

Lifecycle (local):     WAITING -> RUNNING -> FINISHED_*            (PREEMPTED -> WAITING on recompute)
Prefill-only role:     WAITING -> RUNNING -> FINISHED_PREFILL      (blocks held until released)
Remote-KV (decode):    WAITING_FOR_REMOTE_KV -> RUNNING -> FINISHED_*
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from .sampling_params import SamplingParams

if TYPE_CHECKING:
    import torch


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    WAITING_FOR_REMOTE_KV = "waiting_for_remote_kv"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"
    FINISHED_PREFILL = "prefill_done"

    @property
    def finished(self) -> bool:
        return self.name.startswith("FINISHED")


@dataclass
class Request:
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    max_tokens: int                      # resolved: never past the context length
    eos_token_ids: set[int] = field(default_factory=set)
    prefill_only: bool = False
    arrival_time: float = 0.0

    status: RequestStatus = RequestStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    output_logprobs: list[float] = field(default_factory=list)
    output_top_logprobs: list = field(default_factory=list)
    prompt_logprobs: list = field(default_factory=list)   # [(logprob|None, top|None)] per prompt token
    num_computed_tokens: int = 0         # tokens whose KV is in the cache
    num_cached_tokens: int = -1          # prefix-cache hit at first admission (-1: not yet)
    block_ids: list[int] = field(default_factory=list)
    block_hashes: list[bytes] = field(default_factory=list)
    spec_token_ids: list[int] = field(default_factory=list)   # proposed for the next step
    num_preemptions: int = 0
    stop_reason: int | str | None = None
    generator: torch.Generator | None = None
    first_scheduled_time: float | None = None
    first_token_time: float | None = None

    def __post_init__(self):
        if self.sampling_params.seed is not None:
            import torch         # here: schedulers (and sim/) use requests without torch
            self.generator = torch.Generator().manual_seed(self.sampling_params.seed)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def token_ids(self, start: int, end: int) -> list[int]:
        """all_token_ids[start:end] without building the whole list (a decode step wants one
        token of a possibly long context)."""
        p = len(self.prompt_token_ids)
        if start >= p:
            return self.output_token_ids[start - p:end - p]
        if end <= p:
            return self.prompt_token_ids[start:end]
        return self.prompt_token_ids[start:] + self.output_token_ids[:end - p]

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status.finished

    @property
    def finish_reason(self) -> str | None:
        if self.status in (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH,
                           RequestStatus.FINISHED_ABORTED, RequestStatus.FINISHED_PREFILL):
            return self.status.value
        return None
