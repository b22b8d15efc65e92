"""What a caller hands `Gateway.generate()` and gets back, and the state of one request.

    GenerateInput --generate()--> GenerateEvent ... (the last one carries Usage)
                               or GatewayError(grpc.StatusCode, message)

`RequestState` is the one object that owns a request across its segments (a migrated
request runs several): its output processor, deadline, the decode workers it lost, the
cached-token and energy totals, its metrics timer and trace span, and its TTFT phases.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import grpc

from engine.output_processor import Delta, Logprob, OutputProcessor
from engine.sampling_params import SamplingParams

from .waterfall import PhaseClock


class GatewayError(Exception):
    """A request failed; `code` is the grpc.StatusCode the caller should see."""

    def __init__(self, code: grpc.StatusCode, message: str, retry_after_s: int | None = None):
        super().__init__(f"{code.name}: {message}")
        self.code = code
        self.message = message
        self.retry_after_s = retry_after_s   # a refusal's hint: REST Retry-After, gRPC trailer


@dataclass
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0
    energy_joules: float | None = None   # GPU energy, prefill + decode; None: no power reading
    timings: PhaseClock | None = None    # the TTFT phases (complete once the first event is taken)


@dataclass
class GenerateInput:
    request_id: str                      # internal: what workers see (never a client's id)
    prompt_token_ids: list[int]
    params: SamplingParams
    deadline_s: float | None = None      # seconds the whole request may take; None: config
    trace_parent: object = None          # the caller's trace context (tracing.extract_context)
    public_id: str = ""                  # the id the client knows (logs, traces)
    arrived: float | None = None         # time.monotonic() the front got it (None: generate())


@dataclass
class GenerateEvent:
    token_ids: list[int]                 # new tokens in this event
    text: str                            # text delta
    logprobs: list[Logprob] | None = None   # one per new token, when params.logprobs is set
    finish_reason: str | None = None     # None | "stop" | "length" | "abort"
    stop_reason: int | str | None = None # the stop token id or stop string that matched
    usage: Usage | None = None           # on the last event
    prompt_logprobs: list | None = None  # first event only, when params.prompt_logprobs is set

    @classmethod
    def of(cls, d: Delta) -> "GenerateEvent":
        return cls(d.token_ids, d.text, d.logprobs, d.finish_reason, d.stop_reason)


@dataclass
class RequestState:
    """One request in the gateway, across segments."""
    inp: GenerateInput
    out: OutputProcessor
    deadline: float                      # loop time
    timeout_s: float
    timer: object                        # services.metrics.RequestTimer
    span: object                         # its pdserve.generate span
    metadata: object = None              # gRPC metadata for the workers (trace context)
    lost: set[str] = field(default_factory=set)   # decode workers that died under it
    cached_tokens: int = 0
    energy_joules: float | None = None   # summed over the workers that report it
    ok: bool = False                     # finished (not failed, not cancelled)
    error: str | None = None             # the failed request's status code name
    clock: PhaseClock = field(default_factory=PhaseClock)   # its TTFT phases (waterfall.py)

    def add_energy(self, msg) -> None:
        """Add a worker's energy_joules (PrefillResponse or Usage) when it has one."""
        if msg.HasField("energy_joules"):
            self.energy_joules = (self.energy_joules or 0.0) + msg.energy_joules

    def usage(self) -> Usage:
        return Usage(len(self.out.prompt_token_ids), len(self.out.token_ids), self.cached_tokens,
                     self.energy_joules, self.clock)

    def final(self, ev: GenerateEvent | None) -> GenerateEvent:
        """The last event of the request, with its usage (an empty one if `ev` is None)."""
        out = self.out
        ev = ev or GenerateEvent([], "", [] if out.params.logprobs is not None else None,
                                 out.finish_reason, out.stop_reason)
        ev.usage = self.usage()
        return ev
