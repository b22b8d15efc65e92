"""A worker's own cost of computing a prompt, measured at its warm-up, before it reports
SERVING (both roles; services/worker_server.py runs role.warm_up):

    tiny prompt         always: the engine's first step (first-call allocations, the CPU
                        kernels' first calls), so no real request pays for it
    the cost line       a long (WARM_UP_LONG_TOKENS) and a short (WARM_UP_SHORT_TOKENS)
                        prompt, timed to their first token: seconds = fixed + per_token x
                        tokens (`fit`) -- or, where this model was measured on this machine
                        before with the same engine options, threads and role, those
                        timings from the build cache (engine/build_cache.py, kind
                        "prefill-cost", a decode worker's "local-prefill-cost"; 1-5 s of the
                        default model's start-up on a busy 2-core machine). One worker of
                        this machine times at a time (`timing_lock`): `pdserve up` warms its
                        workers together, and two timing at once on 2 cores each measured
                        the other's load (the prefill worker's 2 threads came out slower
                        than the decode worker's 1)
    at the drain        `remember`: the cached timings made faster where the calls since
                        measured faster (the start's own timing runs beside the other
                        workers' loads)

Who reads it: the prefill worker's admission (prefill_worker/admission.py: seeded with the
samples, refitted from its completed calls), and the gateway, through both workers' Stats
(`prefill_cost`): --disaggregation auto weighs a decode worker's local prefill against a
prefill worker's (gateway/disagg.py), and a guess there would send lone long prompts to the
slower one until enough of each kind were observed.
"""
from __future__ import annotations

import asyncio
import contextlib
import fcntl
import logging
import time
from typing import Callable, Iterable

from engine.build_cache import engine_key, model_files, read_json, write_json
from engine.paths import cache_dir
from protos.pdserve.v1 import common_pb2

log = logging.getLogger(__name__)
WARM_UP_LONG_TOKENS = 256        # the warm-up's long prompt: the per-token cost's first measure
WARM_UP_SHORT_TOKENS = 8         # and its short one: the fixed cost's
KIND = "prefill-cost"             # the build cache's kind, a prefill worker's
LOCAL_KIND = "local-prefill-cost" # a decode worker's: an entry of its own (the cache keeps
                                  # one per kind and model)
MIN_CALLS = 8                    # completed calls before a drain's fit may improve the cache
MIN_PER_TOKEN_S = 1e-7           # 10M tokens/s: a line flatter than this is noise
LOCK_WAIT_S = 30.0               # the longest a warm-up waits for another's timing to end

Samples = list[tuple[int, float]]


def fit(points: Iterable[tuple[int, float]]) -> tuple[float, float] | None:
    """(fixed seconds, seconds per token): the least-squares line through (tokens, seconds),
    clamped to per_token >= MIN_PER_TOKEN_S and fixed >= 0 (a negative intercept: the best
    line through the origin); one distinct length: per_token = seconds / tokens, fixed 0;
    None without points."""
    pts = [(n, s) for n, s in points]
    if not pts:
        return None
    k = len(pts)
    mx = sum(n for n, _ in pts) / k
    my = sum(s for _, s in pts) / k
    sxx = sum((n - mx) ** 2 for n, _ in pts)
    if sxx < 1e-9 * max(mx * mx, 1.0):               # one distinct length: no slope to fit
        return 0.0, max(my / mx, MIN_PER_TOKEN_S)
    per_token = max(sum((n - mx) * (s - my) for n, s in pts) / sxx, MIN_PER_TOKEN_S)
    fixed = my - per_token * mx
    if fixed < 0:
        per_token = max(sum(n * s for n, s in pts) / sum(n * n for n, _ in pts), MIN_PER_TOKEN_S)
        fixed = 0.0
    return fixed, per_token


def to_proto(cost: tuple[float, float] | None) -> common_pb2.PrefillCost | None:
    """For a Stats reply (None: the field stays unset)."""
    return None if cost is None else common_pb2.PrefillCost(fixed_s=cost[0], per_token_s=cost[1])


async def measure(ae, prefill_only: bool) -> tuple[Samples, bool]:
    """Warm `ae` (an AsyncEngine) with a tiny prompt, then the (tokens, seconds) of the long
    and the short one: cached per (model, engine config, torch threads, role, lengths), or
    timed now and cached. Returns them and whether they came from the cache."""
    from services import worker_server     # the serving stack: not for the simulator's imports
    await worker_server.warm_up(ae, prefill_only)
    key, lengths, model_dir = _key(ae, prefill_only)
    samples = _samples(read_json(_kind(prefill_only), model_dir, key), lengths)
    if samples is not None:
        return samples, True
    async with timing_lock():
        samples = [(n, await worker_server.warm_up(ae, prefill_only, n)) for n in lengths]
    _store(prefill_only, model_dir, key, samples)
    return samples, False


@contextlib.asynccontextmanager
async def timing_lock(wait_s: float = LOCK_WAIT_S):
    """This machine's one timing slot (an flock on a file in the cache folder), waited for
    at most `wait_s` (then the timing runs anyway, and says so)."""
    path = cache_dir() / "warm-up-timing.lock"
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as f:
        deadline = time.monotonic() + wait_s
        while True:
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
                held = True
                break
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    log.warning("warm-up: another worker's timing still runs after %.0f s: "
                                "timing beside it", wait_s)
                    held = False
                    break
                await asyncio.sleep(0.02)       # the other's timing: a fraction of a second
        try:
            yield
        finally:
            if held:
                fcntl.flock(f, fcntl.LOCK_UN)


async def warm_up(ae, prefill_only: bool, who: str) -> tuple[Samples, tuple[float, float]]:
    """`measure`, then the line fitted through the samples, logged for `who`."""
    samples, cached = await measure(ae, prefill_only)
    cost = fit(samples)
    log.info("%s: a prompt costs %.1f ms + %.3f ms a token (warm-up%s)", who, cost[0] * 1e3,
             cost[1] * 1e3, ", cached" if cached else "")
    return samples, cost


def remember(ae, prefill_only: bool, estimate: Callable[[int], float]) -> None:
    """At the drain: the cached timings take, per length, the faster of their own and
    `estimate`'s (the worker's fit from its completed calls: a start measures while the
    other workers load, so its timing is often slow, and a cached one would stay so)."""
    key, lengths, model_dir = _key(ae, prefill_only)
    fitted = [(n, estimate(n)) for n in lengths]
    old = dict(_samples(read_json(_kind(prefill_only), model_dir, key), lengths) or fitted)
    _store(prefill_only, model_dir, key, [(n, min(s, old[n])) for n, s in fitted])


def _key(ae, prefill_only: bool) -> tuple[str, list[int], str]:
    import torch                 # loaded already: the engine runs on it
    fits = min(ae.max_model_len - 2, (ae.stats().num_total_blocks - 1) * ae.block_size)
    lengths = [min(WARM_UP_LONG_TOKENS, fits), WARM_UP_SHORT_TOKENS]
    config = ae.engine.config
    key = engine_key(_kind(prefill_only), config.model, engine=repr(config),
                     threads=torch.get_num_threads(), lengths=lengths)
    return key, lengths, config.model.model_dir


def _kind(prefill_only: bool) -> str:
    return KIND if prefill_only else LOCAL_KIND


def _store(prefill_only: bool, model_dir: str, key: str, samples: Samples) -> None:
    write_json(_kind(prefill_only), model_dir, key, {"samples": samples},
               [str(p) for p in model_files(model_dir)])


def _samples(cached: dict | None, lengths: list[int]) -> Samples | None:
    """The cached (tokens, seconds), if they are the lengths asked for and positive."""
    try:
        got = [(int(n), float(s)) for n, s in (cached or {})["samples"]]
    except (KeyError, TypeError, ValueError):
        return None
    ok = [n for n, _ in got] == lengths and all(s > 0 for _, s in got)
    return got if ok else None
