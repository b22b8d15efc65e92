"""A launcher's child dies with it: `die_with_parent` (run by every child at start) sets
PR_SET_PDEATHSIG, so a SIGKILLed launcher leaves no orphans, and a child whose launcher is
already gone exits at once. Real processes; the child is the code path `pdserve.cli` runs."""
from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from pdserve.launcher import PARENT_ENV

pytestmark = pytest.mark.timeout(60)

CHILD = "from pdserve.launcher import die_with_parent; die_with_parent(); import time; time.sleep(60)"
# A parent that starts the child as the Launcher does (its pid in PARENT_ENV), prints the
# child's pid, then waits to be killed.
PARENT = f"""
import os, subprocess, sys, time
env = dict(os.environ, {PARENT_ENV}=str(os.getpid()))
p = subprocess.Popen([sys.executable, "-c", {CHILD!r}], env=env)
print(p.pid, flush=True)
time.sleep(60)
"""


def _gone(pid: int, within_s: float) -> bool:
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.05)
    return False


def test_a_sigkilled_launcher_takes_its_children_with_it():
    parent = subprocess.Popen([sys.executable, "-c", PARENT], stdout=subprocess.PIPE, text=True)
    try:
        child = int(parent.stdout.readline())
        time.sleep(1.0)                       # the child has run die_with_parent
        assert not _gone(child, 0.1), "the child exited on its own"
        parent.kill()
        parent.wait(10)
        # the child is reparented, so nobody reaps it: gone means a zombie or removed
        assert _gone(child, 10) or _is_zombie(child), "the child outlived its launcher"
    finally:
        parent.kill()
        parent.wait(10)


def _is_zombie(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def test_a_child_whose_launcher_is_already_gone_exits_at_once():
    env = dict(os.environ, **{PARENT_ENV: "1"})      # pid 1 is not our parent
    r = subprocess.run([sys.executable, "-c", CHILD], env=env, capture_output=True, text=True,
                       timeout=30)
    assert r.returncode != 0 and "is gone" in r.stderr


def test_without_the_variable_nothing_is_set():
    r = subprocess.run([sys.executable, "-c",
                        "from pdserve.launcher import die_with_parent; die_with_parent(); print('ok')"],
                       env={k: v for k, v in os.environ.items() if k != PARENT_ENV},
                       capture_output=True, text=True, timeout=30)
    assert r.returncode == 0 and r.stdout.strip() == "ok"
