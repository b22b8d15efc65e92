"""The zygote process itself (pdserve/zygote.py draws the protocol and says why forking
here is safe): `python -m pdserve.zygote_main FD LAUNCHER_PID MODULES`.
"""
from __future__ import annotations

import json
import os
import selectors
import signal
import socket
import sys
import time

from .zygote import MAX_MESSAGE


def main(argv: list[str]) -> int:
    """`python -m pdserve.zygote FD LAUNCHER_PID MODULES`: import MODULES (comma-separated),
    then serve requests until EOF."""
    sock = socket.socket(fileno=int(argv[0]))
    # the launcher stops it (by EOF) after its workers; a Ctrl-C or a SIGTERM to the whole
    # process group is for the launcher and the workers; the launcher's death kills it
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)
    _die_with(int(argv[1]))
    t0 = time.perf_counter()
    for name in filter(None, argv[2].split(",")):
        __import__(name)
    preload_s = time.perf_counter() - t0
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    signal.set_wakeup_fd(wake_w)
    sel = selectors.DefaultSelector()
    sel.register(sock, selectors.EVENT_READ)
    sel.register(wake_r, selectors.EVENT_READ)
    while True:
        for key, _ in sel.select():          # sleeps until a request or a child's exit
            if key.fileobj is sock:
                body, fds, _, _ = socket.recv_fds(sock, MAX_MESSAGE, 1)
                if not body:
                    return 0
                req = json.loads(body)
                pid = _fork(req["argv"], req["env"], fds, (sock.fileno(), wake_r, wake_w))
                for fd in fds:
                    os.close(fd)
                sock.send(json.dumps({"pid": pid, "preload_s": preload_s}).encode())
            else:
                os.read(wake_r, 4096)
                _reap(sock)


def _reap(sock: socket.socket) -> None:
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        sock.send(json.dumps({"exit": pid, "code": os.waitstatus_to_exitcode(status)}).encode())


def _fork(argv: list[str], env: dict[str, str], fds: list[int], inherited: tuple[int, ...]) -> int:
    zygote = os.getpid()
    pid = os.fork()
    if pid:
        return pid
    code = 1
    try:                             # the child: a worker from here on
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        for fd in inherited:
            os.close(fd)
        if fds:
            os.dup2(fds[0], 1)
            os.dup2(fds[0], 2)
            os.close(fds[0])
        os.environ.clear()
        os.environ.update(env)
        sys.argv = ["pdserve", *argv]
        _name(argv)
        from pdserve import cli
        code = cli.main(["--parent-pid", str(zygote), *argv])
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except BaseException:            # noqa: BLE001 -- told, then the exit code says it
        import traceback
        traceback.print_exc()
    finally:
        import atexit
        atexit._run_exitfuncs()      # what the interpreter's exit would run (os._exit: not)
        for f in (sys.stdout, sys.stderr):
            try:
                f.flush()
            except (OSError, ValueError):
                pass
        os._exit(code)


def _name(argv: list[str]) -> None:
    """The child's name in ps/top (its command line stays the zygote's): pd-<worker id>."""
    import ctypes
    who = argv[argv.index("--worker-id") + 1] if "--worker-id" in argv else "worker"
    ctypes.CDLL("libc.so.6").prctl(15, f"pd-{who}"[:15].encode(), 0, 0, 0)   # PR_SET_NAME


def _die_with(parent: int) -> None:
    """SIGKILL when the launcher dies (it ignores SIGTERM: see main), and exit at once if
    it already has. Its children then get their own SIGTERM (cli.main's --parent-pid)."""
    import ctypes
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)   # PR_SET_PDEATHSIG
    if os.getppid() != parent:
        sys.exit(f"pdserve zygote: the launcher (pid {parent}) is gone")


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
