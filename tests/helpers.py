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
