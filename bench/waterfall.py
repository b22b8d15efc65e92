"""The TTFT waterfall and the per-token path of one stream on the default model, through the
processes `pdserve up` runs (pdserve.launcher.Launcher with up's worker arguments, 1P1D).

    python bench/waterfall.py [--rounds 10] [--max-tokens 128] [--disaggregation always|never]
                              [--log FILE]

Each round streams one chat (~96 prompt tokens, `--max-tokens` out, greedy, ignore_eos)
with the openai SDK, the gateway's --disaggregation pinned (always: the prefill worker computes
every prompt; never: the decode worker does, the waterfall's local shape); rounds alternate between asking for `usage.pdserve` (body field
`"pdserve": {"timings": true}`) and not, so the two sit side by side: the client's TTFT and
ITL with the timings asked beside the plain request (the baseline). Printed:

  * the TTFT breakdown (gateway/waterfall.py phases): median ms over the asked rounds, and
    each phase's share of the summed medians; then the phases' sum beside the client's
    TTFT (request out -> first content chunk) and the client's own round trip of a request
    that generates nothing (what lies outside the phases);
  * the per-token path (services/token_path.py, pdserve:token_path_seconds from the
    gateway's /metrics, which merges the workers'): mean ms per observation over the whole
    run, beside the client's inter-chunk gap.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import httpx  # noqa: E402
import openai  # noqa: E402
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from gateway.waterfall import PHASES  # noqa: E402
from pdserve.launcher import Launcher, free_port  # noqa: E402
from pdserve.up import UpConfig, worker_args  # noqa: E402
from services.token_path import STAGES  # noqa: E402

TEXT = ("Write a short story about a lighthouse keeper who finds a message in a bottle. "
        "The story should mention the sea, the wind, an old dog, a storm at night, and a ship "
        "that never arrives. Keep the tone quiet and a little sad, and end with the keeper "
        "lighting the lamp one last time before dawn breaks over the grey water.")
SENT: list[float] = []


def stream(client, model: str, max_tokens: int, timings: bool) -> dict:
    extra = {"ignore_eos": True}
    if timings:
        extra["pdserve"] = {"timings": True}
    chunks, usage = [], None
    for chunk in client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": TEXT}], max_tokens=max_tokens,
            temperature=0, stream=True, stream_options={"include_usage": True}, extra_body=extra):
        if chunk.choices and chunk.choices[0].delta.content:
            chunks.append(time.perf_counter())
        if chunk.usage is not None:
            usage = chunk.usage
    gaps = [(b - a) * 1e3 for a, b in zip(chunks, chunks[1:])]
    return {"ttft": (chunks[0] - SENT[-1]) * 1e3, "itl": statistics.mean(gaps), "gaps": gaps,
            "usage": usage, "pd": (usage.model_extra or {}).get("pdserve")}


def token_path(base: str) -> dict[tuple[str, str], tuple[float, float]]:
    """(role, stage) -> (count, sum seconds) from the gateway's /metrics."""
    text = httpx.get(base + "/metrics", timeout=30).text
    out: dict = {}
    for fam in text_string_to_metric_families(text):
        if fam.name != "pdserve:token_path_seconds":
            continue
        for s in fam.samples:
            key = (s.labels["role"], s.labels["stage"])
            c, t = out.get(key, (0.0, 0.0))
            if s.name.endswith("_count"):
                out[key] = (c + s.value, t)
            elif s.name.endswith("_sum"):
                out[key] = (c, t + s.value)
    return out


def report(rounds: list[dict], rtt: float, before: dict, after: dict, say) -> None:
    asked = [r for r in rounds if r["pd"]]
    plain = [r for r in rounds if not r["pd"]]
    med = {p: statistics.median(r["pd"]["ttft_phases_ms"].get(p, 0.0) for r in asked)
           for p in PHASES}
    med = {p: v for p, v in med.items() if any(p in r["pd"]["ttft_phases_ms"] for r in asked)}
    total = sum(med.values())
    say(f"\nTTFT waterfall (median of {len(asked)} rounds with usage.pdserve)")
    say(f"{'phase':<22}{'ms':>9}{'share':>9}")
    for p, v in med.items():
        say(f"{p:<22}{v:>9.2f}{v / total:>9.1%}")
    say(f"{'sum of the phases':<22}{total:>9.2f}{1:>9.0%}")
    say(f"{'client round trip':<22}{rtt:>9.2f}   (GET /v1/models: outside the phases)")
    med_ttft = lambda rs: statistics.median(r["ttft"] for r in rs)  # noqa: E731
    say(f"\n{'client TTFT, ms':<34}{'timings asked':>14}{'plain (baseline)':>18}")
    say(f"{'median':<34}{med_ttft(asked):>14.2f}{med_ttft(plain):>18.2f}")
    say(f"{'phases sum / client TTFT (median)':<34}"
        f"{statistics.median(r['pd']['ttft_ms'] / r['ttft'] for r in asked):>14.1%}")
    med_itl = lambda rs: statistics.median(r["itl"] for r in rs)  # noqa: E731
    say(f"{'client ITL (mean gap), ms median':<34}{med_itl(asked):>14.3f}{med_itl(plain):>18.3f}")
    say(f"\nper-token path over the run (pdserve:token_path_seconds)")
    say(f"{'stage':<14}{'role':<9}{'count':>8}{'mean ms':>10}")
    for stage in STAGES:
        for role in ("decode", "gateway"):
            c1, s1 = after.get((role, stage), (0.0, 0.0))
            c0, s0 = before.get((role, stage), (0.0, 0.0))
            if c1 - c0 > 0:
                say(f"{stage:<14}{role:<9}{c1 - c0:>8.0f}{(s1 - s0) / (c1 - c0) * 1e3:>10.3f}")
    gaps = [g for r in rounds for g in r["gaps"]]
    say(f"{'client gap':<14}{'client':<9}{len(gaps):>8}{statistics.mean(gaps):>10.3f}"
        f"   (between content chunks, as the SDK hands them over)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--model", default="", help="default: the default model (SmolLM2-135M)")
    ap.add_argument("--disaggregation", default="always", choices=("always", "never"))
    ap.add_argument("--log", default="", help="append the output to this file")
    args = ap.parse_args()
    log = open(args.log, "a") if args.log else None

    def say(line: str) -> None:
        print(line, flush=True)
        if log:
            log.write(line + "\n")
            log.flush()
    port = free_port()
    prefill_args, decode_args = worker_args(UpConfig(prefill=1, decode=1))
    launcher = Launcher(args.model, 1, 1, http_port=port, prefill_args=prefill_args,
                        decode_args=decode_args, log_dir=Path(tempfile.mkdtemp(prefix="waterfall-")),
                        gateway_args=["--disaggregation", args.disaggregation])
    launcher.start(900)
    say(f"== bench/waterfall.py --disaggregation {args.disaggregation} --rounds {args.rounds} "
        f"--max-tokens {args.max_tokens}")
    try:
        base = f"http://127.0.0.1:{port}"
        model = httpx.get(base + "/v1/models", timeout=30).json()["data"][0]["id"]
        http = httpx.Client(timeout=300, event_hooks={"request": [lambda r: SENT.append(time.perf_counter())]})
        client = openai.OpenAI(base_url=base + "/v1", api_key="none", http_client=http, max_retries=0)
        stream(client, model, 8, True)                                  # warm
        rtts = []
        for _ in range(7):
            client.models.list()
            rtts.append((time.perf_counter() - SENT[-1]) * 1e3)
        before = token_path(base)
        rounds = []
        for i in range(args.rounds):
            r = stream(client, model, args.max_tokens, timings=i % 2 == 0)
            rounds.append(r)
            say(f"round {i}: timings={'on ' if r['pd'] else 'off'} ttft {r['ttft']:.2f} ms, "
                f"itl {r['itl']:.3f} ms, prompt {r['usage'].prompt_tokens} tokens, "
                f"{r['usage'].completion_tokens} out"
                + (f", phases {r['pd']['ttft_ms']:.2f} ms" if r["pd"] else ""))
        after = token_path(base)
        say(f"\nmodel {model}, 1 prefill + 1 decode (pdserve up's worker arguments), "
            f"--disaggregation {args.disaggregation}, "
            f"{rounds[0]['usage'].prompt_tokens} prompt tokens, {args.max_tokens} out, {args.rounds} rounds")
        report(rounds, statistics.median(rtts), before, after, say)
    finally:
        launcher.stop()


if __name__ == "__main__":
    main()
