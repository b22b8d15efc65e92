"""The two servers bench/vs_llama.py compares, as processes it starts, pins, watches and stops.

    PdserveUp     `python -m pdserve.cli up --http-port P --grpc-port 0 [variant args]`: the
                  whole system (gateway, prefill and decode workers); ready = its
                  "pdserve ready:" line (the spawn-to-ready seconds are kept: `pdserve up` to
                  ready, one of issue 34's targets)
    LlamaServer   llama.cpp's own `llama-server -m GGUF -t T -cb --parallel N -c CTX --jinja`
                  (bench/build_llama_server.sh's binary); ready = GET /health 200. `--jinja`:
                  the GGUF's own chat template (SmolLM2's adds a default system prompt, as
                  pdserve's does), so both see the same prompt tokens (the bench prints them)

Same cores: the bench pins itself (os.sched_setaffinity) before it starts either, so every
process of both trees inherits the set; `affinity()` reads each process's Cpus_allowed_list
back, and `cpu_s()` the tree's user + system CPU seconds (/proc), so the bench can say how
much the idle server used while the other one was measured. Each server runs in its own
session (process group): `stop()` sends SIGTERM to the group, SIGKILL after a bound.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
CLK_TCK = os.sysconf("SC_CLK_TCK")


def tree(pid: int) -> list[int]:
    """pid and all its descendants (via /proc/PID/task/*/children)."""
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        try:
            for task in os.listdir(f"/proc/{p}/task"):
                with open(f"/proc/{p}/task/{task}/children") as f:
                    todo += [int(x) for x in f.read().split()]
        except OSError:
            continue                 # exited meanwhile
    return out


def _cpu_of(pid: int) -> float:
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rpartition(")")[2].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / CLK_TCK     # utime, stime


class Server:
    """A server process tree: `start()` (returns seconds to ready), `stop()`, `base`, `model`."""
    name = "server"

    def __init__(self, log_dir: Path):
        self.log_dir, self.proc, self.base, self.model = log_dir, None, "", ""
        self.ready_s = float("nan")

    def _spawn(self, argv: list[str], log_name: str, env=None) -> None:
        self.log = open(self.log_dir / log_name, "ab")
        self.proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, env=env, start_new_session=True,
                                     cwd=ROOT)
        self.ready_text = ""            # the first "pdserve ready:" line, once printed
        threading.Thread(target=self._tee, daemon=True).start()

    def _tee(self) -> None:
        for raw in self.proc.stdout:
            self.log.write(raw)
            self.log.flush()
            if not self.ready_text and raw.startswith(b"pdserve ready:"):
                self.ready_text = raw.decode(errors="replace").strip()

    def _wait(self, ready, timeout_s: float) -> float:
        t0, deadline = time.monotonic(), time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.proc.returncode} "
                                   f"(log {self.log.name})")
            if ready():
                return time.monotonic() - t0
            time.sleep(0.05)         # bounded by the deadline
        raise RuntimeError(f"{self.name} not ready in {timeout_s:.0f} s (log {self.log.name})")

    def _served_model(self) -> str:
        return httpx.get(self.base + "/v1/models", timeout=10).json()["data"][0]["id"]

    def pids(self) -> list[int]:
        return tree(self.proc.pid) if self.proc is not None and self.proc.poll() is None else []

    def cpu_s(self) -> float:
        return sum(_cpu_of(p) for p in self.pids())

    def affinity(self) -> set[str]:
        """The distinct Cpus_allowed_list values over the tree's processes."""
        out = set()
        for p in self.pids():
            try:
                with open(f"/proc/{p}/status") as f:
                    out |= {ln.split(":", 1)[1].strip() for ln in f if ln.startswith("Cpus_allowed_list")}
            except OSError:
                pass
        return out

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        try:
            os.killpg(self.proc.pid, signal.SIGTERM)
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)
        except ProcessLookupError:
            pass
        self.proc = None


class PdserveUp(Server):
    def __init__(self, log_dir: Path, name: str, args: list[str], port: int):
        super().__init__(log_dir)
        self.name, self.args, self.port = name, args, port

    def start(self, timeout_s: float = 300.0) -> float:
        argv = [sys.executable, "-m", "pdserve.cli", "up", "--http-port", str(self.port),
                "--grpc-port", "0", *self.args]
        env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
        self._spawn(argv, f"{self.name}.log", env)
        self.ready_s = self._wait(lambda: bool(self.ready_text), timeout_s)
        self.base = f"http://127.0.0.1:{self.port}"
        self.model = self._served_model()
        return self.ready_s


class LlamaServer(Server):
    name = "llama-server"

    def __init__(self, log_dir: Path, binary: str, gguf: str, threads: int, port: int,
                 extra: list[str] = ()):
        super().__init__(log_dir)
        self.binary, self.gguf, self.threads, self.port = binary, gguf, threads, port
        self.extra = list(extra)
        self.parallel = 0

    def argv(self, parallel: int, ctx: int) -> list[str]:
        return [self.binary, "-m", self.gguf, "-t", str(self.threads), "-cb", "--parallel",
                str(parallel), "-c", str(ctx), "--jinja", "--host", "127.0.0.1",
                "--port", str(self.port), *self.extra]

    def start(self, parallel: int, ctx: int, timeout_s: float = 120.0) -> float:
        """(Re)start with `parallel` slots sharing `ctx` tokens of context."""
        self.stop()
        self.parallel = parallel
        self._spawn(self.argv(parallel, ctx), "llama-server.log")
        self.base = f"http://127.0.0.1:{self.port}"

        def healthy() -> bool:
            try:
                return httpx.get(self.base + "/health", timeout=2).status_code == 200
            except httpx.HTTPError:
                return False
        self.ready_s = self._wait(healthy, timeout_s)
        self.model = self._served_model()
        return self.ready_s

    def version(self) -> str:
        r = subprocess.run([self.binary, "--version"], capture_output=True, text=True, timeout=30)
        return next((ln for ln in (r.stdout + r.stderr).splitlines() if "version" in ln), "?")
