"""GPU energy per request, where NVML reports the GPU's power.

An `EnergyMeter` is an engine step observer (engine/step_observer.py): the engine calls
`on_step(duration_s, {request_id: num_tokens})` after each step that computed tokens; power
(W) times the step's wall time is split over the step's requests by their share of its
tokens; `pop(request_id)` -> joules (None where there is no power reading). Only energy spent
inside steps is counted (idle power is nobody's request). Without a power reading the worker
does not register the meter with its engine at all (CPU hosts pay nothing).
"""
from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Mapping

log = logging.getLogger(__name__)

PowerReader = Callable[[], "float | None"]     # watts now, or None when unknown


def nvml_power_reader(device_index: int = 0) -> PowerReader | None:
    """A reader of the GPU's power draw in watts via NVML; None where NVML is not there
    (no pynvml, no driver, no GPU, or a GPU that does not report power)."""
    try:
        import pynvml
        pynvml.nvmlInit()
        handle = pynvml.nvmlDeviceGetHandleByIndex(device_index)
        pynvml.nvmlDeviceGetPowerUsage(handle)          # probe: raises if unsupported
    except Exception as e:  # ImportError, NVMLError_* (library not found, not supported)
        log.info("energy: no NVML power reading (%s: %s)", type(e).__name__, e)
        return None

    def read() -> float | None:
        try:
            return pynvml.nvmlDeviceGetPowerUsage(handle) / 1000.0    # mW -> W
        except Exception:
            return None
    return read


class EnergyMeter:
    """Integrates power over engine steps and attributes it to requests by token share.

    Thread-safe: `on_step` runs on the engine thread, `pop` on the event loop. Power is read at
    most every `min_interval_s` (an NVML call costs tens of microseconds; its own reading is
    an average over a longer window anyway); in between the last reading is reused.
    """

    def __init__(self, read_power_w: PowerReader | None,
                 on_joules: Callable[[float], None] | None = None, min_interval_s: float = 0.02):
        self._read = read_power_w
        self.on_joules = on_joules
        self.min_interval_s = min_interval_s
        self._watts: float | None = None
        self._read_at = float("-inf")
        self._joules: dict[str, float] = {}
        self._lock = threading.Lock()
        self.total_joules = 0.0

    @property
    def available(self) -> bool:
        return self._read is not None

    def on_step(self, duration_s: float, tokens: Mapping[str, int]) -> None:
        """One engine step of `duration_s` wall seconds that computed tokens[request_id]
        tokens per request."""
        if self._read is None or duration_s <= 0:
            return
        now = time.monotonic()
        if now - self._read_at >= self.min_interval_s:
            self._watts, self._read_at = self._read(), now
        watts = self._watts
        if watts is None:
            return
        joules = watts * duration_s
        total = sum(tokens.values())
        with self._lock:
            self.total_joules += joules
            if total > 0:
                for rid, n in tokens.items():
                    if n:
                        self._joules[rid] = self._joules.get(rid, 0.0) + joules * n / total
        if self.on_joules is not None:
            self.on_joules(joules)

    def pop(self, request_id: str) -> float | None:
        """The joules attributed to a request (and forget it); None without a power reading.
        Call it when the request finishes or is aborted."""
        if self._read is None:
            return None
        with self._lock:
            return self._joules.pop(request_id, 0.0)


def gpu_index(device: str) -> int | None:
    """The NVML index of a torch device string ("cuda", "cuda:1"); None for CPU. Honours a
    numeric CUDA_VISIBLE_DEVICES (torch's index i is the i-th listed GPU)."""
    if not device.startswith("cuda"):
        return None
    i = int(device.split(":", 1)[1]) if ":" in device else 0
    visible = [v for v in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if v.strip()]
    if visible and all(v.strip().isdigit() for v in visible) and i < len(visible):
        return int(visible[i])
    return i
