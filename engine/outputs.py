"""What the engine returns per request and step."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]                       # all generated tokens so far
    new_token_ids: list[int]                   # generated in this step
    text: str                                  # stable text so far (a partial stop string held back)
    finished: bool
    finish_reason: str | None = None           # stop | length | abort | prefill_done
    stop_reason: int | str | None = None       # the stop token id or stop string that matched
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list = field(default_factory=list)      # per token: [(id, logprob)] or None
    prompt_logprobs: list | None = None                   # per prompt token: (logprob|None, top|None)
    num_cached_tokens: int = 0
    block_ids: list[int] = field(default_factory=list)    # for prefill-only requests (transfer)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)


@dataclass
class EngineStats:
    num_running: int
    num_waiting: int
    num_waiting_for_remote_kv: int
    num_free_blocks: int
    num_total_blocks: int
    num_held_blocks: int                       # referenced by some request
    queued_prefill_tokens: int
    num_preemptions: int
    prefix_cache_queries: int
    prefix_cache_hits: int
