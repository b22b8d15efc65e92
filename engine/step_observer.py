"""The engine's step seam: who wants to know how long each step took and what it computed.

    LLMEngine(config, step_observers=[o, ...])
    each step() that computed tokens, once its tokens are sampled and appended:
        o.on_step(duration_s, {request_id: num_new_tokens})

`duration_s` is the step's wall time (schedule -> run -> sample -> update); it includes
the GPU work, which has finished when sampling returns. Called on the engine thread; an
observer must be cheap and must not raise. With no observers nothing is timed.
The energy meter (services.energy.EnergyMeter) is one.
"""
from __future__ import annotations

from typing import Mapping, Protocol


class StepObserver(Protocol):
    def on_step(self, duration_s: float, tokens: Mapping[str, int]) -> None:
        """One step of `duration_s` seconds computed tokens[request_id] tokens per request."""
