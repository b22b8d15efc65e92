"""Request traces in the Mooncake format: one JSON object a line,

    {"timestamp": 27482, "input_length": 6955, "output_length": 52, "hash_ids": [46, 47, ...]}

`timestamp` is the arrival in milliseconds from the trace start, `input_length` the prompt's
tokens, `output_length` the tokens to generate, and `hash_ids` (optional) one id per
BLOCK_TOKENS-token block of the prompt: two prompts whose first k ids are equal share their first
k blocks of text (a prefix the server's cache can reuse). `pdserve bench --trace` synthesises
prompts from the ids (bench's prompt builder) and the simulator replays the arrivals.

read_trace refuses a bad line with a ValueError that names the file, the line and the fault;
blank lines are skipped. write_trace writes what read_trace reads back unchanged.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

BLOCK_TOKENS = 512


@dataclass(frozen=True)
class TraceRecord:
    timestamp_ms: float      # arrival, from the trace start
    input_length: int        # prompt tokens
    output_length: int       # tokens to generate
    hash_ids: tuple[int, ...] = ()   # Mooncake: one id per 512-token block of the prompt


def _int_field(obj: dict, key: str, minimum: int) -> int:
    v = obj.get(key)
    if isinstance(v, bool) or not isinstance(v, (int, float)) or v != int(v):
        raise ValueError(f"{key!r} must be an integer, got {v!r}")
    if v < minimum:
        raise ValueError(f"{key!r} must be >= {minimum}, got {v!r}")
    return int(v)


def parse_record(obj) -> TraceRecord:
    """One decoded line as a TraceRecord; ValueError saying what is wrong with it."""
    if not isinstance(obj, dict):
        raise ValueError(f"a line must be a JSON object, got {type(obj).__name__}")
    ts = obj.get("timestamp")
    if isinstance(ts, bool) or not isinstance(ts, (int, float)) or not math.isfinite(ts) or ts < 0:
        raise ValueError(f"'timestamp' must be a number of ms >= 0, got {ts!r}")
    ids = obj.get("hash_ids", [])
    if not isinstance(ids, list) or any(isinstance(i, bool) or not isinstance(i, int) for i in ids):
        raise ValueError(f"'hash_ids' must be a list of integers, got {ids!r}")
    rec = TraceRecord(float(ts), _int_field(obj, "input_length", 1),
                      _int_field(obj, "output_length", 1), tuple(ids))
    if len(ids) > math.ceil(rec.input_length / BLOCK_TOKENS):
        raise ValueError(f"{len(ids)} hash_ids for {rec.input_length} tokens: at most one per "
                         f"{BLOCK_TOKENS}-token block")
    return rec


def read_trace(path) -> list[TraceRecord]:
    """The records of the Mooncake JSONL file at `path`, in file order."""
    out = []
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                out.append(parse_record(json.loads(line)))
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{n}: not JSON ({e.msg})") from None
            except ValueError as e:
                raise ValueError(f"{path}:{n}: {e}") from None
    return out


def record_json(r: TraceRecord) -> dict:
    ts = int(r.timestamp_ms) if float(r.timestamp_ms).is_integer() else r.timestamp_ms
    d = {"timestamp": ts, "input_length": r.input_length, "output_length": r.output_length}
    if r.hash_ids:
        d["hash_ids"] = list(r.hash_ids)
    return d


def write_trace(path, records: Iterable[TraceRecord]) -> None:
    """Write `records` as Mooncake JSONL (whole or not at all: through a temporary file)."""
    path = Path(path)
    part = path.with_name(path.name + ".part")
    with open(part, "w", encoding="utf-8") as f:
        for r in records:
            f.write(json.dumps(record_json(r)) + "\n")
    part.replace(path)
