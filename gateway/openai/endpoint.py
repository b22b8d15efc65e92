"""What both OpenAI endpoints share: request body -> SamplingParams, the prompt check, the
choices of one request run together (`Run`), and the SSE and usage helpers.

Each choice is its own `Gateway.generate()` (gateway/choices.py fans them out, seeds
seed + i), merged as they come. `Run.start()` first waits for every choice's first event,
so routing errors (429 RESOURCE_EXHAUSTED, 503 UNAVAILABLE, 400 INVALID_ARGUMENT from a
worker) still get a real HTTP status; afterwards a stream sends a failure as an SSE `error`
event before `[DONE]`. When the client goes away, Starlette cancels the stream, which closes
every generate() generator: the gateway aborts both workers.
"""
from __future__ import annotations

import asyncio
import json
import math
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, AsyncIterator

from engine.sampling_params import SamplingParams
from engine.structured import StructuredOutput, validate as validate_structured

from ..choices import fan_out, merge_streams
from ..core import Gateway
from ..prompt import PromptError
from ..redact import public_message
from ..validate import check_request
from ..request import GatewayError, GenerateEvent, GenerateInput
from .errors import OpenAIError, bad, from_prompt


def sampling_params(body, max_tokens: int | None, logprobs: int | None,
                    prompt_logprobs: int | None = None,
                    structured: StructuredOutput | None = None) -> SamplingParams:
    kw = dict(temperature=1.0 if body.temperature is None else body.temperature,
              top_p=1.0 if body.top_p is None else body.top_p, top_k=body.top_k or 0,
              min_p=body.min_p or 0.0, seed=body.seed,
              presence_penalty=body.presence_penalty or 0.0,
              frequency_penalty=body.frequency_penalty or 0.0,
              repetition_penalty=body.repetition_penalty or 1.0, max_tokens=max_tokens,
              min_tokens=body.min_tokens, stop=body.stop or [],
              stop_token_ids=body.stop_token_ids or [], ignore_eos=body.ignore_eos,
              logprobs=logprobs, prompt_logprobs=prompt_logprobs, logit_bias=_logit_bias(body),
              skip_special_tokens=body.skip_special_tokens,
              include_stop_str_in_output=body.include_stop_str_in_output, structured=structured,
              speculative=body.speculative)
    try:
        return SamplingParams(**kw)
    except ValueError as e:
        msg = str(e)
        param = msg.split("invalid sampling parameter ", 1)[-1].split("=", 1)[0] \
            if msg.startswith("invalid sampling parameter") else None
        raise bad(msg, param) from None


def _logit_bias(body) -> dict[int, float]:
    bias = {}
    for k, v in (body.logit_bias or {}).items():
        try:
            bias[int(k)] = float(v)
        except ValueError:
            raise bad(f"logit_bias keys must be token ids, got {k!r}", "logit_bias") from None
        if not -100 <= v <= 100:
            raise bad(f"logit_bias values must be in [-100, 100], got {v}", "logit_bias")
    return bias


def response_format_spec(body) -> StructuredOutput | None:
    rf = body.response_format
    if rf is None or rf.type == "text":
        return None
    if rf.type == "json_object":
        return StructuredOutput(json_object=True)
    if rf.json_schema is None or rf.json_schema.schema_ is None:
        raise bad("response_format json_schema needs json_schema.schema", "response_format")
    return StructuredOutput(json_schema=rf.json_schema.schema_)


def check_structured(spec: StructuredOutput | None, param: str) -> None:
    if spec is None:
        return
    try:
        validate_structured(spec)
    except ValueError as e:
        raise bad(str(e), param) from None


@dataclass
class ChoiceOut:
    """Everything one choice produced (non-streaming, or what a stream holds back)."""
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    logprobs: list = field(default_factory=list)          # (logprob, top) per token
    finish_reason: str | None = None
    stop_reason: Any = None
    prompt_logprobs: list | None = None
    completion_tokens: int = 0
    cached_tokens: int = 0
    energy_joules: float | None = None
    timings: Any = None                  # its TTFT phases (waterfall.PhaseClock)

    def add(self, ev: GenerateEvent) -> None:
        self.token_ids += ev.token_ids
        self.text += ev.text
        if ev.logprobs:
            self.logprobs += ev.logprobs
        if ev.prompt_logprobs is not None:
            self.prompt_logprobs = ev.prompt_logprobs
        if ev.finish_reason is not None:
            self.finish_reason, self.stop_reason = ev.finish_reason, ev.stop_reason
        self.completion_tokens += len(ev.token_ids)
        if ev.usage is not None:
            self.completion_tokens = ev.usage.completion_tokens
            self.cached_tokens = ev.usage.cached_tokens
            self.energy_joules = ev.usage.energy_joules
            self.timings = ev.usage.timings


class Run:
    """One OpenAI request: several Gateway.generate() calls (choices), started together."""

    def __init__(self, gw: Gateway, inputs: list[GenerateInput]):
        self.gw, self.inputs = gw, inputs
        self.gens = [gw.generate(x) for x in inputs]
        self.firsts: list[GenerateEvent | None] = []

    async def start(self) -> None:
        """Wait for every choice's first event (so routing errors surface as a status)."""
        async def first(g):
            try:
                return await g.__anext__()
            except StopAsyncIteration:
                return None
        tasks = [asyncio.ensure_future(first(g)) for g in self.gens]
        try:
            done, pending = await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
            for t in pending:
                t.cancel()
            await asyncio.gather(*pending, return_exceptions=True)
            for t in tasks:
                if t.done() and not t.cancelled() and t.exception() is not None:
                    raise t.exception()
            self.firsts = [t.result() for t in tasks]
        except BaseException as e:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            await self.close()
            if isinstance(e, GatewayError):
                raise self._public(e) from None
            raise

    async def events(self) -> AsyncIterator[tuple[int, GenerateEvent]]:
        """(choice index, event) as they come, first events included; closes everything."""
        async def resume(first, g):
            if first is not None:
                yield first
                async for ev in g:
                    yield ev
        try:
            async for i, ev in merge_streams([resume(f, g) for g, f in zip(self.gens, self.firsts)]):
                yield i, ev
        except GatewayError as e:
            raise self._public(e) from None
        finally:
            await self.close()

    def _public(self, e: GatewayError) -> OpenAIError:
        """The error as the client sees it: no internal addresses (logged with the id)."""
        rid = self.inputs[0].public_id if self.inputs else ""
        return OpenAIError.from_gateway(e, public_message(e, rid, self.gw.worker_addresses()))

    async def close(self) -> None:
        for g in self.gens:
            try:
                await g.aclose()
            except Exception:     # a generator that failed is closed already
                pass

    async def collect(self) -> list[ChoiceOut]:
        outs = [ChoiceOut() for _ in self.inputs]
        async for i, ev in self.events():
            outs[i].add(ev)
        return outs


def sse(obj: Any) -> str:
    return f"data: {json.dumps(obj, separators=(',', ':'), allow_nan=False)}\n\n"


def finite(x: float | None) -> float | None:
    if x is None:
        return None
    return x if math.isfinite(x) else -9999.0


def usage(prompt_tokens: int, completion_tokens: int, cached: int, outs=(),
          timings: bool = False) -> dict:
    """OpenAI usage; `energy_joules` (GPU energy of `outs`' choices) only where measured;
    with `timings` (the body's pdserve.timings), `pdserve`: the first choice's TTFT phases."""
    u = {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
         "total_tokens": prompt_tokens + completion_tokens,
         "prompt_tokens_details": {"cached_tokens": cached}}
    energy = [o.energy_joules for o in outs if o.energy_joules is not None]
    if energy:
        u["energy_joules"] = sum(energy)
    if timings and outs:
        u["pdserve"] = timings_usage(outs[0].timings)
    return u


def timings_usage(clock) -> dict:
    """usage.pdserve: {"ttft_ms", "ttft_phases_ms"} (ttft_ms null: no token came out)."""
    if clock is None:
        return {"ttft_ms": None, "ttft_phases_ms": {}}
    return {"ttft_ms": round(clock.ttft_ms, 3) if clock.done else None,
            "ttft_phases_ms": {p: round(v, 3) for p, v in clock.phases_ms().items()}}


class Endpoint:
    """One request to an endpoint of one model (app.py picked `gw` by the body's `model`): its
    id, token strings, prompt checks."""
    prefix = ""

    def __init__(self, gw: Gateway, body, trace_parent=None, arrived: float | None = None):
        self.gw, self.body, self.trace_parent = gw, body, trace_parent
        self.arrived = arrived               # time.monotonic() the request head came in
        self.timings = bool(body.pdserve and body.pdserve.timings)
        self.id = f"{self.prefix}-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self._tok_cache: dict[int, str] = {}

    def token_str(self, t: int) -> str:
        s = self._tok_cache.get(t)
        if s is None:
            s = self._tok_cache[t] = self.gw.tokenizer.decode([t], skip_special_tokens=False)
        return s

    def check_prompt(self, ids: list[int], max_tokens: int | None, param: str) -> None:
        try:
            self.gw.check_prompt(ids, max_tokens)
        except PromptError as e:
            raise from_prompt(e, param) from None

    def inputs(self, prompts: list[list[int]], params: SamplingParams, n: int) -> list[GenerateInput]:
        """One input per choice, once the request passed gateway/validate.py's check."""
        check_request(params, n, [len(p) for p in prompts], self.gw.vocab_size, self.gw.max_model_len)
        return fan_out(self.id, prompts, params, n, self.trace_parent, self.arrived)
