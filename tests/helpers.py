"""Small helpers shared by several test files."""
from __future__ import annotations

import contextlib
import threading
import time

import pytest
import torch


def split_generate(pre, dec, rid: str, prompt, params):
    """The prefill/decode split in one process: prefill-only in engine `pre`, copy its blocks
    into the blocks `dec` reserved, decode there. Returns (prefill output, final output)."""
    pre.add_request(rid, prompt, params, prefill_only=True)
    first = None
    while first is None:
        first = next(iter(pre.step()), None)
    r = dec.add_remote_request(rid, prompt, params)
    dec.kv_cache[:, :, torch.tensor(r.block_ids)] = pre.kv_cache[:, :, torch.tensor(first.block_ids)]
    pre.release(rid)
    dec.remote_kv_done(rid, first.token_ids[0], first.logprobs[0])
    final = None
    while final is None:
        final = next((o for o in dec.step() if o.finished), None)
    return first, final


def wait_until(pred, timeout_s: float, what: str):
    """Poll `pred() -> (ok, value)` until ok (returns value) or fail after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    last = None
    while time.monotonic() < deadline:
        ok, last = pred()
        if ok:
            return last
        time.sleep(0.05)
    pytest.fail(f"{what} not reached within {timeout_s}s: {last}")


def up_token_file(up_pid: int) -> str:
    """The internal token file a running `pdserve up` (pid) gave its children: the
    --internal-token-file on a child's command line (the token itself is on none)."""
    from pathlib import Path
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            ppid = int(stat.read_text().rsplit(")", 1)[1].split()[1])
            argv = (stat.parent / "cmdline").read_bytes().split(b"\0")
        except (OSError, ValueError, IndexError):
            continue                       # gone meanwhile
        if ppid == up_pid and b"--internal-token-file" in argv:
            return argv[argv.index(b"--internal-token-file") + 1].decode()
    raise LookupError(f"no child of pid {up_pid} has --internal-token-file")


def up_metadata(up_pid: int) -> tuple[tuple[str, str], ...]:
    """The internal credential of a running `pdserve up` (pid), as gRPC call metadata for its
    workers' RPCs (the tests run as the same user, so they can read its token file)."""
    from services.security import read_token
    return (("authorization", f"Bearer {read_token(up_token_file(up_pid))}"),)


@contextlib.contextmanager
def supervising(launcher, interval_s: float = 0.1):
    """Run `launcher.supervise` (restarts, as `pdserve up` does) in a thread while inside;
    on the way out stop it and check it did not give up."""
    stop, result = threading.Event(), {}
    th = threading.Thread(target=lambda: result.update(rc=launcher.supervise(stop, interval_s)),
                          name="supervisor", daemon=True)
    th.start()
    try:
        yield launcher
    finally:
        stop.set()
        th.join(10)
    assert result.get("rc") == 0, "the supervisor gave up"


def assert_disconnect_frees(base: str, body: dict, held, timeout_s: float,
                            headers: dict | None = None) -> None:
    """Open a streamed chat completion at `base`, read 8 SSE lines, check `held()` (the blocks
    the system holds) is non-empty, hang up, then require `held()` empty within `timeout_s`."""
    import httpx
    with httpx.Client(timeout=60) as c:
        with c.stream("POST", base + "/v1/chat/completions", json=body,
                      headers=headers or {}) as r:
            assert r.status_code == 200
            lines = r.iter_lines()            # kept referenced: closing it closes the stream
            for _ in range(8):
                next(lines)
            assert held(), "the request is not running"
    t0 = time.monotonic()
    wait_until(lambda: (not (b := held()), b), timeout_s, "no held blocks after disconnect")
    assert time.monotonic() - t0 < timeout_s
