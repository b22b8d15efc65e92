"""One KV transfer's state on the receiving side (receiver.py draws its lifecycle) and its
deadline, which follows the work:

    deadline = min(last progress + idle_s, reserved at + max_s)

progress being the reservation itself, then every LAYER message written into it.
`deadline_after` is that rule, the one place it is written: the receiver applies it to
its clock, the prefill worker to its own view of the same reservation.
"""
from __future__ import annotations

import asyncio
import enum
from dataclasses import dataclass, field


def deadline_after(progress_at: float, idle_s: float, hard_deadline: float) -> float:
    """When a reservation expires unless more progress comes: idle_s after the last
    progress (progress_at), never past its hard deadline (reserved at + max_s)."""
    return min(progress_at + idle_s, hard_deadline)


class TransferState(enum.Enum):
    RESERVED = "reserved"
    RECEIVING = "receiving"
    DONE = "done"
    FAILED = "failed"
    EXPIRED = "expired"
    ABORTED = "aborted"

    @property
    def final(self) -> bool:
        return self not in (TransferState.RESERVED, TransferState.RECEIVING)


@dataclass(frozen=True)
class TransferResult:
    transfer_id: str
    state: TransferState
    reason: str = ""
    blocks_received: int = 0          # (layer, block) pairs written
    bytes_received: int = 0           # payload bytes written
    elapsed_s: float = 0.0            # reserve -> final state
    deadline: float = 0.0             # the clock's time it expires at unless progress comes


@dataclass
class _Transfer:
    tid: str
    block_ids: list[int]
    deadline: float                   # the receiver's clock: expires then unless progress comes
    created: float
    num_layers: int
    idle_s: float = 0.0               # each progress moves the deadline to now + idle_s ...
    hard_deadline: float = 0.0        # ... but never past this (reserved at + max_s)
    state: TransferState = TransferState.RESERVED
    reason: str = ""
    blocks: int = 0
    nbytes: int = 0
    remaining: int = 0                # (layer, block) pairs still missing
    got: list[bytearray] = field(default_factory=list)   # per layer: 1 byte per reserved block
    event: asyncio.Event | None = None
    finished_at: float = 0.0

    def result(self, now: float) -> TransferResult:
        end = self.finished_at or now
        return TransferResult(self.tid, self.state, self.reason, self.blocks, self.nbytes,
                              end - self.created, self.deadline)

    def progressed(self, now: float) -> None:
        self.deadline = deadline_after(now, self.idle_s, self.hard_deadline)

    def expiry_reason(self) -> str:
        """Why the reaper expired it: its hard bound, or no progress for the idle window."""
        missing = f"{self.remaining} of {len(self.block_ids) * self.num_layers} (layer, block) pairs missing"
        if self.deadline >= self.hard_deadline and self.hard_deadline - self.created > self.idle_s:
            return (f"the reservation's bound of {self.hard_deadline - self.created:.3g}s passed with "
                    f"{missing}")
        what = "its first KV" if self.state is TransferState.RESERVED else "more KV"
        return f"no progress: {what} did not arrive within {self.idle_s:.3g}s, with {missing}"
