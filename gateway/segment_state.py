"""`Segment`: one pass of a request through a (decode, prefill) pair, and the calls it owns
until cleanup (gateway/segment.py's `Segments` runs them; its docstring draws the pass)."""
from __future__ import annotations

import asyncio
from dataclasses import dataclass, fields

from .placement import Ticket
from .registry import Worker


@dataclass(eq=False)
class Segment:
    """One pass through a (decode, prefill) pair; owns its calls until cleanup()."""
    rid: str
    decode: Worker | None = None
    decode_call: object = None
    prefill: Worker | None = None
    prefill_call: object = None
    submit_task: asyncio.Task | None = None
    decode_done: bool = False          # the decode worker finished the request itself
    metadata: object = None            # gRPC metadata for the workers (trace context)
    lost: str = ""                     # why the decode worker's calls were cut (cut())
    prefill_lost: str = ""             # why the Prefill was cut
    ticket: Ticket | None = None       # where its prompt is computed (gateway/placement.py)
    first_chunk: object = None         # local: the stream's first TokenChunk, read at open
    local_reason: str = ""             # set: local whatever the policy says (a fallback)

    def attach_decode(self, w: Worker, call, tokens: int = 0) -> None:
        """`call` (w's Decode stream, holding `tokens` prompt tokens of KV) is this
        segment's; `w` counts it until detach(w)."""
        self.decode, self.decode_call = w, call
        w.attach(self, tokens)

    def attach_prefill(self, w: Worker, call, tokens: int = 0) -> None:
        """`call` (w's Prefill, `tokens` prompt tokens to compute) is this segment's; `w`
        counts it until detach(w)."""
        self.prefill, self.prefill_call = w, call
        w.attach(self, tokens)

    def detach(self, w: Worker | None) -> None:
        """`w`'s call ended or was cancelled: the segment no longer holds it (None: nothing)."""
        if w is None:
            return
        w.detach(self)
        if w is self.decode:
            self.decode = self.decode_call = None
        if w is self.prefill:
            self.prefill = self.prefill_call = None

    def retry(self, attempt: int) -> None:
        """The same pass again with a fresh reservation ("#r<attempt>"): every field back to
        its default but the metadata. Only once cleanup() detached both workers."""
        if self.decode is not None or self.prefill is not None:
            raise RuntimeError(f"segment {self.rid} retried while a worker holds it")
        for f in fields(self):
            if f.name not in ("rid", "metadata"):
                setattr(self, f.name, f.default)
        self.rid = f"{self.rid}#r{attempt}"

    def cut(self, worker: Worker, reason: str) -> None:
        """`worker` is lost. The decode worker: cancel every open call of this segment
        (their awaits raise CancelledError, which Segments.run turns into a migration);
        the prefill worker: cancel the Prefill (retried by _prefill_with_retry)."""
        if worker is self.prefill:
            self.prefill_lost = reason
            self.prefill_call.cancel()
            return
        self.lost = reason
        for call in (self.decode_call, self.prefill_call, self.submit_task):
            if call is not None:
                call.cancel()
