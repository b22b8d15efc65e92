"""`pdserve up` as a person runs it: a real process (the tiny model, free 127.0.0.1 ports)
whose terminal lines are read as they come.

Start-up names each process as it loads and is ready; a second `up` on the same ports is a
one-line error before anything starts (it once printed "pdserve ready" because the first
instance answered its probe); the API key is on no child's command line (`ps`); a SIGKILLed
gateway is restarted by the supervisor and serves again with every KV block back; SIGINT
ends with a final line and exit code 0.
"""
from __future__ import annotations

import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import grpc
import httpx
import pytest

from pdserve.launcher import free_port
from protos.pdserve.v1 import common_pb2, decode_pb2_grpc, prefill_pb2_grpc
from tests.helpers import up_metadata, wait_until

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.timeout(900)]

READY_TIMEOUT_S = 300.0         # three processes loading on a busy 2-core machine
KEY = "sk-test-" + uuid.uuid4().hex


class Up:
    """A running `pdserve up`, its output lines (stdout and stderr) read by a thread."""

    def __init__(self, args: list[str], env: dict | None = None):
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "pdserve.cli", "up", *args], stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT, text=True, env=dict(os.environ, **(env or {})))
        self.lines: list[str] = []
        self._q: queue.Queue = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self):
        for line in self.proc.stdout:
            self._q.put(line)
        self._q.put(None)

    def wait_line(self, pattern: str, timeout_s: float) -> re.Match:
        """The first line (from now on or seen already) matching `pattern`."""
        deadline = time.monotonic() + timeout_s
        for line in self.lines:
            if m := re.search(pattern, line):
                return m
        while True:
            try:
                line = self._q.get(timeout=max(0.05, deadline - time.monotonic()))
            except queue.Empty:
                pytest.fail(f"no line matching {pattern!r} in {timeout_s}s:\n" + self.text())
            if line is None:
                pytest.fail(f"pdserve up ended before {pattern!r}:\n" + self.text())
            self.lines.append(line)
            if m := re.search(pattern, line):
                return m
            if time.monotonic() > deadline:
                pytest.fail(f"no line matching {pattern!r} in {timeout_s}s:\n" + self.text())

    def text(self) -> str:
        return "".join(self.lines[-60:])

    def stop(self):
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)


def children(pid: int) -> list[int]:
    """The pids whose parent is `pid` (from /proc)."""
    out = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                stat = (d / "stat").read_text()
            except OSError:
                continue
            if int(stat.rpartition(")")[2].split()[1]) == pid:
                out.append(int(d.name))
    return out


def cmdline(pid: int) -> list[str]:
    try:
        return (Path("/proc") / str(pid) / "cmdline").read_bytes().decode().split("\0")
    except OSError:
        return []


def gateway_pid(up: Up) -> int:
    return next(p for p in children(up.proc.pid) if "gateway" in cmdline(p))


@pytest.fixture(scope="module")
def up(model_dir):
    grpc_port, http_port = free_port(), free_port()
    u = Up(["--model", model_dir, "--grpc-port", str(grpc_port), "--http-port", str(http_port),
            "--restart-backoff", "0.5", "--served-model-name", "tiny", "--api-key", KEY,
            "--metrics-prefix", "vllm"])
    ready = u.wait_line(r"^pdserve ready: (.*)", READY_TIMEOUT_S).group(1)
    u.fields = dict(kv.split("=", 1) for kv in ready.split())
    u.grpc_port, u.http_port = grpc_port, http_port
    u.url = f"http://127.0.0.1:{http_port}/v1"
    yield u
    u.stop()


def pools_full(u: Up, timeout_s: float) -> None:
    """Every worker's KV pool full again, nothing running or waiting (Stats)."""
    stubs = [(a, s) for role, s in (("prefill", prefill_pb2_grpc.PrefillWorkerStub),
                                     ("decode", decode_pb2_grpc.DecodeWorkerStub))
             for a in u.fields[role].split(",")]
    metadata = up_metadata(u.proc.pid)

    def idle():
        busy = {}
        for address, stub_cls in stubs:
            with grpc.insecure_channel(address) as ch:
                x = stub_cls(ch).Stats(common_pb2.StatsRequest(), timeout=5, metadata=metadata)
            if x.free_kv_blocks != x.total_kv_blocks or x.num_running or x.num_waiting:
                busy[address] = (x.free_kv_blocks, x.total_kv_blocks, x.num_running)
        return not busy, busy
    wait_until(idle, timeout_s, "every worker's KV pool full")


def chat(u: Up, key: str = KEY, **kw) -> httpx.Response:
    return httpx.post(f"{u.url}/chat/completions", timeout=60,
                      headers={"Authorization": f"Bearer {key}"},
                      json={"model": "tiny", "max_tokens": 8, "temperature": 0,
                            "messages": [{"role": "user", "content": "Hi"}], **kw})


def test_start_up_names_each_process_as_it_loads_and_is_ready(up):
    for name in ("prefill 0", "decode 0"):
        assert any(re.search(rf"pdserve up: {name}: loading tiny-llama on 127\.0\.0\.1:\d+ \.\.\.",
                             x) for x in up.lines), up.text()
        assert any(re.search(rf"pdserve up: {name}: ready in \d+\.\d s$", x)
                   for x in up.lines), up.text()
    assert any(re.search(r"pdserve up: gateway: ready in \d+\.\d s$", x) for x in up.lines)
    assert up.fields["id"] == "tiny"           # --served-model-name, and /v1/models agrees
    r = httpx.get(f"{up.url}/models", headers={"Authorization": f"Bearer {KEY}"}, timeout=30)
    assert [m["id"] for m in r.json()["data"]] == ["tiny"]
    assert chat(up).status_code == 200
    assert chat(up, key="wrong").status_code == 401     # the key from the environment holds


def test_a_second_up_on_the_same_ports_fails_at_once_in_one_line(up, model_dir):
    for busy in (["--grpc-port", str(up.grpc_port), "--http-port", "0"],
                 ["--grpc-port", "0", "--http-port", str(up.http_port)]):
        r = subprocess.run([sys.executable, "-m", "pdserve.cli", "up", "--model", model_dir,
                            *busy], capture_output=True, text=True, timeout=120)
        assert r.returncode == 1 and r.stdout == "", (r.stdout, r.stderr)
        port = busy[1] if busy[1] != "0" else busy[3]
        assert r.stderr.splitlines() == [r.stderr.strip()], r.stderr     # one line
        assert f"port {port} on 127.0.0.1 already in use" in r.stderr
        assert "nothing was started" in r.stderr and "pdserve ready" not in r.stderr
    assert chat(up).status_code == 200          # the first one was not disturbed


def test_the_api_key_is_on_no_childs_command_line(up):
    """`up --api-key` hands the key to the gateway in its environment (the 401 above shows
    the gateway took it from there), to no worker, and on no child's command line."""
    kids = children(up.proc.pid)
    kids += [p for k in kids for p in children(k)]   # with --zygote: the workers it forks
    assert len(kids) == 3                      # gateway, prefill, decode (no --zygote)
    assert not [p for p in kids if any(KEY in a for a in cmdline(p))]
    environ = {p: (Path("/proc") / str(p) / "environ").read_bytes() for p in kids}
    assert [p for p, e in environ.items() if KEY.encode() in e] == [gateway_pid(up)]


# series a vLLM dashboard queries (vLLM's docs, "Production Metrics")
VLLM_NAMES = ("vllm:num_requests_running", "vllm:time_to_first_token_seconds",
              "vllm:e2e_request_latency_seconds", "vllm:prompt_tokens", "vllm:kv_cache_usage_perc")


def scrape(url: str) -> dict:
    """{(sample name, frozen labels): value} of a /metrics page."""
    from prometheus_client.parser import text_string_to_metric_families
    text = httpx.get(url, timeout=30).text
    return {(x.name, frozenset(x.labels.items())): x.value
            for f in text_string_to_metric_families(text) for x in f.samples}


def test_the_gateways_metrics_hold_every_workers_under_vllms_names(up):
    assert chat(up).status_code == 200
    merged = scrape(f"http://127.0.0.1:{up.http_port}/metrics")
    names = {n for n, _ in merged}
    assert all(n.startswith("vllm:") for n in names), sorted(names)
    assert all(any(n.startswith(want) for n in names) for want in VLLM_NAMES), sorted(names)
    # each worker's own /metrics, as the gateway was told them (the workers are forked by
    # the zygote: their command line is the zygote's)
    argv = cmdline(gateway_pid(up))
    workers = dict(x.split("=", 1) for x in argv[argv.index("--worker-metrics") + 1].split(","))
    assert sorted(workers) == ["decode-0", "prefill-0"]
    for worker, url in workers.items():
        own = scrape(url)
        assert merged[("vllm:worker_metrics_up", frozenset({("worker", worker)}))] == 1.0
        counters = {k: v for k, v in own.items() if k[0].endswith("prefix_cache_queries_total")}
        assert counters and any(counters.values())          # the chat above was counted
        for (name, labels), value in counters.items():      # the same series, relabelled
            assert merged[("vllm:" + name.removeprefix("pdserve:"),
                           labels | {("worker", worker)})] == value


def test_a_sigkilled_gateway_is_restarted_and_nothing_leaks(up):
    old = gateway_pid(up)
    with httpx.stream("POST", f"{up.url}/chat/completions", timeout=60,
                      headers={"Authorization": f"Bearer {KEY}"},
                      json={"model": "tiny", "max_tokens": 4000, "ignore_eos": True,
                            "stream": True, "messages": [{"role": "user", "content": "Hi"}]}) as r:
        assert r.status_code == 200
        lines = r.iter_lines()
        while "content" not in next(lines):      # the stream is running on the workers
            pass
        os.kill(old, signal.SIGKILL)
        with pytest.raises(httpx.HTTPError):
            for _ in lines:
                pass
    up.wait_line(r"pdserve up: gateway on \S+ exited with code -9; restart #1", 30)
    up.wait_line(r"pdserve up: restarting gateway on \S+ \(restart #1\)", 30)

    def serving_again():
        try:
            return chat(up).status_code == 200, None
        except httpx.HTTPError as e:
            return False, repr(e)
    wait_until(serving_again, READY_TIMEOUT_S, "the restarted gateway answering")
    assert gateway_pid(up) != old and up.proc.poll() is None
    pools_full(up, 60)       # the killed stream's blocks came back on both workers


def test_sigint_ends_with_a_final_line_and_exit_code_0(up):
    up.proc.send_signal(signal.SIGINT)
    up.wait_line(r"^pdserve up: stopping 3 process\(es\)", 60)
    up.wait_line(r"^pdserve up: stopped in \d+\.\d s$", 60)
    assert up.proc.wait(60) == 0
