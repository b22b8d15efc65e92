"""The workers' zygote (pdserve/zygote.py), with a light preload: each forked child runs
`pdserve <argv>` with the environment it is given (the whole of it) and its output in the
log file handed over; its exit code comes back as Popen's would (negative: killed by a
signal); a worker forked while the gateway-only secret is in the launcher's environment
never holds it; a closed zygote leaves the launcher starting plain processes; and the
zygote, started with the real preload, forks after torch is imported without any thread."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from pdserve.processes import Child
from pdserve.zygote import Forked, Zygote

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def zygote():
    z = Zygote(preload=("json",))
    yield z
    z.close()


def test_a_child_runs_pdserve_with_its_env_and_log_and_tells_its_exit(zygote, tmp_path):
    log = open(tmp_path / "out.log", "wb")
    f = zygote.spawn(["--help"], {"PATH": os.environ["PATH"], "PDSERVE_TEST_MARK": "x"}, log)
    assert f.wait(60) == 0 and f.poll() == 0 and f.pid > 0
    assert (tmp_path / "out.log").read_text().startswith("usage: pdserve")
    bad = zygote.spawn(["no-such-command"], {}, log)
    assert bad.wait(60) == 2                        # argparse's usage error


def test_a_wait_for_a_pid_that_never_comes_is_bounded(zygote):
    slow = Forked(zygote, ["pdserve"])              # asked for, never forked
    with pytest.raises(subprocess.TimeoutExpired):
        slow.wait(0.2)
    assert slow.poll() is None


def test_a_signalled_child_exits_negative(tmp_path):
    z = Zygote(preload=("json",))
    try:
        env = dict(os.environ)
        f = z.spawn(["gateway", "--model", "/nonexistent-dir", "--prefill", "127.0.0.1:1",
                     "--decode", "127.0.0.1:1", "--grpc-port", "0", "--http-port", "0",
                     "--wait-for-workers-s", "60"], env, open(tmp_path / "gw.log", "wb"))
        deadline = time.monotonic() + 60
        while f.poll() is None and time.monotonic() < deadline:
            if os.path.exists(f"/proc/{f.pid}"):
                break
            time.sleep(0.05)
        f.kill()
        assert f.wait(60) == -signal.SIGKILL
    finally:
        z.close()


def test_a_closed_zygote_leaves_plain_processes(tmp_path, capfd):
    z = Zygote(preload=("json",))
    z.close()
    deadline = time.monotonic() + 10
    while z.alive and time.monotonic() < deadline:
        time.sleep(0.05)
    c = Child("decode", "127.0.0.1:1", ["--help"], zygote=z)
    c.start()
    assert isinstance(c.popen, subprocess.Popen) and c.popen.wait(60) == 0
    assert "not forked" in capfd.readouterr().err


def test_the_real_preload_forks_with_one_thread(tmp_path):
    z = Zygote()
    try:
        f = z.spawn(["--help"], dict(os.environ), open(tmp_path / "o.log", "wb"))
        assert f.wait(110) == 0
        assert z.preload_s is not None and z.preload_s > 0
        threads = len(os.listdir(f"/proc/{z.popen.pid}/task"))
        assert threads == 1, "the zygote must stay single-threaded to fork safely"
        assert "torch" in subprocess.run(
            [sys.executable, "-c", "print(open('/proc/%d/maps').read())" % z.popen.pid],
            capture_output=True, text=True).stdout
    finally:
        z.close()


def test_the_zygote_holds_no_secret_meant_for_the_gateway(monkeypatch):
    monkeypatch.setenv("PDSERVE_API_KEY", "sekrit-zygote-test")
    z = Zygote(preload=("json",), drop=("PDSERVE_API_KEY",))
    try:
        environ = open(f"/proc/{z.popen.pid}/environ", "rb").read()
        assert b"sekrit-zygote-test" not in environ and b"OMP_NUM_THREADS=1" in environ
    finally:
        z.close()
