"""bench/vs_llama.py's tables: every measurement is recorded per (section, server, round) and
printed as the median over rounds (the rounds' range beside where it helps), then the issue 34
targets with the measured ratios. Ratios are pdserve / llama-server for rates (higher is
better) and for latencies (lower is better), as each target is written.
"""
from __future__ import annotations

import os
import statistics
import subprocess
import sys
import time
from collections import defaultdict

NAN = float("nan")


def med(xs) -> float:
    xs = [x for x in xs if x is not None and x == x]
    return statistics.median(xs) if xs else NAN


def ratio(a: float, b: float) -> float:
    return a / b if b and b == b and a == a else NAN


def f(x: float, nd: int = 1) -> str:
    return "n/a" if x is None or x != x else f"{x:.{nd}f}"


def tee_stdout(path: str) -> None:
    """Everything printed (stdout and stderr) also goes to `path`."""
    tee = subprocess.Popen(["tee", "-a", path], stdin=subprocess.PIPE)
    os.dup2(tee.stdin.fileno(), sys.stdout.fileno())
    os.dup2(tee.stdin.fileno(), sys.stderr.fileno())


class Report:
    def __init__(self, pdserves: list[str], peer: str, args):
        self.pds, self.peer, self.a = pdserves, peer, args
        self.levels: dict[int, dict[str, list[dict]]] = defaultdict(lambda: defaultdict(list))
        self._prefill: dict[str, list[dict]] = defaultdict(list)
        self._ttft: dict[str, list[float]] = defaultdict(list)
        self._offline: dict[str, tuple[int, list[float]]] = {}
        self._startup: dict[str, tuple[float, str]] = {}
        self._affinity: dict[str, set[str]] = {}

    # -- recording ------------------------------------------------------------------------
    def level(self, c: int, name: str, res: dict) -> None:
        self.levels[c][name].append(res)

    def prefill(self, name: str, res: dict) -> None:
        self._prefill[name].append(res)

    def last_prefill(self, name: str) -> str:
        r = self._prefill[name][-1]
        if "error" in r:
            return f"error {r['error'][:80]}"
        return (f"{r['prompt_tokens']} tokens, TTFT {r['ttft'] * 1e3:.0f} ms = {r['pp_ttft']:.0f} "
                f"tok/s (own: {f(r['pp_own'], 0)} tok/s)")

    def ttft(self, name: str, xs: list[float]) -> None:
        self._ttft[name] += xs

    def offline(self, name: str, threads: int, tok_s: list[float]) -> None:
        th, xs = self._offline.get(name, (threads, []))
        self._offline[name] = (threads, xs + tok_s)

    def startup(self, name: str, seconds: float, line: str) -> None:
        self._startup[name] = (seconds, line)

    def affinity(self, by_server: dict[str, set[str]]) -> None:
        self._affinity = by_server

    # -- printing -------------------------------------------------------------------------
    def header(self, llama_version: str, log_dir) -> str:
        a = self.a
        with open("/proc/loadavg") as fh:
            load = " ".join(fh.read().split()[:3])
        variants = "; ".join(f"{n}: `pdserve up {' '.join(args)}`" for n, args in a.pdserve)
        return (f"# bench/vs_llama.py {time.strftime('%Y-%m-%d %H:%M:%S UTC', time.gmtime())}; "
                f"{os.cpu_count()} cores, load average {load}\n"
                f"# model {a.model}; cores {a.cpus} for every process of every server\n"
                f"# llama-server ({llama_version}): -t {a.llama_threads} -cb --parallel c "
                f"-c max(4096, 1024 c) --jinja {' '.join(a.llama_args.split())}\n# pdserve: {variants}\n"
                f"# ~{a.prompt_tokens}-token prompts, {a.output_tokens} output tokens (ignore_eos), "
                f"streaming chat, greedy; {a.rounds} round(s) alternating; logs {log_dir}")

    def _cell(self, c: int, name: str, key: str) -> float:
        return med(r[key] for r in self.levels[c].get(name, []))

    def concurrency_table(self) -> list[str]:
        out = ["| c | server | output tok/s | TTFT p50 ms | ITL p50 ms | ITL p90 ms | refused "
               "| errors | prompt tokens | tok/s / llama-server | ITL p90 / llama-server |",
               "| --- |" + " --- |" * 10]
        for c in sorted(self.levels):
            base_tok, base_p90 = (self._cell(c, self.peer, k) for k in ("tok_s", "itl_p90"))
            for name in [self.peer, *self.pds]:
                runs = self.levels[c].get(name, [])
                if not runs:
                    continue
                tok = self._cell(c, name, "tok_s")
                rng = f" ({min(r['tok_s'] for r in runs):.1f}-{max(r['tok_s'] for r in runs):.1f})" \
                    if len(runs) > 1 else ""
                p90 = self._cell(c, name, "itl_p90")
                mine = name != self.peer
                out.append(
                    f"| {c} | {name} | {tok:.1f}{rng} | {f(self._cell(c, name, 'ttft_p50') * 1e3, 0)} | "
                    f"{f(self._cell(c, name, 'itl_p50') * 1e3)} | {f(p90 * 1e3)} | "
                    f"{sum(r['refused'] for r in runs)} of {sum(r['requests'] for r in runs)} | "
                    f"{sum(r['errors'] for r in runs)} | {f(self._cell(c, name, 'prompt_tokens'), 0)} | "
                    f"{f(ratio(tok, base_tok), 2) if mine else ''} | "
                    f"{f(ratio(p90, base_p90), 2) if mine else ''} |")
        return out

    def prefill_rows(self) -> list[str]:
        out = ["| server | prompt tokens | TTFT ms | prompt tok/s (TTFT) | prompt tok/s (its own "
               "timing) | TTFT-derived / llama-server's | TTFT-derived / llama-server's own |",
               "| --- |" + " --- |" * 6]
        peer = [r for r in self._prefill[self.peer] if "error" not in r]
        base, base_own = med(r["pp_ttft"] for r in peer), med(r["pp_own"] for r in peer)
        for name in [self.peer, *self.pds]:
            rs = [r for r in self._prefill[name] if "error" not in r]
            errs = len(self._prefill[name]) - len(rs)
            pp, own = med(r["pp_ttft"] for r in rs), med(r["pp_own"] for r in rs)
            mine = name != self.peer
            out.append(f"| {name}{f' ({errs} errors)' if errs else ''} | "
                       f"{f(med(r['prompt_tokens'] for r in rs), 0)} | "
                       f"{f(med(r['ttft'] for r in rs) * 1e3, 0)} | {f(pp, 0)} | {f(own, 0)} | "
                       f"{f(ratio(pp, base), 2) if mine else ''} | "
                       f"{f(ratio(pp, base_own), 2) if mine else ''} |")
        return out

    def one_stream_rows(self) -> list[str]:
        out = ["| server | served decode tok/s (1 / mean ITL, c=1) | output tok/s c=1 | TTFT "
               f"{self.a.short_tokens}-token prompt ms | offline engine tok/s (threads) | "
               "served / offline | served / llama-server | TTFT / llama-server's |",
               "| --- |" + " --- |" * 7]
        base_dec = self._cell(1, self.peer, "decode_tok_s")
        base_ttft = med(self._ttft[self.peer])
        for name in [self.peer, *self.pds]:
            dec = self._cell(1, name, "decode_tok_s")
            ttft = med(self._ttft[name])
            th, off = self._offline.get(name, (0, []))
            mine = name != self.peer
            out.append(f"| {name} | {f(dec)} | {f(self._cell(1, name, 'tok_s'))} | "
                       f"{f(ttft * 1e3)} | {f(med(off)) + f' ({th})' if off else ''} | "
                       f"{f(ratio(dec, med(off)), 2) if off else ''} | "
                       f"{f(ratio(dec, base_dec), 2) if mine else ''} | "
                       f"{f(ratio(ttft, base_ttft), 2) if mine else ''} |")
        return out

    def targets(self) -> list[str]:
        out = ["| target (issue 34) | wanted | " + " | ".join(self.pds) + " |",
               "| --- | --- |" + " --- |" * len(self.pds)]

        def row(what: str, want: str, fn) -> None:
            out.append(f"| {what} | {want} | " + " | ".join(fn(n) for n in self.pds) + " |")
        row("one stream: served decode / offline engine, same threads", ">= 0.95",
            lambda n: f(ratio(self._cell(1, n, "decode_tok_s"), med(self._offline.get(n, (0, []))[1])), 2))
        row("one stream: served decode tok/s / llama-server", ">= 1.0",
            lambda n: f(ratio(self._cell(1, n, "decode_tok_s"), self._cell(1, self.peer, "decode_tok_s")), 2))
        peer_pp = med(r.get("pp_own") or r.get("pp_ttft") for r in self._prefill[self.peer] if "error" not in r)
        row(f"prefill tok/s, {self.a.prefill_tokens}-token prompt / llama-server's own", ">= 3.0",
            lambda n: f(ratio(med(r["pp_ttft"] for r in self._prefill[n] if "error" not in r), peer_pp), 2))
        row(f"TTFT of a {self.a.short_tokens}-token prompt / llama-server's", "<= 1.0",
            lambda n: f(ratio(med(self._ttft[n]), med(self._ttft[self.peer])), 2))
        for c in (c for c in sorted(self.levels) if c >= 16):
            row(f"output tok/s at c={c} / llama-server (ITL p90 ratio; refused)", ">= 2.0 (<= 1.0; 0)",
                lambda n, c=c: f"{f(ratio(self._cell(c, n, 'tok_s'), self._cell(c, self.peer, 'tok_s')), 2)} "
                f"({f(ratio(self._cell(c, n, 'itl_p90'), self._cell(c, self.peer, 'itl_p90')), 2)}; "
                f"{sum(r['refused'] for r in self.levels[c].get(n, []))})")
        row(f"`pdserve up` to ready (s; llama-server: {f(self._startup.get(self.peer, (NAN,))[0])})",
            "<= 3", lambda n: f(self._startup.get(n, (NAN,))[0]))
        return out

    def tables(self) -> str:
        idle = {n: max((v for c in self.levels.values() for runs in c.values() for r in runs
                        for k, v in r["idle_cpu_s"].items() if k == n), default=0.0)
                for n in [self.peer, *self.pds]}
        lines = ["", f"(1) closed loop of c clients, median of {self.a.rounds} round(s) (range)", "",
                 *self.concurrency_table(), "",
                 f"(2) prefill, ~{self.a.prefill_tokens}-token prompt, max_tokens 1", "",
                 *self.prefill_rows(), "", "(3)+(4) one stream", "", *self.one_stream_rows(), "",
                 *self.targets(), "",
                 "idle server's CPU seconds during the other's measurement (most of any): "
                 + ", ".join(f"{n} {v:.2f}" for n, v in idle.items()),
                 "Cpus_allowed_list over each tree: " + "; ".join(
                     f"{n}: {','.join(sorted(v))}" for n, v in self._affinity.items()),
                 "tokens per content chunk (1.00: one gap per token): " + ", ".join(
                     f"{n} {f(med(r['tokens_per_chunk'] for c in self.levels.values() for r in c.get(n, [])), 2)}"
                     for n in [self.peer, *self.pds])]
        return "\n".join(lines)
