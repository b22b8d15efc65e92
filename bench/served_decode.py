"""One stream served against the offline engine at the same threads, rounds alternating:
what the decode worker's per-token path costs over the engine step (issue 34, item 3).

    python bench/served_decode.py [--rounds 6] [--tokens 128] [--threads 1] [--log FILE]

Served: `pdserve up`'s processes with no prefill worker (the decode worker computes the
prompt, --disaggregation never) and `--threads` torch threads; one chat streamed with the
openai SDK (~96 prompt tokens, `--tokens` out, greedy, ignore_eos); decode tok/s from the
first content chunk to the last (completion tokens - 1 over that time). Offline: the same
model in a process of its own (`engine.LLM`, `--threads` torch threads, the same prompt
length), decode tok/s from the first generated token to the last, as bench/ab_decode.py
measures it. Each round runs one of each (order alternating), the other side idle. The
per-token stages (services/token_path.py) are read from the gateway's /metrics over the
served rounds. Printed: medians, the ratio served / offline, and the stages' means.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import httpx  # noqa: E402
import openai  # noqa: E402

from pdserve.launcher import Launcher, free_port  # noqa: E402
from services.token_path import STAGES  # noqa: E402
from waterfall import TEXT, token_path  # noqa: E402

OFFLINE = r'''
import json, sys, time
import torch
torch.set_num_threads(int(sys.argv[2]))
from engine import LLM, SamplingParams
llm = LLM(sys.argv[1], num_blocks=64)
llm.generate([[1, 2, 3, 4]], SamplingParams(temperature=0.0, max_tokens=4))   # warm-up
eng = llm.engine
print("ready", flush=True)
for line in sys.stdin:
    n_prompt, n = (int(x) for x in line.split())
    eng.add_request(f"r{time.monotonic_ns()}", list(range(5, 5 + n_prompt)),
                    SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True))
    times = []
    while eng.has_unfinished_requests():
        if eng.step():
            times.append(time.perf_counter())
    print(json.dumps((n - 1) / (times[-1] - times[0])), flush=True)
'''


def cpu_s(pid: int) -> float:
    """User + system CPU seconds of process `pid` so far (/proc/PID/stat)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def served(client, model: str, tokens: int) -> tuple[float, int]:
    """(decode tok/s, prompt tokens) of one stream."""
    chunks, usage = [], None
    for chunk in client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": TEXT}], max_tokens=tokens,
            temperature=0, stream=True, stream_options={"include_usage": True},
            extra_body={"ignore_eos": True}):
        if chunk.choices and chunk.choices[0].delta.content:
            chunks.append(time.perf_counter())
        if chunk.usage is not None:
            usage = chunk.usage
    return (usage.completion_tokens - 1) / (chunks[-1] - chunks[0]), usage.prompt_tokens


def offline_start(model: str, threads: int) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS=str(threads))
    p = subprocess.Popen([sys.executable, "-c", OFFLINE, model, str(threads)], cwd=ROOT, env=env,
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    if p.stdout.readline().strip() != "ready":
        raise SystemExit(f"the offline engine did not start (exit {p.wait()})")
    return p


def offline(p: subprocess.Popen, n_prompt: int, tokens: int) -> float:
    p.stdin.write(f"{n_prompt} {tokens}\n")
    p.stdin.flush()
    return json.loads(p.stdout.readline())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--model", default="", help="default: the default model (SmolLM2-135M)")
    ap.add_argument("--log", default="", help="append the output to this file")
    args = ap.parse_args()
    log = open(args.log, "a") if args.log else None

    def say(line: str) -> None:
        print(line, flush=True)
        if log:
            log.write(line + "\n")
            log.flush()
    model = args.model
    if not model:
        from pdserve.default_model import resolve_default_model
        model = str(resolve_default_model())
    port = free_port()
    launcher = Launcher(model, 0, 1, http_port=port, decode_args=["--threads", str(args.threads)],
                        log_dir=Path(tempfile.mkdtemp(prefix="served-decode-")),
                        gateway_args=["--disaggregation", "never"])
    launcher.start(900)
    proc = offline_start(model, args.threads)
    say(f"== bench/served_decode.py --rounds {args.rounds} --tokens {args.tokens} "
        f"--threads {args.threads} (git {_git()}; load {os.getloadavg()[0]:.1f})")
    try:
        base = f"http://127.0.0.1:{port}"
        name = httpx.get(base + "/v1/models", timeout=30).json()["data"][0]["id"]
        client = openai.OpenAI(base_url=base + "/v1", api_key="none", max_retries=0,
                               http_client=httpx.Client(timeout=300))
        _, n_prompt = served(client, name, 8)                        # warm, and the prompt length
        before = token_path(base)
        pids = {"served": [c.popen.pid for c in launcher.children if c.role == "decode"][0],
                "gateway": [c.popen.pid for c in launcher.children if c.role == "gateway"][0],
                "offline": proc.pid}
        rows = {k: [] for k in ("served", "offline", "cpu served", "cpu gateway", "cpu offline")}
        for i in range(args.rounds):
            for side in (("served", "offline") if i % 2 == 0 else ("offline", "served")):
                c0 = {k: cpu_s(p) for k, p in pids.items()}
                rows[side].append(served(client, name, args.tokens)[0] if side == "served"
                                  else offline(proc, n_prompt, args.tokens))
                for k in ((side, "gateway") if side == "served" else (side,)):
                    rows[f"cpu {k}"].append((cpu_s(pids[k]) - c0[k]) * 1e3 / args.tokens)
            say(f"round {i}: served {rows['served'][-1]:.1f} tok/s, offline "
                f"{rows['offline'][-1]:.1f} tok/s; CPU ms/token decode worker "
                f"{rows['cpu served'][-1]:.2f}, gateway {rows['cpu gateway'][-1]:.2f}, offline "
                f"{rows['cpu offline'][-1]:.2f} (load {os.getloadavg()[0]:.1f})")
        after = token_path(base)
        report(rows, before, after, n_prompt, args, say)
    finally:
        proc.stdin.close()
        proc.wait(timeout=60)
        launcher.stop()


def report(rows, before, after, n_prompt: int, args, say) -> None:
    s, o = statistics.median(rows["served"]), statistics.median(rows["offline"])
    ratios = [a / b for a, b in zip(rows["served"], rows["offline"])]
    say(f"\none stream, {n_prompt} prompt tokens, {args.tokens} out, {args.threads} thread(s), "
        f"median of {args.rounds} alternating rounds\n")
    med = {k: statistics.median(v) for k, v in rows.items()}
    say("| side | decode tok/s | wall ms/token | CPU ms/token (process, whole request) | rounds (tok/s) |")
    say("| --- | --- | --- | --- | --- |")
    for side, key in (("served (client, SSE)", "served"), ("offline engine", "offline")):
        say(f"| {side} | {med[key]:.1f} | {1e3 / med[key]:.2f} | {med['cpu ' + key]:.2f} | "
            f"{' '.join(f'{x:.1f}' for x in rows[key])} |")
    say(f"| gateway (served rounds) | | | {med['cpu gateway']:.2f} | |")
    say(f"| served / offline | {s / o:.3f} (median of per-round ratios {statistics.median(ratios):.3f}) "
        f"| | decode worker / offline {med['cpu served'] / med['cpu offline']:.3f} | |")
    say("\nper-token path over the served rounds (pdserve:token_path_seconds)\n")
    say("| stage | role | count | mean ms |")
    say("| --- | --- | --- | --- |")
    for stage in STAGES:
        for role in ("decode", "gateway"):
            c1, s1 = after.get((role, stage), (0.0, 0.0))
            c0, s0 = before.get((role, stage), (0.0, 0.0))
            if c1 - c0 > 0:
                say(f"| {stage} | {role} | {c1 - c0:.0f} | {(s1 - s0) / (c1 - c0) * 1e3:.3f} |")


def _git() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                              text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "?"


if __name__ == "__main__":
    main()
