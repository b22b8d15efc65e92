"""The live pools of a `Launcher` (pdserve/launcher.py; its docstring draws them): the
discovery files the gateway and the prefill workers read, and `add_worker`, which starts one
more worker and names it in them only once it is SERVING. `Launcher.retire` takes a worker
out of them before it drains. A mixin: the state (`_files`, `children`, `_lock`, ...) is the
Launcher's own.
"""
from __future__ import annotations

import os
import signal
import subprocess
import tempfile
import time
from pathlib import Path

from services.address_file import write_addresses
from services.cli_args import config_argv

from .processes import Child, LaunchError, ModelPools, free_port


class LivePools:
    def _make_files(self) -> None:
        if self.models:
            raise LaunchError("live pools (--autoscale) serve one model: not with --models-file")
        for kind in ("prefill", "decode", "metrics"):
            fd, self._files[kind] = tempfile.mkstemp(prefix=f"pdserve-{kind}-", suffix=".txt")
            os.close(fd)

    def _metrics_args(self) -> list[str]:
        if self._files:
            return ["--worker-metrics-file", self._files["metrics"]]
        return ["--worker-metrics", ",".join(self._worker_metrics)]

    def write_discovery(self) -> None:
        """Rewrite the files from the workers now serving and not retired (atomically)."""
        if not self._files:
            return
        with self._lock:
            live = [c for c in self.children if c.role != "gateway" and not c.retired]
            for role in ("prefill", "decode"):
                write_addresses(self._files[role], [c.address for c in live if c.role == role])
            tmp = self._files["metrics"] + ".tmp"
            Path(tmp).write_text("".join(f"{c.metrics}\n" for c in live))
            os.replace(tmp, self._files["metrics"])

    def add_worker(self, role: str, timeout_s: float = 300.0) -> Child:
        """One more `role` worker (live pools only): started, SERVING within timeout_s
        (else stopped: LaunchError), then written into the discovery files."""
        if not self._files:
            raise LaunchError("add_worker needs discovery_files (pdserve up --autoscale)")
        m = ModelPools("", self.model_dir, 0, 0)
        with self._lock:
            c = self._spawn_worker(m, role, free_port(self.host), config_argv(self.engine))
            c.retired = True                       # not supervised until it is ready
        try:
            self._wait_serving([c], time.monotonic() + timeout_s)
        except BaseException:
            self._end(c, 0.0)
            raise
        c.retired = False
        self.write_discovery()
        return c

    def _end(self, c: Child, wait_s: float) -> None:
        """A worker that never served (add_worker's failed start): SIGTERM, SIGKILL."""
        if c.popen is not None and c.popen.poll() is None:
            c.popen.send_signal(signal.SIGTERM)
            try:
                c.popen.wait(wait_s)
            except subprocess.TimeoutExpired:
                self.say(f"{c.label} did not exit in {wait_s:g} s: SIGKILL")
                c.popen.kill()
                c.popen.wait(5)
        if c.log is not None:
            c.log.close()
        with self._lock:
            self.children = [x for x in self.children if x is not c]

