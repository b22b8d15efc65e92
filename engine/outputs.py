"""What the engine returns per request and step."""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field


class Prefix(Sequence):
    """The first `n` items of a list that only ever grows: an O(1) snapshot.

    A request's output lists grow by one token per step; copying them into every step's
    output would cost O(length) per token, O(length^2) per request. The engine only appends,
    so a length-bounded view of the same list is a faithful snapshot."""
    __slots__ = ("_items", "_n")

    def __init__(self, items: list, n: int | None = None):
        self._items, self._n = items, len(items) if n is None else n

    def __len__(self) -> int:
        return self._n

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self._items[j] for j in range(self._n)[i]]
        if i < 0:
            i += self._n
        if not 0 <= i < self._n:
            raise IndexError("Prefix index out of range")
        return self._items[i]

    def __eq__(self, other) -> bool:
        return isinstance(other, (list, tuple, Prefix)) and list(self) == list(other)

    def __repr__(self) -> str:
        return repr(list(self))


@dataclass
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]                       # all generated tokens so far
    new_token_ids: list[int]                   # generated in this step
    text: str                                  # `LLM`'s final text (OutputProcessor); "" from the engine
    finished: bool
    finish_reason: str | None = None           # stop | length | abort | prefill_done
    stop_reason: int | str | None = None       # the stop token id or stop string that matched
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list = field(default_factory=list)      # per token: [(id, logprob)] or None
    prompt_logprobs: list | None = None                   # per prompt token: (logprob|None, top|None)
    num_cached_tokens: int = 0
    block_ids: list[int] = field(default_factory=list)    # for prefill-only requests (transfer)
    emitted_at: float = 0.0                    # time.monotonic() AsyncEngine handed it to the loop

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
    spec_num_drafts: int = 0                   # speculative decoding (engine/spec_decode.py)
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0
    spec_num_emitted_tokens: int = 0
