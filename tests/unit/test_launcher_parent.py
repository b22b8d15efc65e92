"""A launcher's child dies with it: `die_with_parent` (run by every child at start, from
`pdserve --parent-pid PID`) sets PR_SET_PDEATHSIG, so a SIGKILLed launcher leaves no orphans,
and a child whose launcher is already gone exits at once. Real processes; the child is the
code path `pdserve.cli` runs. And the command line a child gets: the launcher's pid, and
after a restart its count (--restarts), which a worker's config and metrics take."""
from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from pdserve import cli
from pdserve.launcher import Launcher
from pdserve.processes import Child

pytestmark = pytest.mark.timeout(60)

# argv[1]: the parent's pid, as `pdserve --parent-pid` hands it to die_with_parent
CHILD = ("import sys; from pdserve.processes import die_with_parent; "
         "die_with_parent(int(sys.argv[1])); import time; time.sleep(60)")
# A parent that starts the child as the Launcher does (its pid on the command line), prints
# the child's pid, then waits to be killed.
PARENT = f"""
import os, subprocess, sys, time
p = subprocess.Popen([sys.executable, "-c", {CHILD!r}, str(os.getpid())])
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
    r = subprocess.run([sys.executable, "-c", CHILD, "1"],      # pid 1 is not our parent
                       capture_output=True, text=True, timeout=30)
    assert r.returncode != 0 and "is gone" in r.stderr


def test_without_a_parent_pid_nothing_is_set():
    r = subprocess.run([sys.executable, "-c",
                        "from pdserve.processes import die_with_parent; die_with_parent(0); print('ok')"],
                       capture_output=True, text=True, timeout=30)
    assert r.returncode == 0 and r.stdout.strip() == "ok"


def test_pdserve_hands_its_parent_pid_to_die_with_parent_first(monkeypatch):
    seen = []

    def record(pid):
        seen.append(pid)
        raise SystemExit(0)                  # before the role runs
    monkeypatch.setattr(cli, "die_with_parent", record)
    with pytest.raises(SystemExit):
        cli.main(["--parent-pid", "4321", "decode", "--model-dir", "m"])
    with pytest.raises(SystemExit):
        cli.main(["gateway"])
    assert seen == [4321, 0]


def test_a_restarted_worker_is_told_its_restart_count_on_its_command_line(monkeypatch):
    """The supervisor's restart: the same arguments, the launcher's pid, --restarts N; the
    worker's config takes it and its metrics export it as pdserve:process_restarts."""
    from decode_worker.config import DecodeWorkerConfig
    from services.cli_args import config_from_argv
    from services.metrics import Metrics, render_metrics
    started = []
    monkeypatch.setattr(Child, "start", lambda c: started.append(c.command(os.getpid())))
    dead = type("Popen", (), {"poll": lambda self: 1})()
    c = Child("decode", "127.0.0.1:1", ["decode", "--model-dir", "m", "--port", "1"], popen=dead)
    first = c.command(os.getpid())
    assert first == [sys.executable, "-m", "pdserve.cli", "--parent-pid", str(os.getpid()),
                     "decode", "--model-dir", "m", "--port", "1"]
    launcher = Launcher(restart_backoff_s=1.0, children=[c])
    assert launcher.check_children(100.0) is None and c.restart_at == 101.0 and not started
    assert launcher.check_children(101.0) is None and c.restarts == 1
    assert started == [first + ["--restarts", "1"]]
    argv = started[0][started[0].index("decode") + 1:]
    cfg = config_from_argv(DecodeWorkerConfig, argv, "decode")
    assert cfg.restarts == 1 and cfg.port == 1
    text = render_metrics(Metrics("decode", restarts=cfg.restarts).registry).decode()
    assert 'pdserve:process_restarts{role="decode"} 1.0' in text
