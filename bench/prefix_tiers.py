"""Issue 31's benchmark: prefix reuse beyond one worker's KV pool, three systems side by side.

    python bench/prefix_tiers.py [--quick] [--rounds 2] [--traces prefix_chat prefix_longdoc]
                                 [--cpus 0-1] [--rate-scale 1] [--model FILE]
    (pipe it to tee: bench/logs/2026-12-03-prefix-tiers.log is such a run)

Each system is `pdserve up` with 2 prefill + 2 decode workers on the default model
(SmolLM2-135M), the whole process tree pinned to the same cores (`taskset -c --cpus`), each
prefill worker's KV pool (`--prefill-num-blocks`) a quarter of the trace's working set (the
distinct 16-token prefix blocks of all its prompts; at least two of its longest requests),
each decode worker's (`--num-blocks`) room for 16 of its longest requests: under
--disaggregation always a decode worker computes no prompt, and a pool of a quarter of the
working set refused most reservations (RESOURCE_EXHAUSTED, the request failed) in a trial.
Prefill workers never refuse for queue delay here (--max-queue-delay-factor 0): every system
serves every request, so the counts compare.

    (a) today's affinity routing: the tree at commit a9f9160 (`git worktree add --detach
        /tmp/pdserve-a9f9160 a9f9160`, reused when present), run from there, with this
        benchmark's two additions (bench/prefix_tiers_baseline.patch, applied uncommitted
        to a clean checkout each time: the counter pdserve:prompt_tokens_computed_total and
        `pdserve up --prefill-num-blocks`; nothing that routes or caches)
    (a') (a)'s routing rule on this tree's engine (the engine has moved on since a9f9160: on
        the CPU, issue 34 made prefill 2-3x faster, so (a)'s TTFT is no longer a like-for-like
        baseline): the tree at this checkout's HEAD (a worktree at /tmp/pdserve-affinity)
        with bench/prefix_tiers_affinity.patch, `--prefix-routing affinity`: (a)'s map of
        block hash -> the worker last sent it, within the same slack; --kv-offload-host-gb 0
        --peer-fetch off
    (b) this tree, routing on the workers' KV events: --kv-offload-host-gb 0 --peer-fetch off
    (c) this tree with a host and a disk tier and peer fetch: --kv-offload-host-gb 1
        --kv-offload-disk DIR --kv-offload-disk-gb 2 --peer-fetch on

A flag `pdserve up --help` does not list is not passed (the log says which): before issue
31's parts merge, (b) and (c) are this tree as it is. Rounds alternate (a, b, c, a, b, c),
each system started fresh for each trace of each round. The load is `pdserve bench --trace`'s
(pdserve/bench.py, measure): the trace's requests at their timestamps (x --rate-scale),
prompts synthesised from its block ids (equal ids, equal text), streaming /v1/completions,
greedy, ignore_eos, max_tokens = the trace's output length (16-32 tokens: the runs are about
prefill). Traces: bench/traces/prefix_chat.jsonl and prefix_longdoc.jsonl (bench/make_traces.py).

Per system, over all its rounds: prompt tokens computed (the sum over every worker of
pdserve:prompt_tokens_computed_total, from the gateway's /metrics, which holds its workers',
after the run less before it; per round too), TTFT p50/p90 and output tok/s (sim/stats.py over
the pooled requests), requests failed (errors and 429s), and greedy mismatches: requests whose
output text differs from the first round of (a') where it ran, else of (a) (completed in
both; (a)'s engine has other numerics, so its text is no reference for today's). One markdown
table per trace, then (c)/(a) for computed tokens and TTFT p90 against the issue's targets
(<= 0.5 and <= 0.6), and (c)/(a') where (a') ran (`--systems a A b c`; system "A" is (a')).
TTFT p90 again apart for the fresh requests (FRESH_TOKENS or more prompt tokens that no
earlier request of the trace shares: a new document, the first system prompt; no cache can
save their compute) and the rest; and where each system's TTFT went (the gateway's TTFT
waterfall from /status.json, p90 and mean per phase, each run's line and a table per trace).
--variant "NAME=SYSTEM OPTIONS": SYSTEM again with `pdserve up` options added, in the same
rounds (an A/B), e.g. --variant "c512=c --max-num-batched-tokens 512".
--quick: one round of the first third of each trace, a smoke run.
"""
from __future__ import annotations

import argparse
import math
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from sim.stats import summarize  # noqa: E402
from sim.trace import BLOCK_TOKENS, TraceRecord, read_trace  # noqa: E402

BASELINE_COMMIT = "a9f9160"
BASELINE_DIR = Path("/tmp/pdserve-a9f9160")
PATCH = ROOT / "bench" / "prefix_tiers_baseline.patch"
AFFINITY_DIR = Path("/tmp/pdserve-affinity")
AFFINITY_PATCH = ROOT / "bench" / "prefix_tiers_affinity.patch"
COUNTER = "pdserve:prompt_tokens_computed_total"
PHASES = ("gateway_queue", "routing", "decode_reservation", "prefill_queue", "prefill_compute",
          "kv_transfer", "decode_admission", "local_prefill", "first_token_out")
SYSTEMS = ("a", "A", "b", "c")
LABELS = {"a": "(a) affinity routing (a9f9160)", "A": "(a') (a)'s rule on this engine",
          "b": "(b) routing on KV events",
          "c": "(c) (b) + host/disk tiers + peer fetch"}
TARGETS = (("computed", "prompt tokens computed", 0.5), ("ttft_p90_ms", "TTFT p90", 0.6))
BLOCK_SIZE = 16            # the workers' --block-size (the engine's default)


# -- sizing (no servers) ---------------------------------------------------------------
def working_set_blocks(recs: list[TraceRecord], block_size: int = BLOCK_SIZE) -> int:
    """Distinct whole KV blocks over all prompts. Block j of a prompt lies in its Mooncake
    block m = j * block_size // BLOCK_TOKENS; two prompts with the same ids up to m have the
    same text there (pdserve/bench_prompts.py), so the same KV block. A prompt's blocks past
    its hash_ids are its own."""
    seen = set()
    for i, r in enumerate(recs):
        for j in range(r.input_length // block_size):
            m = j * block_size // BLOCK_TOKENS
            key = tuple(r.hash_ids[:m + 1]) if m < len(r.hash_ids) else ("own", i)
            seen.add((key, j))
    return len(seen)


def new_blocks(recs: list[TraceRecord], block_size: int = BLOCK_SIZE) -> list[int]:
    """Per request, its whole KV blocks no earlier request of the trace holds (keyed as in
    working_set_blocks): what no cache can save it, whatever a system keeps."""
    seen, out = set(), []
    for i, r in enumerate(recs):
        keys = set()
        for j in range(r.input_length // block_size):
            m = j * block_size // BLOCK_TOKENS
            keys.add((tuple(r.hash_ids[:m + 1]) if m < len(r.hash_ids) else ("own", i), j))
        out.append(len(keys - seen))
        seen |= keys
    return out


FRESH_TOKENS = 256   # a request with this many prompt tokens no earlier one shares is "fresh"


def longest_blocks(recs: list[TraceRecord], block_size: int = BLOCK_SIZE) -> int:
    """KV blocks of the trace's longest request, prompt and output."""
    return max(-(-(r.input_length + r.output_length) // block_size) for r in recs)


def pool_blocks(recs: list[TraceRecord], fraction: float = 0.25,
                block_size: int = BLOCK_SIZE) -> tuple[int, int]:
    """(each prefill worker's KV blocks, each decode worker's): `fraction` of the working
    set but at least two longest requests; room for 16 longest requests."""
    longest = longest_blocks(recs, block_size)
    return (max(math.ceil(working_set_blocks(recs, block_size) * fraction), 2 * longest),
            16 * longest)


VARIANTS: dict[str, tuple[str, list[str]]] = {}   # --variant NAME=SYSTEM ARGS: name -> (system, args)


def add_variant(spec: str) -> str:
    """`--variant "c512=c --max-num-batched-tokens 512"`: a system run as SYSTEM with these
    `pdserve up` options added (an A/B in one run, rounds alternating); its name."""
    name, _, rest = spec.partition("=")
    base, *extra = shlex.split(rest)
    if not name or name in SYSTEMS or name in VARIANTS or base not in SYSTEMS or not extra:
        raise ValueError(f"--variant {spec!r}: want NEW_NAME=SYSTEM OPTIONS..., SYSTEM one of "
                         f"{SYSTEMS}")
    VARIANTS[name] = (base, extra)
    LABELS[name] = f"{LABELS[base].split(' ')[0][:-1]}, {name}) {' '.join(extra)}"
    return name


def system_flags(system: str, up_help: str, disk_dir: str) -> tuple[list[str], list[str]]:
    """(flags for `pdserve up`, the wanted flags its --help does not list) of (b) or (c), or
    of a variant (its system's and its own, passed as given); (a) has none of its own."""
    if system in VARIANTS:
        base, extra = VARIANTS[system]
        flags, absent = system_flags(base, up_help, disk_dir)
        return flags + extra, absent
    want = {"a": [], "b": [("--kv-offload-host-gb", "0"), ("--peer-fetch", "off")],
            "A": [("--kv-offload-host-gb", "0"), ("--peer-fetch", "off"),
                  ("--prefix-routing", "affinity")],
            "c": [("--kv-offload-host-gb", "1"), ("--kv-offload-disk", disk_dir),
                  ("--kv-offload-disk-gb", "2"), ("--peer-fetch", "on")]}[system]
    def listed(flag: str) -> bool:
        return re.search(rf"(?<![\w-]){re.escape(flag)}(?![\w-])", up_help) is not None
    return ([x for f, v in want if listed(f) for x in (f, v)],
            [f for f, _ in want if not listed(f)])


# -- what a run measured (no servers) --------------------------------------------------
def computed_tokens(metrics_text: str) -> dict[str, float]:
    """COUNTER summed per role over the workers of a gateway's /metrics."""
    from prometheus_client.parser import text_string_to_metric_families
    out = {"prefill": 0.0, "decode": 0.0}
    for fam in text_string_to_metric_families(metrics_text):
        for s in fam.samples:
            if s.name == COUNTER:
                role = s.labels.get("role", "")
                out[role] = out.get(role, 0.0) + s.value
    return out


# what each run's line says of how the prefixes were served (deltas over the run)
WHERE = (("fetch ok", "pdserve:peer_fetch_total", {"result": "ok"}),
         ("fetch fallback", "pdserve:peer_fetch_total", {"result": "fallback"}),
         ("fetched blocks", "pdserve:peer_fetch_blocks_total", {}),
         ("revived host", "pdserve:kv_tier_hits_total", {"tier": "host"}),
         ("revived disk", "pdserve:kv_tier_hits_total", {"tier": "disk"}),
         ("picks prefix", "pdserve:route_decisions_total", {"pool": "prefill", "reason": "prefix"}),
         ("load", "pdserve:route_decisions_total", {"pool": "prefill", "reason": "load"}),
         ("slack", "pdserve:route_decisions_total", {"pool": "prefill", "reason": "slack"}),
         ("cold", "pdserve:route_decisions_total", {"pool": "prefill", "reason": "cold"}))


def where_counts(metrics_text: str) -> dict[str, float]:
    """WHERE's series summed over the gateway's /metrics (absent in (a): 0)."""
    from prometheus_client.parser import text_string_to_metric_families
    out = {what: 0.0 for what, _, _ in WHERE}
    for fam in text_string_to_metric_families(metrics_text):
        for smp in fam.samples:
            for what, name, labels in WHERE:
                if smp.name == name and all(smp.labels.get(k) == v for k, v in labels.items()):
                    out[what] += smp.value
    return out


def mismatches(reference: list[dict], records: list[dict]) -> int:
    """Requests completed in both whose output text differs (records in trace order)."""
    if len(reference) != len(records):
        raise ValueError(f"{len(records)} records against {len(reference)} in the reference")
    return sum(a["status"] == b["status"] == "ok" and a["text"] != b["text"]
               for a, b in zip(reference, records))


def aggregate(runs: list[dict], reference: list[dict], fresh: list[bool] | None = None) -> dict:
    """One system's rounds (each {records, window_s, computed}) as one table row. `fresh`
    (per trace request): TTFT p90 of the fresh requests and of the rest, apart."""
    records = [r for run in runs for r in run["records"]]
    s = summarize(records, sum(run["window_s"] for run in runs))
    split = {}
    for name, want in (("fresh", True), ("rest", False)):
        part = [r for run in runs for r, f in zip(run["records"], fresh or []) if f == want]
        split[name] = (len(part), summarize(part, 1.0)["ttft_p90_ms"] if part else None)
    per_round = [sum(run["computed"].values()) for run in runs]
    return {"requests": s["requests"], "failed": s["errors"] + s["rejected_429"],
            "computed": sum(per_round) / len(per_round), "per_round": per_round,
            "prefill_share": sum(run["computed"]["prefill"] for run in runs)
            / max(1.0, sum(per_round)),
            "ttft_p50_ms": s["ttft_p50_ms"], "ttft_p90_ms": s["ttft_p90_ms"],
            "tok_s": s["throughput_tok_s"],
            "mismatches": sum(mismatches(reference, run["records"]) for run in runs),
            "ttft_p90_split": split if fresh else None}


def _ms(v) -> str:
    return "n/a" if v is None else f"{v:.0f}"


def ratio_lines(rows: dict[str, dict], base: str = "a", c: str = "c") -> list[str]:
    """(c)/(base) against each target: '| what | ratio | target | met |' rows (`c`: (c) or
    a variant of it)."""
    name = "(a')" if base == "A" else f"({base})"
    out = [f"| ({c}) / {name} | ratio | target | met |", "| --- | ---: | ---: | --- |"]
    for key, what, target in TARGETS:
        a, c_ = rows[base][key], rows[c][key]
        r = c_ / a if a and c_ is not None else None
        met = "n/a" if r is None else "yes" if r <= target else "no"
        out.append(f"| {what} | {'n/a' if r is None else f'{r:.2f}'} | <= {target:g} | {met} |")
    return out


def table(trace: str, rows: dict[str, dict], ref: str, header: str = "") -> str:
    """`ref`: the system whose first round the greedy check compares with."""
    lines = [f"### {trace}: {header}", "",
             "| system | requests | prompt tokens computed (mean/round) | per round "
             "| prefill workers' share | TTFT p50 ms | TTFT p90 ms | output tok/s | failed "
             f"| greedy mismatches vs {LABELS[ref].split(' ')[0]} "
             f"| TTFT p90 ms, fresh prompts (n) | TTFT p90 ms, the rest (n) |",
             "| --- | ---: | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for system, r in rows.items():
        split = r.get("ttft_p90_split") or {}
        cells = " | ".join(f"{_ms(split[k][1])} ({split[k][0]})" if k in split else "n/a"
                           for k in ("fresh", "rest"))
        lines.append(f"| {LABELS[system]} | {r['requests']} | {r['computed']:.0f} "
                     f"| {' / '.join(f'{x:.0f}' for x in r['per_round'])} "
                     f"| {r['prefill_share']:.0%} | {_ms(r['ttft_p50_ms'])} "
                     f"| {_ms(r['ttft_p90_ms'])} | {r['tok_s']:.1f} | {r['failed']} "
                     f"| {r['mismatches']} | {cells} |")
    cs = [s for s in rows if s == "c" or VARIANTS.get(s, ("",))[0] == "c"]
    for c in cs:
        for base in ("a", "A"):
            if base in rows:
                lines += [""] + ratio_lines(rows, base, c)
    return "\n".join(lines)


def phase_table(runs: dict[str, list[dict]]) -> str:
    """Where each system's TTFT went (the gateway's waterfall, gateway/waterfall.py): per
    phase, the median over rounds of its p90 and of its mean, ms; phases under 0.5 ms mean in
    every system left out. Empty where no system had one ((a) has no waterfall)."""
    per = {s: [run["phases"] for run in rs if run.get("phases")] for s, rs in runs.items()}
    per = {s: ps for s, ps in per.items() if ps}
    if not per:
        return ""
    def med(xs: list[float]) -> float:
        xs = sorted(xs)
        return (xs[(len(xs) - 1) // 2] + xs[len(xs) // 2]) / 2
    cells = {s: {ph: (med([p[ph]["p90_ms"] for p in ps if ph in p]),
                      med([p[ph]["mean_ms"] for p in ps if ph in p]))
                 for ph in {ph for p in ps for ph in p}} for s, ps in per.items()}
    phases = [ph for ph in PHASES if any(ph in c and c[ph][1] >= 0.5 for c in cells.values())]
    lines = ["", "", "TTFT phases, p90 ms (mean ms), median over rounds (the gateway's waterfall)",
             "", "| system | " + " | ".join(phases) + " |",
             "| --- |" + " ---: |" * len(phases)]
    for s, c in cells.items():
        lines.append(f"| {LABELS[s]} | " + " | ".join(
            f"{c[ph][0]:.0f} ({c[ph][1]:.0f})" if ph in c else "" for ph in phases) + " |")
    return "\n".join(lines)


# -- the systems -----------------------------------------------------------------------
def baseline_tree() -> Path:
    """(a)'s tree: the worktree at BASELINE_COMMIT (made when absent), its tracked files
    reset to that commit, PATCH applied."""
    def git(*argv: str, tree: Path = BASELINE_DIR) -> None:
        subprocess.run(["git", "-C", str(tree), *argv], check=True, capture_output=True,
                       timeout=300)
    if not (BASELINE_DIR / ".git").exists():
        git("worktree", "add", "--detach", str(BASELINE_DIR), BASELINE_COMMIT, tree=ROOT)
    git("checkout", "--detach", BASELINE_COMMIT)
    git("checkout", "--", ".")
    git("apply", str(PATCH))
    return BASELINE_DIR


def affinity_tree() -> Path:
    """(a')'s tree: a worktree at this checkout's HEAD (made when absent), its tracked files
    reset, AFFINITY_PATCH applied."""
    head = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], check=True,
                          capture_output=True, text=True, timeout=60).stdout.strip()
    def git(*argv: str, tree: Path = AFFINITY_DIR) -> None:
        subprocess.run(["git", "-C", str(tree), *argv], check=True, capture_output=True,
                       timeout=300)
    if not (AFFINITY_DIR / ".git").exists():
        git("worktree", "add", "--detach", str(AFFINITY_DIR), head, tree=ROOT)
    git("checkout", "--", ".")
    git("checkout", "--detach", head)
    git("apply", str(AFFINITY_PATCH))
    return AFFINITY_DIR


class Up:
    """`pdserve up` from `tree`, pinned to `cpus`, on a free HTTP port; `stop()` always."""

    def __init__(self, tree: Path, flags: list[str], cpus: str, log: Path, ready_s: float):
        from pdserve.processes import free_port
        self.http, self.log = free_port(), log
        pin = ["taskset", "-c", cpus] if cpus and shutil.which("taskset") else []
        argv = [*pin, sys.executable, "-m", "pdserve", "up", "--grpc-port", "0",
                "--http-port", str(self.http), *flags]
        env = {**os.environ, "PYTHONPATH": str(tree)}
        self.proc = subprocess.Popen(argv, cwd=tree, env=env, stdout=log.open("wb"),
                                     stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        try:
            deadline = time.monotonic() + ready_s
            while "pdserve ready:" not in log.read_text(errors="replace"):
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"pdserve up did not start in {ready_s:.0f} s: see {log}")
                time.sleep(0.5)
        except BaseException:
            self.stop()
            raise

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.http}"

    def metrics(self) -> str:
        import httpx
        return httpx.get(self.url + "/metrics", timeout=30).text

    def phases(self) -> dict[str, dict]:
        """The gateway's TTFT waterfall over its last requests (/status.json, its one model's:
        p50/p90/mean ms per phase, gateway/waterfall.py); {} where the tree has none ((a))."""
        import httpx
        try:
            r = httpx.get(self.url + "/status.json", timeout=30)
            models = r.json().get("models", []) if r.status_code == 200 else []
            return models[0].get("waterfall", {}).get("phases", {}) if models else {}
        except (httpx.HTTPError, ValueError):
            return {}

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=30)


def bench_args(url: str, trace: Path, args):
    from pdserve.bench import parse
    return parse(["--url", url, "--trace", str(trace), "--rate-scale", str(args.rate_scale),
                  "--timeout", str(args.timeout), "--warmup", "0", "--no-progress",
                  "--seed", "31"])


def warm(url: str) -> None:
    """One short request before the counters are read (the first request's one-off costs)."""
    import httpx
    from pdserve.bench import served_model
    r = httpx.post(url + "/v1/completions", timeout=120,
                   json={"model": served_model(url, {}, 30), "prompt": " the warm up",
                         "max_tokens": 2, "temperature": 0})
    r.raise_for_status()


def run_one(tree: Path, flags: list[str], trace: Path, args, log: Path) -> dict:
    """One fresh system, one trace: {records, window_s, computed (per role), load}."""
    up = Up(tree, flags, args.cpus, log, args.ready_timeout)
    try:
        from pdserve.bench import measure
        warm(up.url)
        text = up.metrics()
        before, where0 = computed_tokens(text), where_counts(text)
        load0 = os.getloadavg()[0]
        summary, _, records = measure(bench_args(up.url, trace, args))
        text = up.metrics()
        after, where1 = computed_tokens(text), where_counts(text)
        phases = up.phases()
    finally:
        up.stop()
    return {"records": records, "window_s": summary["duration_s"],
            "computed": {k: after.get(k, 0.0) - before.get(k, 0.0) for k in ("prefill", "decode")},
            "where": {k: where1[k] - where0[k] for k in where1},
            "load": (load0, os.getloadavg()[0]), "phases": phases}


def trace_file(name: str, quick: bool, tmp: Path) -> tuple[Path, list[TraceRecord]]:
    from sim.trace import write_trace
    path = ROOT / "bench" / "traces" / f"{name}.jsonl"
    recs = read_trace(path)
    if quick:
        recs = recs[:max(4, len(recs) // 3)]
        path = tmp / f"{name}-quick.jsonl"
        write_trace(path, recs)
    return path, recs


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    a = p.add_argument
    a("--traces", nargs="+", default=["prefix_chat", "prefix_longdoc"],
      help="trace names in bench/traces/")
    a("--rounds", type=int, default=2, help="rounds of (a, b, c) per trace")
    a("--quick", action="store_true", help="a smoke run: 1 round, each trace's first third")
    a("--model", default="", help="default: pdserve's default model (SmolLM2-135M)")
    a("--cpus", default="", help="taskset -c list for every system (default: this "
      "process's cores)")
    a("--rate-scale", type=float, default=1.0, help="pdserve bench --rate-scale")
    a("--pool-fraction", type=float, default=0.25, help="KV pool / the trace's working set")
    a("--disaggregation", default="always", help="pdserve up --disaggregation (always: every "
      "prompt on a prefill worker)")
    a("--systems", nargs="+", default=list(SYSTEMS), choices=SYSTEMS)
    a("--variant", action="append", default=[], metavar="NAME=SYSTEM OPTIONS",
      help="also run SYSTEM with these `pdserve up` options added, as NAME (repeatable)")
    a("--timeout", type=float, default=180.0, help="seconds per request")
    a("--ready-timeout", type=float, default=300.0)
    args = p.parse_args(argv)
    if args.quick:
        args.rounds = 1
    try:
        args.systems += [add_variant(v) for v in args.variant]
    except ValueError as e:
        p.error(str(e))
    if "a" not in args.systems and "A" not in args.systems:
        p.error("--systems needs a or A: the baseline of the ratios and of the greedy check")
    args.cpus = args.cpus or ",".join(map(str, sorted(os.sched_getaffinity(0))))
    return args


def up_help() -> str:
    r = subprocess.run([sys.executable, "-m", "pdserve", "up", "--help"], cwd=ROOT,
                       capture_output=True, text=True, timeout=120,
                       env={**os.environ, "PYTHONPATH": str(ROOT)})
    return r.stdout


def header(args, model: str, help_text: str) -> None:
    rev = subprocess.run(["git", "-C", str(ROOT), "log", "-1", "--format=%h %cd", "--date=iso"],
                         capture_output=True, text=True).stdout.strip()
    print(f"# bench/prefix_tiers.py {' '.join(sys.argv[1:])}")
    print(f"# {time.strftime('%Y-%m-%d %H:%M:%S UTC', time.gmtime())}; this tree {rev}; "
          f"(a) = {BASELINE_DIR} at {BASELINE_COMMIT} + {PATCH.name}; model {model}")
    print(f"# pdserve up --prefill 2 --decode 2 --disaggregation {args.disaggregation}, "
          f"pinned to cores {args.cpus} (of {os.cpu_count()}); {args.rounds} round(s), "
          f"rate x{args.rate_scale:g}; 1-min load average {os.getloadavg()[0]:.1f} (other "
          f"jobs on this machine count: see each run's)")
    for s in [*SYSTEMS[1:], *VARIANTS]:
        flags, absent = system_flags(s, help_text, "DIR")
        print(f"# {LABELS[s]}: passes {' '.join(flags) or 'no flag of its own'}"
              + (f"; not in `pdserve up --help`, not passed: {' '.join(absent)}" if absent
                 else ""))
    sys.stdout.flush()


def run_trace(name: str, args, model: str, help_text: str, trees: dict, tmp: Path) -> str:
    path, recs = trace_file(name, args.quick, tmp)
    ws, (pool, decode_pool) = working_set_blocks(recs), pool_blocks(recs, args.pool_fraction)
    common = ["--model", model, "--prefill", "2", "--decode", "2", "--prefill-num-blocks",
              str(pool), "--num-blocks", str(decode_pool), "--disaggregation",
              args.disaggregation, "--max-queue-delay-factor", "0"]
    runs: dict[str, list[dict]] = {s: [] for s in args.systems}
    for rnd in range(args.rounds):
        for s in args.systems:
            disk = tempfile.mkdtemp(prefix=f"kv-disk-{s}-", dir=tmp)
            flags = common + system_flags(s, help_text, disk)[0]
            log = tmp / f"{name}-{s}-{rnd}.log"
            run = run_one(trees[s], flags, path, args, log)
            shutil.rmtree(disk, ignore_errors=True)
            runs[s].append(run)
            ok = sum(r["status"] == "ok" for r in run["records"])
            print(f"# {name} round {rnd + 1} {s}: {ok}/{len(run['records'])} ok, computed "
                  f"{run['computed']['prefill']:.0f} prefill + {run['computed']['decode']:.0f} "
                  f"decode tokens, window {run['window_s']:.1f} s, load {run['load'][0]:.1f}"
                  f" -> {run['load'][1]:.1f}", flush=True)
            print("#   " + ", ".join(f"{k} {v:.0f}" for k, v in run["where"].items()),
                  flush=True)
            fell = [ln.strip() for ln in log.read_text(errors="replace").splitlines()
                    if "fell back to compute" in ln] if log.exists() else []
            for ln in fell[:3]:
                print(f"#   {ln[-200:]}", flush=True)
            if run["phases"]:
                print("#   TTFT phases p90 (mean) ms: " + ", ".join(
                    f"{k} {v['p90_ms']:.0f} ({v['mean_ms']:.0f})"
                    for k, v in run["phases"].items() if v["mean_ms"] >= 0.5), flush=True)
            for e in sorted({r["error"] for r in run["records"] if r["error"]})[:2]:
                print(f"#   failed: {e}", flush=True)
    ref = "A" if "A" in runs else "a"         # (a') when it ran: the same engine's numerics
    reference = runs[ref][0]["records"]
    fresh = [n * BLOCK_SIZE >= FRESH_TOKENS for n in new_blocks(recs)]
    rows = {s: aggregate(runs[s], reference, fresh) for s in args.systems}
    prompt_tokens = sum(r.input_length for r in recs)
    return table(name, rows, ref, f"{len(recs)} requests ({prompt_tokens} prompt tokens), "
                 f"working set {ws} blocks of {BLOCK_SIZE}; KV blocks per prefill worker {pool}, "
                 f"per decode worker {decode_pool}; "
                 f"{args.rounds} round(s)") + phase_table(runs)


def main(argv=None) -> int:
    args = parse_args(argv)
    if not args.model:
        from pdserve.default_model import resolve_default_model
        args.model = str(resolve_default_model())
    help_text = up_help()
    trees = {"a": baseline_tree(), "b": ROOT, "c": ROOT}
    if "A" in args.systems or any(b == "A" for b, _ in VARIANTS.values()):
        trees["A"] = affinity_tree()
    trees.update({name: trees[base] for name, (base, _) in VARIANTS.items()})
    header(args, args.model, help_text)
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="prefix-tiers-") as tmp:
        tables = [run_trace(n, args, args.model, help_text, trees, Path(tmp)) for n in args.traces]
    print(f"\n## bench/prefix_tiers.py ({time.monotonic() - t0:.0f} s in all; 1-min load "
          f"average {os.getloadavg()[0]:.1f} at the end)\n")
    print("\n\n".join(tables))
    return 0


if __name__ == "__main__":
    sys.exit(main())
