"""The prefill worker's warm-up, before it reports SERVING (services/worker_server.py):

    tiny prompt         always: the engine's first step (first-call allocations, the CPU
                        kernels' first calls), so no real request pays for it
    the admission seed  a long (WARM_UP_LONG_TOKENS) and a short (WARM_UP_SHORT_TOKENS)
                        prompt, timed: the admission's cost model starts from them
                        (admission.py: fixed and per-token seconds) -- or, where this
                        model was measured on this machine before with the same engine
                        options and threads, those timings from the build cache
                        (engine/build_cache.py, kind "prefill-cost"; 1-5 s of the default
                        model's start-up on a busy 2-core machine). The admission refits from
                        its completed calls from then on, either way.
    at the drain        `remember`: the cached seed made faster where the calls since measured
                        faster (the start's own timing runs beside the other workers' loads)
"""
from __future__ import annotations

import logging

from engine.build_cache import engine_key, model_files, read_json, write_json
from services import worker_server

log = logging.getLogger(__name__)
WARM_UP_LONG_TOKENS = 256        # the warm-up's long prompt: the per-token cost's first measure
WARM_UP_SHORT_TOKENS = 8         # and its short one: the fixed cost's
KIND = "prefill-cost"
MIN_CALLS = 8                    # completed calls before a drain's fit may improve the seed


async def warm_up(admission, ae) -> None:
    """Warm `ae` (an AsyncEngine) and seed `admission` (a PrefillAdmission), measured or
    cached per (model, engine config, torch threads, prompt lengths)."""
    await worker_server.warm_up(ae, True)
    key, lengths, model_dir = _key(ae)
    cached = _samples(read_json(KIND, model_dir, key), lengths)
    samples = cached
    if samples is None:
        samples = [(n, await worker_server.warm_up(ae, True, n)) for n in lengths]
        _store(model_dir, key, samples)
    admission.seed(samples)
    fixed, per_token = admission.cost()
    log.info("prefill cost from the warm-up%s: %.1f ms + %.3f ms a prompt token",
             " (cached)" if cached else "", fixed * 1e3, per_token * 1e3)


def remember(admission, ae) -> None:
    """At the drain: where the admission fitted its cost from at least MIN_CALLS completed
    calls, the cached seed takes, per length, the faster of its own and the fit's seconds (a
    start measures while the other workers load: its timing is often slow, and a cached one
    would stay so)."""
    if admission.num_samples < MIN_CALLS:
        return
    key, lengths, model_dir = _key(ae)
    fitted = [(n, admission.estimate(n)) for n in lengths]
    old = dict(_samples(read_json(KIND, model_dir, key), lengths) or fitted)
    _store(model_dir, key, [(n, min(s, old[n])) for n, s in fitted])


def _key(ae) -> tuple[str, list[int], str]:
    import torch                 # loaded already: the engine runs on it
    fits = min(ae.max_model_len - 2, (ae.stats().num_total_blocks - 1) * ae.block_size)
    lengths = [min(WARM_UP_LONG_TOKENS, fits), WARM_UP_SHORT_TOKENS]
    config = ae.engine.config
    key = engine_key(KIND, config.model, engine=repr(config), threads=torch.get_num_threads(),
                     lengths=lengths)
    return key, lengths, config.model.model_dir


def _store(model_dir: str, key: str, samples: list[tuple[int, float]]) -> None:
    write_json(KIND, model_dir, key, {"samples": samples}, [str(p) for p in model_files(model_dir)])


def _samples(cached: dict | None, lengths: list[int]) -> list[tuple[int, float]] | None:
    """The cached (tokens, seconds), if they are the lengths asked for and positive."""
    try:
        got = [(int(n), float(s)) for n, s in (cached or {})["samples"]]
    except (KeyError, TypeError, ValueError):
        return None
    ok = [n for n, _ in got] == lengths and all(s > 0 for _, s in got)
    return got if ok else None
