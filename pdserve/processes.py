"""The processes `pdserve up` starts (launcher.py), as specs: a `Child` per process (role,
address, arguments), its command line, the ports it gets, and its side of dying with the
launcher.

    Child(role, address, argv) --command(launcher pid)-->
        python -m pdserve.cli --parent-pid PID <argv> [--restarts N]
                  |                                        |
                  die_with_parent(PID), first thing:       a worker's restart count, from
                  SIGTERM when the launcher dies            its second start on: its
                                                            pdserve:process_restarts gauge

A worker with a zygote (pdserve/zygote.py) is forked by it instead: the same arguments,
`--parent-pid` the zygote's; its `popen` is then a zygote's `Forked`.
Both are flags, not environment: `--parent-pid` is an option of the `pdserve` command itself
(pdserve/cli.py), `--restarts` one of every worker's config (services/worker_config.py).
`ModelPools`: one model of a several-model system, how many workers of each role it gets.
"""
from __future__ import annotations

import ctypes
import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services import service_names


class LaunchError(RuntimeError):
    pass


def _ephemeral_range() -> tuple[int, int]:
    try:
        lo, hi = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(lo), int(hi)
    except (OSError, ValueError):
        return 32768, 60999


_handed: set[int] = set()        # ports free_port gave out (at most its 12,000-port range)


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that is free now, chosen BELOW the kernel's ephemeral range.

    The port is handed to a child that binds it seconds later (after loading a model). A
    port from the ephemeral range (what bind(0) returns) can be taken in that window by any
    outgoing connection or port-0 listener on the machine; one below it cannot. Nor is a port
    handed out twice by this process (one launcher picks every port of its children before
    any of them binds one)."""
    lo, _ = _ephemeral_range()
    rng = random.Random()
    for _ in range(200):
        port = rng.randrange(max(1024, lo - 12000), lo)
        if port in _handed:
            continue
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
            _handed.add(port)
            return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:   # crowded: any free port
        s.bind((host, 0))
        return s.getsockname()[1]


def ports_in_use(host: str, ports: dict[str, int]) -> list[str]:
    """The ports of `ports` (what -> port; 0: none asked for) that something already listens
    on at `host`, as "WHAT port P": checked before `pdserve up` starts anything, so a busy
    port is a one-line error, not a health probe answered by whoever holds it."""
    busy = []
    for what, port in ports.items():
        if not port:
            continue
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)   # TIME_WAIT is no owner
            try:
                s.bind((host, port))
            except OSError:
                busy.append(f"{what} port {port}")
    return busy


def die_with_parent(parent_pid: int) -> None:
    """In a launcher's child (`pdserve --parent-pid PID`; 0: not one, nothing to do): SIGTERM
    from the kernel when the launcher dies (PR_SET_PDEATHSIG), and exit at once if it
    already has. Done by the child itself, not in a preexec_fn: a preexec_fn makes
    subprocess fork() where it would vfork(), and fork() runs grpc's fork handlers in the
    child, which can abort there while the launcher holds channels ("epoll_wait error: Bad
    file descriptor", grpc/grpc#43055)."""
    if not parent_pid:
        return
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        return
    if os.getppid() != parent_pid:        # the launcher died before the prctl
        sys.exit(f"pdserve: the launcher (pid {parent_pid}) is gone")


@dataclass
class Child:
    role: str
    address: str
    argv: list[str]                         # `pdserve` arguments: the role, then its options
    popen: Any = None                       # a subprocess.Popen, or a zygote's Forked
    model: str = ""                         # its model's id, with several models
    log: IO | None = None
    restarts: int = 0                       # by the supervisor, in all
    crashes: list[float] = field(default_factory=list)   # monotonic times, within the window
    restart_at: float | None = None         # a restart is due then (the child is dead)
    env: dict[str, str] = field(default_factory=dict)   # added to (or, None: removed from)
    #                                          the launcher's environment, e.g. a secret
    started_at: float = 0.0                 # monotonic time of its last start
    retired: bool = False                   # Launcher.retire (or still starting in
    #                                          add_worker): never restarted
    metrics: str = ""                       # a worker's "ID=URL" of its /metrics
    zygote: Any = None                      # a worker's pdserve.zygote.Zygote (None: exec'd)

    @property
    def label(self) -> str:
        """How the launcher's lines name it: "gateway", "prefill 0", "small decode 1"."""
        if self.role == "gateway" or "--worker-id" not in self.argv:
            return self.role
        index = self.argv[self.argv.index("--worker-id") + 1].rpartition("-")[2]
        return " ".join(x for x in (self.model, self.role, index) if x)

    @property
    def pid(self) -> int:
        return self.popen.pid

    def arguments(self) -> list[str]:
        """Its `pdserve` arguments: its own, and once the supervisor restarted it, how often
        (a worker's --restarts)."""
        again = ["--restarts", str(self.restarts)] if self.restarts and self.role != "gateway" else []
        return [*self.argv, *again]

    def command(self, parent_pid: int) -> list[str]:
        """Its command line: `pdserve` told its launcher's pid, then its arguments."""
        return [sys.executable, "-m", "pdserve.cli", "--parent-pid", str(parent_pid),
                *self.arguments()]

    def start(self) -> None:
        """Run it (again): forked by the zygote (a worker, while the zygote is there:
        pdserve/zygote.py), else its command line; one intra-op thread, output to its log
        (None: the launcher's stdout/stderr)."""
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", **{
            k: v for k, v in self.env.items() if v is not None})
        for k in [k for k, v in self.env.items() if v is None]:
            env.pop(k, None)
        self.started_at = time.monotonic()
        if self.zygote is not None and self.role != "gateway":
            try:
                self.popen = self.zygote.spawn(self.arguments(), env, self.log)
                return
            except OSError as e:
                print(f"pdserve up: {self.label}: not forked ({e}); started as a process of "
                      "its own", file=sys.stderr, flush=True)
        self.popen = subprocess.Popen(self.command(os.getpid()), env=env, stdout=self.log,
                                      stderr=subprocess.STDOUT if self.log else None,
                                      stdin=subprocess.DEVNULL)


def wait_serving(children: list[Child], deadline: float, channel, cancel, say) -> None:
    """Probe each of `children` in turn (over `channel(child)`) until all are SERVING: a line
    (`say`) when a worker answers NOT_SERVING (loaded, warming up), one when it is ready, with
    its time. LaunchError when one exits, the deadline passes or `cancel` is set."""
    waiting = {id(c): c for c in children}
    warming: set[int] = set()
    channels = {id(c): channel(c) for c in children}
    try:
        while waiting:
            for key, c in list(waiting.items()):
                status = _probe(c, channels[key], deadline, cancel)
                took = time.monotonic() - c.started_at
                if status == health_pb2.HealthCheckResponse.SERVING:
                    del waiting[key]
                    say(f"{c.label}: ready in {took:.1f} s")
                elif status is not None and key not in warming and c.role != "gateway":
                    warming.add(key)
                    say(f"{c.label}: loaded in {took:.1f} s, warming up ...")
            # a bounded pause between rounds (each probe has its own deadline)
            time.sleep(min(0.1, max(0.0, deadline - time.monotonic())) if waiting else 0)
    finally:
        for ch in channels.values():
            ch.close()


def _probe(c: Child, ch, deadline: float, cancel):
    """`c`'s health status now (None: no answer)."""
    if cancel.is_set():
        raise LaunchError("interrupted while starting")
    if c.popen.poll() is not None:
        raise LaunchError(f"{c.label} on {c.address} exited with code "
                          f"{c.popen.returncode} before it was ready")
    left = deadline - time.monotonic()
    if left <= 0:
        raise LaunchError(f"{c.label} on {c.address} not SERVING in time")
    try:
        return health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(
            service=service_names.BY_ROLE[c.role]), timeout=min(1.0, left)).status
    except grpc.RpcError:
        return None


@dataclass
class ModelPools:
    """One model of a several-model system: the id clients send, its directory, pool sizes."""
    name: str
    model_dir: str
    num_prefill: int = 1
    num_decode: int = 1

    @classmethod
    def read(cls, path: str) -> list["ModelPools"]:
        """`pdserve up --models-file`: a JSON list of {name, model, prefill, decode} (counts)."""
        try:
            entries = json.loads(Path(path).read_text())
            models = [cls(str(e["name"]), str(e["model"]), int(e.get("prefill", 1)),
                          int(e.get("decode", 1))) for e in entries]
        except (OSError, ValueError, TypeError, KeyError) as e:
            raise ValueError(f"models file {path!r}: expected a JSON list of "
                             f"{{name, model, prefill, decode}}: {e!r}") from None
        names = [m.name for m in models]
        if not models or len(set(names)) != len(names) or not all(names):
            raise ValueError(f"models file {path!r}: expected distinct, non-empty names")
        if any(m.num_prefill < 0 or m.num_decode < 1 for m in models):
            raise ValueError(f"models file {path!r}: prefill must be >= 0 and decode >= 1 "
                             "(prefill 0: that model's decode workers compute its prompts)")
        return models
