"""Small helpers shared by several test files."""
from __future__ import annotations

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
