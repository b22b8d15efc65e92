"""The gateway process never imports torch, nor a worker package (gateway/README.md)."""
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_gateway_imports_no_torch_and_no_worker():
    code = ("import sys, gateway.grpc_server, gateway.openai, engine.output_processor\n"
            "bad = sorted(m for m in sys.modules if m.split('.')[0] in "
            "('torch', 'triton', 'prefill_worker', 'decode_worker', 'kvtransfer'))\n"
            "assert not bad, bad\n")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0, r.stderr
