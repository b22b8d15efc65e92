"""The load generator under `pdserve bench` (and bench/goodput.py, bench/real_model.py): one
streaming OpenAI request timed (`send`), and the three ways of sending many (`open_loop` at
given arrival times, `closed_loop` with N clients), with a counted progress line on stderr.

A request's life, as `send` times it (t0 = the request is sent):

    t0 ---- first content chunk (TTFT) ---- ... chunks ... ---- last content chunk ---- [DONE]
    |<------------- ttft_s ------------->|<---- itl_s x (output_tokens - 1) ---->|
    |<------------------------------------- e2e_s ------------------------------------------->|

output_tokens: the final chunk's `usage.completion_tokens` (stream_options.include_usage);
a server that sends none has its content chunks counted instead (tokens_from_usage False).
status: "ok" (200 and a whole stream), "rejected" (429: never retried here), "error" (any other
HTTP status, an error chunk in the stream, a transport error or the client timeout).
Records are sim.stats's per-request dicts plus `sent_s` (from the run start), `http_status`,
`retry_after`, `error` (a short reason), `prompt_tokens` (usage's) and `text` (the streamed
output, joined: bench/prefix_tiers.py compares greedy outputs across systems), so
sim.stats.summarize reads them as they are.
With Target.keep_gaps a record also has `gaps_s` (the gaps between consecutive content chunks),
`chunks` (content chunks) and `timings` (a server's own `timings` object on its chunks, as
llama.cpp's llama-server sends; usage's `pdserve` phases when asked for), for bench/vs_llama.py.
"""
from __future__ import annotations

import asyncio
import json
import sys
import time
from dataclasses import dataclass, field
from typing import Iterator

import httpx

ERROR_TEXT = 160


@dataclass
class Target:
    """Where and how to send: the server's base URL (no /v1), the model id, the endpoint."""
    base: str
    model: str
    endpoint: str = "completions"        # or "chat" (/v1/chat/completions)
    api_key: str = ""
    timeout_s: float = 300.0             # per request, connect to [DONE]
    ignore_eos: bool = True
    extra: dict = field(default_factory=dict)   # more body fields (e.g. a server's own options)
    keep_gaps: bool = False              # records carry gaps_s, chunks, timings (docstring)

    @property
    def url(self) -> str:
        path = "/v1/chat/completions" if self.endpoint == "chat" else "/v1/completions"
        return self.base.rstrip("/") + path

    def headers(self) -> dict:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def body(self, prompt: str, max_tokens: int) -> dict:
        b = {"model": self.model, "max_tokens": max_tokens, "temperature": 0, "stream": True,
             "stream_options": {"include_usage": True}, **self.extra}
        if self.ignore_eos:
            b["ignore_eos"] = True
        if self.endpoint == "chat":
            b["messages"] = [{"role": "user", "content": prompt}]
        else:
            b["prompt"] = prompt
        return b


@dataclass
class Job:
    """One request to send: its prompt, max_tokens and (open loop) arrival from the start."""
    prompt: str
    max_tokens: int
    at_s: float = 0.0


def client(target: Target, connections: int) -> httpx.AsyncClient:
    return httpx.AsyncClient(timeout=httpx.Timeout(target.timeout_s), headers=target.headers(),
                             limits=httpx.Limits(max_connections=connections,
                                                 max_keepalive_connections=connections))


def _content(chunk: dict) -> str:
    """The chunk's output text ("" for none)."""
    return "".join(c.get("text") or (c.get("delta") or {}).get("content") or ""
                   for c in chunk.get("choices") or [])


def _record(t0: float, status: str, **kw) -> dict:
    r = {"ttft_s": None, "itl_s": None, "e2e_s": time.perf_counter() - t0, "output_tokens": 0,
         "status": status, "tokens_from_usage": False, "http_status": None,
         "retry_after": None, "error": "", "prompt_tokens": None, "text": ""}
    r.update(kw)
    return r


async def _stream(resp: httpx.Response, t0: float, keep_gaps: bool = False) -> dict:
    stamps, usage, timings, text = [], None, None, []
    async for line in resp.aiter_lines():
        if not line.startswith("data:"):
            continue
        data = line[5:].strip()
        if data == "[DONE]":
            break
        chunk = json.loads(data)
        if chunk.get("error"):
            return _record(t0, "error", http_status=200,
                           error=f"stream error: {chunk['error']}"[:ERROR_TEXT])
        usage = chunk.get("usage") or usage
        timings = chunk.get("timings") or (usage or {}).get("pdserve") or timings
        if piece := _content(chunk):
            stamps.append(time.perf_counter())
            text.append(piece)
    n = int(usage["completion_tokens"]) if usage else len(stamps)
    if not stamps:
        return _record(t0, "error", http_status=200, error="no content in the stream")
    itl = (stamps[-1] - stamps[0]) / (n - 1) if n > 1 and len(stamps) > 1 else None
    more = {"gaps_s": [b - a for a, b in zip(stamps, stamps[1:])], "chunks": len(stamps),
            "timings": timings} if keep_gaps else {}
    return _record(t0, "ok", http_status=200, ttft_s=stamps[0] - t0, itl_s=itl,
                   output_tokens=n, tokens_from_usage=usage is not None,
                   prompt_tokens=usage.get("prompt_tokens") if usage else None,
                   text="".join(text), **more)


async def send(http: httpx.AsyncClient, target: Target, job: Job) -> dict:
    """One streaming request, timed (module docstring); never raises for the server's faults."""
    t0 = time.perf_counter()
    try:
        async with http.stream("POST", target.url, json=target.body(job.prompt, job.max_tokens)) as r:
            if r.status_code != 200:
                text = (await r.aread()).decode(errors="replace")
                return _record(t0, "rejected" if r.status_code == 429 else "error",
                               http_status=r.status_code, retry_after=r.headers.get("retry-after"),
                               error=f"HTTP {r.status_code}: {text}"[:ERROR_TEXT])
            return await _stream(r, t0, target.keep_gaps)
    except (httpx.HTTPError, json.JSONDecodeError, ValueError, KeyError, TypeError) as e:
        return _record(t0, "error", error=f"{type(e).__name__}: {e}"[:ERROR_TEXT])


class Progress:
    """sent / done / errors (+ 429s) on stderr: redrawn in place on a terminal, a line every
    `every_s` elsewhere (a log), and a last line at close."""

    def __init__(self, total: int | None, enabled: bool = True, every_s: float = 5.0):
        self.total, self.enabled, self.every_s = total, enabled, every_s
        self.sent = self.done = self.errors = self.rejected = 0
        self.tty = sys.stderr.isatty()
        self.t0 = self._last = time.monotonic()

    def line(self) -> str:
        of = f"/{self.total}" if self.total else ""
        width = 30
        frac = self.done / self.total if self.total else 0.0
        bar = "#" * int(width * frac) + "." * (width - int(width * frac)) if self.total else ""
        return (f"[{bar}] " if bar else "") + (f"sent {self.sent}{of} done {self.done}{of} "
                f"errors {self.errors} 429 {self.rejected} {time.monotonic() - self.t0:.0f}s")

    def update(self, record: dict | None = None, sent: int = 0) -> None:
        self.sent += sent
        if record is not None:
            self.done += 1
            self.errors += record["status"] == "error"
            self.rejected += record["status"] == "rejected"
        now = time.monotonic()
        if self.enabled and (self.tty or now - self._last >= self.every_s):
            self._last = now
            print(("\r" if self.tty else "") + self.line(), end="" if self.tty else "\n",
                  file=sys.stderr, flush=True)

    def close(self) -> None:
        if self.enabled:
            print(("\r" if self.tty else "") + self.line(), file=sys.stderr, flush=True)


async def _timed(http, target, job, start: float, progress: Progress) -> dict:
    progress.update(sent=1)
    sent = time.perf_counter() - start
    r = await send(http, target, job)
    r["sent_s"] = sent
    progress.update(r)
    return r


async def _settle(tasks: list[asyncio.Task], deadline: float) -> list[dict]:
    """Every task's record; one still running at `deadline` (perf_counter) is cancelled and
    recorded as an error."""
    if tasks:
        await asyncio.wait(tasks, timeout=max(0.0, deadline - time.perf_counter()))
    out = []
    for t in tasks:
        if t.done() and not t.cancelled():
            out.append(t.result())
        else:
            t.cancel()
            out.append({**_record(time.perf_counter(), "error", error="run deadline"), "sent_s": None})
    return out


async def open_loop(target: Target, jobs: list[Job], *, duration_s: float, deadline_s: float,
                    progress: Progress) -> tuple[list[dict], float]:
    """Send each job at its `at_s` (those at or after `duration_s` are not sent); wait for all,
    at most `deadline_s` from the start. Returns (records, window_s: start to last finish)."""
    jobs = sorted((j for j in jobs if j.at_s < duration_s), key=lambda j: j.at_s)
    async with client(target, max(16, len(jobs))) as http:
        start = time.perf_counter()
        deadline, tasks = start + deadline_s, []
        for j in jobs:
            wait = start + j.at_s - time.perf_counter()
            if start + j.at_s > deadline:
                break
            if wait > 0:
                await asyncio.sleep(wait)
            tasks.append(asyncio.create_task(_timed(http, target, j, start, progress)))
        records = await _settle(tasks, deadline)
        window = time.perf_counter() - start
    progress.close()
    return records, window


async def closed_loop(target: Target, jobs: Iterator[Job], *, concurrency: int,
                      duration_s: float, deadline_s: float, max_requests: int | None,
                      progress: Progress) -> tuple[list[dict], float]:
    """`concurrency` clients, each sending its next job as soon as its last one finished, until
    `duration_s` has passed or `max_requests` were sent; all waited for within `deadline_s`."""
    records: list[dict] = []
    budget = [max_requests if max_requests is not None else -1]

    async def worker(http, start):
        while time.perf_counter() - start < duration_s and budget[0] != 0:
            job = next(jobs, None)
            if job is None:
                return
            budget[0] -= 1
            records.append(await _timed(http, target, job, start, progress))

    async with client(target, concurrency + 4) as http:
        start = time.perf_counter()
        workers = [asyncio.create_task(worker(http, start)) for _ in range(concurrency)]
        done, pending = await asyncio.wait(workers, timeout=deadline_s)
        for w in pending:
            w.cancel()
            records.append({**_record(time.perf_counter(), "error", error="run deadline"),
                            "sent_s": None})
        window = time.perf_counter() - start
    progress.close()
    return records, window
