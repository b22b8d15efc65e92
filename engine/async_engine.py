"""AsyncEngine: drives an `LLMEngine` from asyncio without ever blocking the event loop.

    loop thread (grpc handlers)                 engine thread (owns the LLMEngine)
    ---------------------------                 ----------------------------------
    await ae.add_request(...) --cmd--> inbox --> drain inbox (run every command, in order)
    async for out in ae.stream(rid) <--queue---  step() -> outputs -> per-request queues
    ae.stats()  <-- snapshot published after every drain/step

Rules:
  * The engine is touched ONLY by the engine thread. Every mutation is a command: a callable
    put in a FIFO inbox under a condition variable; its result (or exception) comes back as
    an asyncio future. Commands run in submission order, so an abort submitted after an add
    always finds the request, even if the caller was cancelled while awaiting the add.
  * The thread sleeps on the condition variable when there are no commands and no runnable
    requests (requests waiting for remote KV are not runnable): no busy spin. A step that
    scheduled nothing (waiting requests lack blocks or slots) stalls the engine: only a
    command (abort, release, remote KV done, a new request) can change that, so the thread
    sleeps until one arrives, re-checking at most every STALL_RECHECK_S.
  * `max_step_failures` consecutive failed steps make the engine unhealthy (`healthy` false,
    `on_health(False)` called on the loop); a step that succeeds makes it healthy again.
  * Each streamed request has an asyncio.Queue fed with `loop.call_soon_threadsafe` (each
    step output stamped `emitted_at`, for the per-token path's to_loop). The stream ends
    with the request's finished output; an abort ends it with a synthetic finished output
    whose finish_reason is "abort". If a step raises, every request of the engine is
    aborted and every open stream raises `EngineError`.
  * `abort` marks the id abandoned (`engine.abandoned`: a set, the one exception to the
    rule above, read by the engine thread while it steps) before its command runs: a step whose every request is abandoned stops after its current layer
    (LLMEngine.step), so an abort of a long prompt lands within a layer, not a chunk.
  * `stats()` never waits for a step: it returns the snapshot taken after the last one.
  * What never changes after construction (block size, vocabulary size, context length) is
    read once, before the thread starts, into plain attributes; so is the engine's KV event
    log (`kv_events`), which is thread-safe itself (the engine thread appends to it). Services use those and the
    methods below; `self.engine` is for commands (`call`) only.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
import time
from collections import deque
from typing import Any, AsyncIterator, Callable, NamedTuple

from .llm_engine import LLMEngine, check_prompt_ids
from .outputs import EngineStats, RequestOutput
from .sampling_params import SamplingParams

log = logging.getLogger(__name__)


class RequestTimes(NamedTuple):
    """A request's engine-side timestamps (time.monotonic())."""
    arrival: float
    first_scheduled: float | None
    first_token: float | None


class EngineError(RuntimeError):
    """The engine thread failed (a step raised) or was shut down."""


_END = object()   # stream sentinel: closed without a finished output
STALL_RECHECK_S = 1.0


class AsyncEngine:
    def __init__(self, engine: LLMEngine, *, name: str = "engine", max_step_failures: int = 3,
                 on_health: Callable[[bool], None] | None = None):
        self.engine = engine
        self.name = name
        self.max_step_failures = max_step_failures
        self.on_health = on_health           # called on the loop when `healthy` changes
        self.step_failures = 0               # consecutive
        self._inbox: deque[tuple[Callable, tuple, concurrent.futures.Future]] = deque()
        self._cv = threading.Condition()
        self._stopping = False
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        # request_id -> asyncio.Queue; touched only by the engine thread
        self._streams: dict[str, asyncio.Queue] = {}
        # request_id -> the same queue, loop side, until stream() takes it
        self._unclaimed: dict[str, asyncio.Queue] = {}
        self._stats: EngineStats = engine.stats()
        self.num_steps = 0
        # construction-time facts, read here so the loop never reads the engine
        self.block_size: int = engine.kv.block_size
        self.vocab_size: int = engine.config.model.vocab_size
        self.max_model_len: int = engine.config.model.max_model_len
        # thread-safe itself (engine/kv_events.py): the KvEvents RPC reads it from the loop
        self.kv_events = getattr(engine, "kv_events", None)

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> None:
        """Start the engine thread; call from the event loop that will consume results."""
        if self._thread is not None:
            return
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name=f"{self.name}-step", daemon=True)
        self._thread.start()

    async def shutdown(self, timeout: float = 10.0) -> None:
        """Stop the thread after the command being run; pending commands fail, streams end."""
        with self._cv:
            self._stopping = True
            self._cv.notify()
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join, timeout)
            if self._thread.is_alive():
                log.error("%s thread did not stop within %.1fs", self.name, timeout)

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and not self._stopping

    @property
    def healthy(self) -> bool:
        return self.running and self.step_failures < self.max_step_failures

    # ------------------------------------------------------------------ commands
    def submit(self, fn: Callable, *args: Any) -> concurrent.futures.Future:
        """Queue `fn(*args)` to run on the engine thread; thread-safe."""
        fut: concurrent.futures.Future = concurrent.futures.Future()
        with self._cv:
            if self._stopping or self._thread is None:
                fut.set_exception(EngineError(f"{self.name} is not running"))
                return fut
            self._inbox.append((fn, args, fut))
            self._cv.notify()
        return fut

    async def call(self, fn: Callable, *args: Any) -> Any:
        """Run `fn(*args)` on the engine thread and return its result (or raise its error).
        `fn` may use `self.engine` freely: nothing else touches it meanwhile."""
        return await asyncio.wrap_future(self.submit(fn, *args))

    async def add_request(self, request_id: str, prompt, params: SamplingParams | None = None,
                          prefill_only: bool = False) -> None:
        """Admit a request; its outputs go to `stream(request_id)`. Raises ValueError."""
        q: asyncio.Queue = asyncio.Queue()

        def cmd():
            self.engine.add_request(request_id, prompt, params, prefill_only)
            self._streams[request_id] = q
        await self.call(cmd)
        self._unclaimed[request_id] = q

    async def add_remote_request(self, request_id: str, prompt_token_ids: list[int],
                                 params: SamplingParams | None = None
                                 ) -> tuple[list[int], int] | None:
        """Reserve blocks for a prompt whose KV comes from elsewhere. Returns (block_ids,
        num_cached_tokens), or None when the blocks are not there. Outputs after
        `remote_kv_done` go to `stream(request_id)`. Raises ValueError."""
        q: asyncio.Queue = asyncio.Queue()

        def cmd():
            req = self.engine.add_remote_request(request_id, prompt_token_ids, params)
            if req is None:
                return None
            self._streams[request_id] = q
            return list(req.block_ids), req.num_cached_tokens
        res = await self.call(cmd)
        if res is not None:
            self._unclaimed[request_id] = q
        return res

    async def remote_kv_done(self, request_id: str, first_token_id: int, logprob: float = 0.0,
                             top_logprobs=None) -> RequestOutput:
        """Returns the output holding the first token (not put on the stream unless it
        finished the request, which also ends the stream)."""
        def cmd():
            out = self.engine.remote_kv_done(request_id, first_token_id, logprob, top_logprobs)
            if out.finished:
                self._deliver(out)
            return out
        return await self.call(cmd)

    async def abort(self, request_id: str) -> bool:
        """Abort (frees its blocks, even a finished prefill-only request's); a stream being
        read ends with a finish_reason="abort" output, an unclaimed one is dropped. False if
        the engine did not know the id."""
        def cmd():
            found = self.engine.abort_request(request_id)
            q = self._streams.pop(request_id, None)
            if q is not None:
                self._put(q, RequestOutput(request_id, [], [], [], "", True, "abort"))
            return found
        self._unclaimed.pop(request_id, None)      # an unclaimed stream is dropped
        self.engine.abandoned.add(request_id)      # a step running it stops at its next layer
        found = await self.call(cmd)
        # an add awaited concurrently ran first (commands are FIFO) and registered its
        # stream after that pop (its continuation runs before this one): drop it too
        self._unclaimed.pop(request_id, None)
        return found

    async def abort_unscheduled(self, request_ids: list[str]) -> list[str]:
        """Those of `request_ids` no step has computed anything of yet: the ones the engine
        holds unscheduled are aborted (as abort() does) in the same engine-thread command,
        so no step can start them meanwhile; ids it does not hold are returned too (not
        started). A draining prefill worker hands these back."""
        def cmd():
            out = []
            for rid in request_ids:
                req = self.engine.requests.get(rid)
                if req is not None and (req.first_scheduled_time is not None or req.is_finished):
                    continue
                if req is not None:
                    self.engine.abort_request(rid)
                    q = self._streams.pop(rid, None)
                    if q is not None:
                        self._put(q, RequestOutput(rid, [], [], [], "", True, "abort"))
                out.append(rid)
            return out
        return await self.call(cmd)

    async def recompute_locally(self, request_id: str, prompt: list[int],
                                params: SamplingParams | None = None,
                                generated: list[int] = ()) -> None:
        """Turn a request that waits for remote KV into a local one: drop its reservation
        (blocks freed) and add it again with `prompt`, which this engine computes itself.
        `generated`: the tail of `prompt` that was already generated (the first token), fed
        to the request's grammar so its output continues it. Its stream, opened or not,
        stays and carries the new request's outputs. Raises ValueError (the reservation is
        dropped then too)."""
        def cmd():
            self.engine.abort_request(request_id)
            self.engine.add_request(request_id, prompt, params)
            self.engine.structured.prime(request_id, generated)
        await self.call(cmd)

    async def request_times(self, request_id: str) -> RequestTimes | None:
        """The request's arrival, first-scheduled and first-token times; None when the
        engine does not hold it (a finished prefill-only request is held until release)."""
        def cmd():
            req = self.engine.requests.get(request_id)
            if req is None:
                return None
            return RequestTimes(req.arrival_time, req.first_scheduled_time, req.first_token_time)
        return await self.call(cmd)

    def request_times_now(self, request_id: str) -> RequestTimes | None:
        """request_times() without waiting for the step in progress, for a request whose first
        token the caller already received: the engine wrote these times (once each) before it
        emitted that output, so reading them from the loop sees their final values."""
        req = self.engine.requests.get(request_id)
        if req is None:
            return None
        return RequestTimes(req.arrival_time, req.first_scheduled_time, req.first_token_time)

    async def release(self, request_id: str) -> None:
        """Free the blocks of a finished prefill-only request."""
        def cmd():
            self.engine.release(request_id)
            q = self._streams.pop(request_id, None)
            if q is not None:
                self._put(q, _END)
        self._unclaimed.pop(request_id, None)
        await self.call(cmd)

    def check_prompt(self, prompt_token_ids: list[int]) -> None:
        """ValueError unless the engine would take this prompt (vocabulary, context length);
        a pure check on the loop, before a worker commits anything to the request."""
        check_prompt_ids(prompt_token_ids, self.vocab_size, self.max_model_len)

    def stats(self) -> EngineStats:
        """The snapshot published after the last step or command batch (never blocks)."""
        return self._stats

    # ------------------------------------------------------------------ streams
    async def stream(self, request_id: str, coalesce: bool = False) -> AsyncIterator[RequestOutput]:
        """Outputs of a request until (and including) its finished one; one consumer per
        request. Open it after add_request/add_remote_request returned (outputs produced
        meanwhile are queued, not lost); raises KeyError for unknown or taken ids.

        `coalesce`: when several outputs are already queued (the consumer fell behind the
        engine), yield only the newest. Outputs are cumulative (token_ids, logprobs, text),
        so a consumer that sends the difference loses nothing and sends fewer messages;
        `new_token_ids` then covers only the last step."""
        q = self._unclaimed.pop(request_id, None)
        if q is None:
            raise KeyError(f"no stream for request {request_id!r} (unknown or already taken)")
        while True:
            item = await q.get()
            while coalesce and isinstance(item, RequestOutput) and not item.finished and not q.empty():
                item = q.get_nowait()
            if item is _END:
                return
            if isinstance(item, BaseException):
                raise item
            yield item
            if item.finished:
                return

    # ------------------------------------------------------------------ engine thread
    def _put(self, q: asyncio.Queue, item: Any) -> None:
        try:
            self._loop.call_soon_threadsafe(q.put_nowait, item)
        except RuntimeError:      # loop closed: nobody is listening any more
            pass

    def _deliver(self, out: RequestOutput) -> None:
        q = self._streams.get(out.request_id)
        if q is None:
            return
        if out.finished:
            # A finished prefill-only request keeps its stream until release(), so that a
            # stream() opened late still sees the output; everything else leaves now.
            if out.finish_reason != "prefill_done":
                del self._streams[out.request_id]
        out.emitted_at = time.monotonic()
        self._put(q, out)

    def _run(self) -> None:
        eng = self.engine
        while True:
            with self._cv:
                if eng.stalled and not self._inbox and not self._stopping:
                    self._cv.wait(STALL_RECHECK_S)
                while not self._inbox and not self._stopping and not eng.has_unfinished_requests():
                    self._cv.wait()
                if self._stopping:
                    pending = list(self._inbox)
                    self._inbox.clear()
                    break
                cmds = list(self._inbox)
                self._inbox.clear()
            results = []
            for fn, args, fut in cmds:
                if not fut.set_running_or_notify_cancel():
                    continue
                try:
                    results.append((fut, fn(*args), None))
                except BaseException as e:   # the caller gets it; the thread goes on
                    results.append((fut, None, e))
            if results:
                # a caller that awaited a command (release, abort) reads stats that include it
                self._stats = eng.stats()
                for fut, value, err in results:
                    if err is None:
                        fut.set_result(value)
                    else:
                        fut.set_exception(err)
            if eng.has_unfinished_requests():
                try:
                    outs = eng.step()
                    self.num_steps += 1
                    if self.step_failures:
                        self._set_failures(0)
                except Exception as e:
                    log.exception("%s step failed; aborting every request", self.name)
                    self._set_failures(self.step_failures + 1)
                    self._fail_all(EngineError(f"engine step failed: {type(e).__name__}: {e}"))
                    outs = []
                for out in outs:
                    self._deliver(out)
            self._stats = eng.stats()
        for _, _, fut in pending:
            if fut.set_running_or_notify_cancel():
                fut.set_exception(EngineError(f"{self.name} shut down"))
        self._fail_all(EngineError(f"{self.name} shut down"))

    def _set_failures(self, n: int) -> None:
        was = self.healthy
        self.step_failures = n
        if self.healthy != was and self.on_health is not None:
            self._loop.call_soon_threadsafe(self.on_health, self.healthy)

    def _fail_all(self, err: EngineError) -> None:
        for rid in list(self.engine.requests):
            try:
                self.engine.abort_request(rid)
            except Exception:  # keep going: the point is to free what we can
                log.exception("abort of %s failed", rid)
        for q in self._streams.values():
            self._put(q, err)
        self._streams.clear()
