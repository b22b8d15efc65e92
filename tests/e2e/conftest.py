"""Fixtures that run a whole pdserve system (workers + gateway) as real local processes.

`start_system(num_prefill, num_decode, **launcher_kwargs)` starts one through
pdserve.launcher.Launcher on free 127.0.0.1 ports, waits until every process reports
SERVING over gRPC health (bounded), and stops every process at teardown, also when the test
failed. Its gateway prefills on the prefill workers (--disaggregation always) unless the
test's gateway_args name a mode. Each child's output goes to a log file under the test's tmp dir; a failed start
prints the tails.
"""
from __future__ import annotations

import os

import pytest

from pdserve.launcher import LaunchError, Launcher

START_TIMEOUT_S = 120.0


def _tails(launcher: Launcher, n: int = 3000) -> str:
    parts = []
    for c in launcher.children:
        if c.log is not None and not c.log.closed:
            c.log.flush()
        path = getattr(c.log, "name", None)
        if path and os.path.exists(path):
            with open(path, "rb") as f:
                parts.append(f"--- {c.role} {c.address}:\n" + f.read()[-n:].decode(errors="replace"))
    return "\n".join(parts)


@pytest.fixture(scope="session")
def model_dir():
    from engine.tiny_model import ensure_default_model
    return str(ensure_default_model())


def _start(model_dir, log_dir, num_prefill, num_decode, **kw) -> Launcher:
    """A started Launcher. Its gateway runs --disaggregation always unless gateway_args say
    (the fixtures' tests follow the disaggregated path; tests/e2e/test_disagg.py the others)."""
    args = list(kw.pop("gateway_args", []))
    if "--disaggregation" not in args:
        args += ["--disaggregation", "always"]
    launcher = Launcher(model_dir, num_prefill, num_decode, log_dir=log_dir, gateway_args=args, **kw)
    try:
        launcher.start(START_TIMEOUT_S)
    except LaunchError as e:
        pytest.fail(f"system did not start: {e}\n{_tails(launcher)}")
    return launcher


@pytest.fixture(scope="module")
def start_system(model_dir, tmp_path_factory):
    """Factory: start_system(num_prefill, num_decode, **Launcher kwargs) -> Launcher."""
    started: list[Launcher] = []

    def start(num_prefill: int = 1, num_decode: int = 1, **kw) -> Launcher:
        log_dir = tmp_path_factory.mktemp(f"system-{num_prefill}p{num_decode}d")
        launcher = _start(model_dir, log_dir, num_prefill, num_decode, **kw)
        started.append(launcher)
        return launcher

    yield start
    for launcher in started:
        launcher.stop()


@pytest.fixture(scope="module")
def system_2p2d(start_system):
    """Two prefill + two decode workers and a gateway, shared by one test module."""
    return start_system(2, 2, gateway_args=["--health-interval-s", "0.5"])
