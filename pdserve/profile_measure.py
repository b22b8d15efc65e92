"""The measurements behind `pdserve profile`, with the engine in this process.

    prefill   one prefill-only request per run, its chunk computed in ONE step (chunk <=
              max_num_batched_tokens); for a cached prefix, a first pass of prefix + chunk
              puts the prefix in the prefix cache (released, its blocks stay cached), and the
              timed pass of prefix + a fresh chunk computes only the chunk, after
              `cached_tokens` from the cache; the runs go in rounds over every point
    decode    `batch` requests sharing one prompt prefix of ~context-1 tokens (computed once,
              from the prefix cache for the others and for later points) plus one token of
              their own; once every one decodes, k decode steps are timed (each advances
              every request by one token)
    handover  the project's KVSender -> KVReceiver (kvtransfer) in one event loop, over UCX
              loopback where ucxx imports, else the in-process LoopbackTransport: the time
              from the first layer pushed to the receiver's DONE for a prompt's blocks, every
              layer pushed back to back (no overlap with compute: an upper bound of what the
              decode side waits after the prompt's compute ends)
    gateway   the gateway's own prompt code (gateway.prompt.chat_prompt_ids: chat template +
              tokenizer) on a ~500-token chat message; routing and the stream set-up are not
              in it (microseconds beside the template)

A step's time is what the engine's step observer reports (schedule -> run -> sample ->
update), the same span the workers' live step metrics measure. Every point is the median of
`repeat` runs after a warm-up that is never recorded.
"""
from __future__ import annotations

import asyncio
import random
import statistics
import time
from dataclasses import dataclass

import torch

from engine.kv_cache_manager import cdiv
from engine.sampling_params import SamplingParams


class StepClock:
    """A step observer: the last step's duration and its tokens per request."""

    def __init__(self):
        self.last: tuple[float, dict] = (0.0, {})

    def on_step(self, duration_s, tokens) -> None:
        self.last = (duration_s, dict(tokens))


@dataclass
class Progress:
    """A counted progress bar on stderr: `tick()` per measured unit."""
    total: int
    stream: object = None
    done: int = 0

    def tick(self, what: str = "") -> None:
        self.done += 1
        if self.stream is None:
            return
        width = 30
        filled = width * self.done // max(self.total, 1)
        self.stream.write(f"\r[{'#' * filled}{'.' * (width - filled)}] {self.done}/{self.total} "
                          f"{what:<28}")
        if self.done >= self.total:
            self.stream.write("\n")
        self.stream.flush()


class Measurer:
    """Runs the points on one LLMEngine (its clock: a StepClock among its step observers)."""

    def __init__(self, engine, clock: StepClock, repeat: int, progress: Progress, seed: int = 0):
        self.engine, self.clock, self.repeat, self.progress = engine, clock, repeat, progress
        self.rng = random.Random(seed)
        self.vocab = engine.config.model.vocab_size
        self.block_size = engine.kv.block_size
        self._ids = 0
        self._prefixes: dict[int, list[int]] = {}

    def _tokens(self, n: int) -> list[int]:
        """Fresh random ids: no prefix-cache hit with anything run before."""
        return [self.rng.randrange(3, self.vocab) for _ in range(n)]

    def _id(self) -> str:
        self._ids += 1
        return f"profile-{self._ids}"

    def _run_prefill(self, prompt: list[int]) -> tuple[float, int, int]:
        """Prefill `prompt` to its first token: (its last step's seconds, that step's tokens of
        it, its prefix-cache hit)."""
        rid = self._id()
        req = self.engine.add_request(rid, prompt, SamplingParams(max_tokens=1, ignore_eos=True),
                                      prefill_only=True)
        for _ in range(cdiv(len(prompt), self.engine.config.scheduler.max_num_batched_tokens) + 2):
            if req.is_finished:
                break
            self.engine.step()
        if not req.is_finished:
            raise RuntimeError(f"prefill of {len(prompt)} tokens did not finish")
        seconds, tokens = self.clock.last
        self.engine.release(rid)
        return seconds, tokens.get(rid, 0), max(req.num_cached_tokens, 0)

    def _prefix(self, n: int) -> list[int]:
        """The same `n` random tokens each call (block-aligned, kept per length): a prefix that
        stays in the prefix cache between the points that share it."""
        n = n // self.block_size * self.block_size
        if n not in self._prefixes:
            self._prefixes[n] = self._tokens(n)
        return self._prefixes[n]

    def prefill_points(self, plan: list[tuple[int, int]]) -> list[dict]:
        """Each (chunk, cached) point `repeat` times, in rounds over all the points (a burst of
        load on a shared machine then spoils one run of several points, not every run of
        one); each point's median."""
        times: dict[tuple[int, int], list[float]] = {pt: [] for pt in plan}
        for r in range(self.repeat):
            for chunk, cached in plan:
                times[(chunk, cached)].append(self._prefill_once(chunk, cached))
                self.progress.tick(f"prefill {chunk}+{cached} ({r + 1}/{self.repeat})")
        return [{"chunk_tokens": chunk, "cached_tokens": cached,
                 "seconds": statistics.median(times[(chunk, cached)])} for chunk, cached in plan]

    def _prefill_once(self, chunk: int, cached: int) -> float:
        """One step computing `chunk` fresh tokens after `cached` from the prefix cache."""
        for _ in range(2):      # a prefix not (or no longer) cached: this pass puts it back
            prompt = self._prefix(cached) + self._tokens(chunk)
            seconds, tokens, hit = self._run_prefill(prompt)
            if hit >= cached:
                break
        if tokens != chunk or hit != cached:
            raise RuntimeError(f"prefill step computed {tokens} tokens after {hit} cached, not "
                               f"{chunk} after {cached}: is max_num_batched_tokens >= {chunk}?")
        return seconds

    def decode_point(self, batch: int, context_per_seq: int, steps: int) -> dict:
        """`batch` sequences of ~context_per_seq tokens each (a shared prefix + a few of their
        own), then `steps` timed decode steps; seconds: their median."""
        prefix = self._prefix(context_per_seq - 1)      # + one token of each request's own
        own = max(1, context_per_seq - len(prefix))
        ids, reqs = [], []
        params = SamplingParams(max_tokens=steps + 8, ignore_eos=True)   # set-up: <= 2 more
        try:
            for i in range(batch):
                rid = self._id()
                reqs.append(self.engine.add_request(rid, prefix + self._tokens(own), params))
                ids.append(rid)
                if i == 0:      # its prefix blocks cached before the others look them up
                    self._until_computed(reqs)
            return self._time_decode(reqs, steps, batch)
        finally:
            for rid in ids:
                self.engine.abort_request(rid)
            self.progress.tick(f"decode b={batch} ctx={context_per_seq}")

    def _until_computed(self, reqs) -> None:
        guard = sum(cdiv(r.num_tokens, self.engine.config.scheduler.max_num_batched_tokens)
                    for r in reqs) + len(reqs) + 4
        while any(r.num_computed_tokens < r.num_prompt_tokens for r in reqs):
            self.engine.step()
            guard -= 1
            if guard < 0:
                raise RuntimeError("decode set-up: the prompts were not computed")

    def _time_decode(self, reqs, steps, batch) -> dict:
        self._until_computed(reqs)
        times, ctx = [], []
        for _ in range(steps):
            ctx.append(sum(r.num_computed_tokens for r in reqs))
            self.engine.step()
            seconds, tokens = self.clock.last
            if len(tokens) != batch or any(v != 1 for v in tokens.values()):
                raise RuntimeError(f"not a decode step of {batch}: {len(tokens)} requests, "
                                   f"{sum(tokens.values())} tokens (max_num_seqs too small?)")
            times.append(seconds)
        return {"batch": batch, "context_tokens": int(statistics.median(ctx)),
                "seconds": statistics.median(times)}

    def warm_up(self, chunk: int, batch: int) -> None:
        """The first passes are slow (allocations, kernel builds): run and forget them."""
        counted, self.progress = self.progress, Progress(0)      # not counted points
        try:
            for n in (chunk, min(chunk, 64)):
                self._run_prefill(self._tokens(n))
            self.decode_point(batch, 2 * self.block_size, 3)
            self.decode_point(1, 2 * self.block_size, 3)
        finally:
            self.progress = counted


def handover_points(engine, prompt_lengths: list[int], repeat: int, progress: Progress) -> tuple[list[dict], str]:
    """KV handover of each prompt length over the project's sender/receiver; and the transport
    used ("ucx" or "loopback")."""
    return asyncio.run(_handover(engine, prompt_lengths, repeat, progress))


def _transports():
    try:
        from kvtransfer.ucx import UcxTransport
        return UcxTransport(host="127.0.0.1"), UcxTransport(host="127.0.0.1"), "ucx"
    except Exception:              # ucxx absent or not loadable here
        from kvtransfer.transport import LoopbackTransport
        return LoopbackTransport(), LoopbackTransport(), "loopback"


async def _handover(engine, prompt_lengths, repeat, progress):
    from kvtransfer.receiver import KVReceiver
    from kvtransfer.sender import KVSender
    from kvtransfer.wire import CompatKey
    src = engine.kv_cache
    nb = min(src.shape[2], max(cdiv(n, engine.kv.block_size) for n in prompt_lengths))
    dst = torch.zeros_like(src[:, :, :nb])
    scales = engine.kv_scales
    dst_scales = None if scales is None else torch.zeros_like(scales[:, :, :nb])
    layout, name = engine.config.model.kv_layout(), engine.config.model.name
    tx_t, rx_t, kind = _transports()
    rx = KVReceiver(dst, CompatKey.from_cache(dst, name, dst_scales, layout), rx_t, 30.0,
                    kv_scales=dst_scales)
    tx = KVSender(src, CompatKey.from_cache(src, name, scales, layout), tx_t, kv_scales=scales)
    endpoint = await rx.start()
    points, n_transfer = [], 0
    try:
        for n in prompt_lengths:
            blocks = min(cdiv(n, engine.kv.block_size), nb)
            times = []
            for _ in range(repeat + 1):          # the first (connect, buffers) is not kept
                n_transfer += 1
                tid = f"profile-kv-{n_transfer}"
                rx.reserve(tid, list(range(blocks)))
                h = await tx.open(tid, endpoint, list(range(blocks)), list(range(blocks)))
                t0 = time.perf_counter()
                for layer in range(src.shape[0]):
                    tx.push_layer_threadsafe(h, layer)
                await tx.finish(h, 30.0)
                result = await rx.wait(tid, 30.0)
                times.append(time.perf_counter() - t0)
                if result.state.name != "DONE":
                    raise RuntimeError(f"KV handover of {blocks} blocks: {result.state.name}")
            points.append({"prompt_tokens": n, "seconds": statistics.median(times[1:])})
            progress.tick(f"handover {n}")
    finally:
        await tx.close()
        await rx.close()
    return points, kind


def gateway_seconds(tokenizer, repeat: int) -> float:
    """The gateway's prompt preparation of one ~500-token chat request (median)."""
    from gateway.prompt import chat_prompt_ids
    words = ("the quick brown fox jumps over a lazy dog while seven wizards quietly judge "
             "boxing matches").split()
    rng = random.Random(0)
    text = " ".join(rng.choice(words) for _ in range(450))
    messages = [{"role": "system", "content": "You are a helpful assistant."},
                {"role": "user", "content": text}]

    async def run() -> list[float]:
        out = []
        for _ in range(repeat + 1):
            t0 = time.perf_counter()
            await chat_prompt_ids(tokenizer, messages)
            out.append(time.perf_counter() - t0)
        return out[1:]
    return statistics.median(asyncio.run(run()))
