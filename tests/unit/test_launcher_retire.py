"""Launcher.retire (scale-down): SIGTERM, a wait of the child's --drain-timeout-s + grace,
SIGKILL only after it; the retired child leaves `children` and supervision never restarts
it. Real processes (small Python programs standing in for workers), no model."""
from __future__ import annotations

import subprocess
import sys
import time

import pytest

from pdserve.launcher import RETIRE_GRACE_S, Launcher
from pdserve.processes import Child

pytestmark = pytest.mark.timeout(60)

# Prints "ready", then on SIGTERM waits `drain` seconds (its drain) and exits 0;
# `drain` < 0: ignores SIGTERM (a worker that hangs in its drain).
PROGRAM = """
import signal, sys, time
drain = float(sys.argv[1])
def term(*_):
    if drain >= 0:
        time.sleep(drain)
        sys.exit(0)
signal.signal(signal.SIGTERM, term)
print("ready", flush=True)
while True:
    time.sleep(0.05)
"""


def _child(drain_arg: str, behaviour: float) -> Child:
    c = Child("decode", "127.0.0.1:1", ["decode", "--worker-id", "decode-0",
                                        "--drain-timeout-s", drain_arg])
    c.popen = subprocess.Popen([sys.executable, "-c", PROGRAM, str(behaviour)],
                               stdout=subprocess.PIPE)
    assert c.popen.stdout.readline().strip() == b"ready"
    return c


def _launcher(*children: Child) -> tuple[Launcher, list[str]]:
    said: list[str] = []
    return Launcher("unused", children=list(children), say=said.append), said


def test_retire_waits_for_the_drain_and_never_restarts():
    c, other = _child("5", 0.5), _child("5", 0.5)
    launcher, said = _launcher(c, other)
    t0 = time.monotonic()
    launcher.retire(c)
    assert c.popen.returncode == 0, "the child did not exit by itself after its drain"
    assert time.monotonic() - t0 >= 0.5, "retire returned before the child drained"
    assert c.retired and c not in launcher.children and other in launcher.children
    assert any("retired: drained" in line for line in said), said
    # a supervision pass afterwards: nothing to restart (the retired child is gone)
    assert launcher.check_children(time.monotonic()) is None
    assert c.restart_at is None and c.restarts == 0
    other.popen.kill()
    other.popen.wait(5)


def test_supervision_skips_a_child_being_retired():
    """A child whose retire() is under way (marked, not yet removed) and already exited is
    not scheduled for a restart."""
    c = _child("5", 0.0)
    launcher, _ = _launcher(c)
    c.retired = True
    c.popen.terminate()
    c.popen.wait(5)
    assert launcher.check_children(time.monotonic()) is None
    assert c.restart_at is None and not c.crashes


def test_retire_kills_a_child_that_outlives_drain_plus_grace():
    c = _child("0.5", -1)          # ignores SIGTERM
    launcher, said = _launcher(c)
    t0 = time.monotonic()
    launcher.retire(c)
    took = time.monotonic() - t0
    assert c.popen.returncode == -9, "not SIGKILLed after drain + grace"
    assert took >= 0.5 + RETIRE_GRACE_S - 0.1, f"killed too early ({took:.1f}s)"
    assert any("killed (SIGKILL)" in line for line in said), said


def test_retire_timeout_overrides():
    c = _child("30", -1)
    launcher, _ = _launcher(c)
    t0 = time.monotonic()
    launcher.retire(c, timeout_s=0.3)
    assert c.popen.returncode == -9 and time.monotonic() - t0 < 10
