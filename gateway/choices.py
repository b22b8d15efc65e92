"""The choices of an n > 1 request: one `generate()` each, merged back into one stream.

    fan_out(rid, prompts, params, n)  ->  GenerateInput per (prompt k, choice j):
        index k * n + j, seed + j; public id rid-index (rid alone when there is one), and
        an internal request id of its own, random: a response id or a client's request_id
        names nothing a worker accepts, and two clients' equal ids never collide
    merge_streams(generate() per input) ->  (index, GenerateEvent) as they come

Both fronts use these: the gRPC API (one prompt) and the OpenAI shim (completions may send
several prompts).
"""
from __future__ import annotations

import asyncio
import uuid
from dataclasses import replace
from typing import AsyncIterator

from engine.sampling_params import SamplingParams

from .request import GenerateEvent, GenerateInput


def fan_out(rid: str, prompts: list[list[int]], params: SamplingParams, n: int,
            trace_parent=None, arrived: float | None = None) -> list[GenerateInput]:
    """One n=1 GenerateInput per choice of each prompt (seeds seed + j, j the choice)."""
    total = len(prompts) * n
    inputs = []
    for k, ids in enumerate(prompts):
        for j in range(n):
            p = params if n == 1 else replace(
                params, n=1, seed=None if params.seed is None else params.seed + j)
            public = rid if total == 1 else f"{rid}-{k * n + j}"
            inputs.append(GenerateInput(f"req-{uuid.uuid4().hex}", list(ids), p,
                                        trace_parent=trace_parent, public_id=public,
                                        arrived=arrived))
    return inputs


async def merge_streams(gens: list) -> AsyncIterator[tuple[int, GenerateEvent]]:
    """(index, event) from several `generate()` streams (the choices of an n > 1 request) as
    they come; the first error is raised; leaving early closes them all."""
    if len(gens) == 1:
        agen = gens[0]
        try:
            async for ev in agen:
                yield 0, ev
        finally:
            await agen.aclose()
        return
    queue: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(i, agen):
        try:
            async for ev in agen:
                await queue.put((i, ev))
            await queue.put((i, done))
        except BaseException as e:  # handed to the consumer, which re-raises
            await queue.put((i, e))

    tasks = [asyncio.create_task(pump(i, g)) for i, g in enumerate(gens)]
    try:
        left = len(tasks)
        while left:
            i, item = await queue.get()
            if item is done:
                left -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
