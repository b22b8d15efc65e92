"""The workers' zygote: one process that imports torch and the engine once (2.5-4 s of a
worker's start-up here, paid by every worker at once on a shared machine), then forks each
worker the launcher asks for, which goes straight to loading its model.

    launcher (pdserve up)                          zygote (python -m pdserve.zygote_main)
      Zygote(): socketpair, spawn        -------->   preload: torch, the engine, both
                                                     workers' modules (no thread started,
                                                     no torch op run, no gRPC object made)
      spawn(argv, env, log) -> Forked    --req--->   fork: the child resets its signals,
                                                     dies with the zygote (PDEATHSIG),
                                                     takes `log` as stdout/stderr, the
                                                     environment it is given, and runs
                                                     pdserve.cli.main(argv)
                                         <--pid--
      Forked.poll()/wait() read          <--exit--   SIGCHLD: each reaped child's exit
      the exits the zygote reports                   code (negative: killed by a signal)
      Zygote.close(): socket closed      -------->   EOF: exits (its children, if any are
                                                     left, get SIGTERM from the kernel)

Why it is safe to fork here: the zygote is single-threaded when it forks (importing torch
starts no OpenMP or intra-op pool; none of its ops ran), has made no gRPC channel or server
(gRPC objects do not survive fork), no UCX context (ucxx is imported, its context and
workers are made by each child, when it serves), and was started with the children's OMP_NUM_THREADS=1 (libgomp reads it once, at
load): each child sets its own torch thread count (services/worker_server.limit_threads).
`Forked` is what the launcher holds instead of a subprocess.Popen: pid, poll, wait,
send_signal, terminate, kill, returncode; `spawn` returns at once (the pid follows the
preload, so the gateway starts meanwhile). Every wait is bounded: a worker's pid within
SPAWN_TIMEOUT_S (else Forked.pid raises OSError). If the zygote is gone, the launcher starts
workers as plain subprocesses again (processes.Child.start, with a line saying so).
This module is the launcher's side; the zygote's own is pdserve/zygote_main.py.
"""
from __future__ import annotations

import collections
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

PRELOAD = ("torch", "engine.llm_engine", "engine.async_engine", "services.worker_server",
           "services.telemetry", "prefill_worker.server", "decode_worker.server",
           "kvtransfer.ucx")      # ucxx's import makes no thread and no UCX context
SPAWN_TIMEOUT_S = 120.0          # a pid after a request: the preload (seconds) and one fork
MAX_MESSAGE = 1 << 20


class Zygote:
    """The launcher's side: start the zygote, ask it for workers, read their exits."""

    def __init__(self, preload: tuple[str, ...] = PRELOAD, drop: tuple[str, ...] = ()) -> None:
        """`preload`: the modules it imports before its first fork; `drop`: environment
        variables it must not hold (a secret meant for the gateway alone)."""
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        env = {k: v for k, v in os.environ.items() if k not in drop}
        env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
        self.popen = subprocess.Popen([sys.executable, "-m", "pdserve.zygote_main", str(theirs.fileno()),
                                       str(os.getpid()), ",".join(preload)],
                                      pass_fds=[theirs.fileno()], env=env, stdin=subprocess.DEVNULL)
        theirs.close()
        self.sock = ours
        self.preload_s: float | None = None     # its imports' seconds, told with the first pid
        self._pending: collections.deque[Forked] = collections.deque()   # asked, no pid yet
        self._exits: dict[int, int] = {}
        self._changed = threading.Condition()
        self._lock = threading.Lock()
        self.alive = True
        threading.Thread(target=self._read, name="zygote-reader", daemon=True).start()

    def _read(self) -> None:
        while True:
            try:
                raw = self.sock.recv(MAX_MESSAGE)
            except OSError:
                raw = b""
            if not raw:
                break
            msg = json.loads(raw)
            with self._changed:
                if "pid" in msg:            # replies come in the order of the requests
                    self.preload_s = msg.get("preload_s", self.preload_s)
                    self._pending.popleft()._pid = msg["pid"]
                elif "exit" in msg:
                    self._exits[msg["exit"]] = msg["code"]
                self._changed.notify_all()
        with self._changed:
            self.alive = False
            self._changed.notify_all()

    def spawn(self, argv: list[str], env: dict[str, str], log=None) -> "Forked":
        """A worker running `pdserve <argv>` with environment `env` (the whole of it), its
        output to `log` (a file; None: the zygote's, the launcher's own). Returns at once:
        its pid comes once the zygote has imported everything and forked (Forked.pid)."""
        body = json.dumps({"argv": argv, "env": env}).encode()
        with self._lock, self._changed:
            if not self.alive:
                raise OSError("the zygote is gone")
            f = Forked(self, ["pdserve", *argv])
            self._pending.append(f)
            socket.send_fds(self.sock, [body], [log.fileno()] if log is not None else [])
        return f

    def wait_for(self, test, timeout: float) -> bool:
        """Wait until `test()` (called under the lock) or the zygote is gone, at most
        `timeout` seconds; returns test()."""
        deadline = time.monotonic() + timeout
        with self._changed:
            while not test() and self.alive:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._changed.wait(left)
            return test()

    def exit_code(self, pid: int) -> int | None:
        with self._changed:
            code = self._exits.get(pid)
            if code is None and not self.alive and not _exists(pid):
                code = self._exits[pid] = 1      # lost with the zygote: no code to tell
            return code

    def close(self, timeout: float = 10.0) -> None:
        """Close the socket (the zygote exits at its EOF); kill it if it does not."""
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()
        try:
            self.popen.wait(timeout)
        except subprocess.TimeoutExpired:
            self.popen.kill()
            self.popen.wait(5)


def _exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class Forked:
    """A worker the zygote forked, as the launcher uses a subprocess.Popen."""

    def __init__(self, zygote: Zygote, args: list[str]):
        self.zygote, self.args = zygote, args
        self._pid: int | None = None
        self.returncode: int | None = None

    @property
    def pid(self) -> int:
        if not self.zygote.wait_for(lambda: self._pid is not None, SPAWN_TIMEOUT_S):
            raise OSError(f"the zygote forked no worker within {SPAWN_TIMEOUT_S:g} s")
        return self._pid

    def poll(self) -> int | None:
        if self.returncode is None:
            if self._pid is None:            # not forked yet, or never: the zygote is gone
                self.returncode = None if self.zygote.alive else 1
            else:
                self.returncode = self.zygote.exit_code(self._pid)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = time.monotonic() + (1e9 if timeout is None else timeout)
        while self.poll() is None:
            left = deadline - time.monotonic()
            if left <= 0:
                raise subprocess.TimeoutExpired(self.args, timeout)
            if self.zygote.alive:                # told its exit by the zygote
                self.zygote.wait_for(lambda: self.poll() is not None, left)
            else:                                # no longer ours to reap: look again soon
                time.sleep(min(0.1, left))
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            try:
                os.kill(self.pid, sig)
            except (ProcessLookupError, OSError):
                pass

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)
