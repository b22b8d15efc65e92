"""A measured cost profile of one machine + model + engine options: what the simulator charges
for a prefill chunk, a decode step, a KV handover and a request's pass through the gateway.

`pdserve profile` writes one (pdserve/profile.py measures it); the simulator and `pdserve plan`
read it. The file is JSON, `schema` = "pdserve.profile/<major>"; a reader refuses another major.

The cost functions are least-squares fits of written-down models to the measured points, with
every coefficient kept >= 0 (non-negative least squares), so a cost never falls with more work:

    prefill_s(n, cached) = a + b*n + c*n*(cached + n/2)     # n tokens computed after `cached`
                                                            # (attention reads cached + n/2 on
                                                            # average per new token)
    decode_s(batch, ctx) = a + b*batch + c*ctx              # ctx: context tokens summed over the batch
    handover_s(tokens)   = a + b*tokens

Beyond the measured range the models grow linearly (prefill: quadratically in n, as attention
does); they are never evaluated below zero. With too few points to fit, a model falls back to
the mean of the points (a constant), never to a wild extrapolation.
"""
from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from itertools import combinations
from pathlib import Path

import numpy as np

SCHEMA = "pdserve.profile/1"
SCHEMA_PREFIX = "pdserve.profile/"


def _major(schema: str) -> int:
    if not isinstance(schema, str) or not schema.startswith(SCHEMA_PREFIX):
        raise ValueError(f"not a pdserve profile: schema {schema!r} (expected {SCHEMA!r})")
    try:
        return int(schema[len(SCHEMA_PREFIX):].split(".")[0])
    except ValueError:
        raise ValueError(f"bad profile schema version {schema!r}") from None


def nnls(features: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Least squares with every coefficient >= 0, exactly, by trying every subset of columns
    (the models here have at most 3): the best unconstrained fit on a subset whose coefficients
    are all >= 0 is the constrained optimum (it satisfies the KKT conditions)."""
    k = features.shape[1]
    best, best_err = np.zeros(k), float(np.sum(y * y))
    for size in range(1, k + 1):
        for cols in combinations(range(k), size):
            sub = features[:, cols]
            coef, *_ = np.linalg.lstsq(sub, y, rcond=None)
            if np.any(coef < 0):
                continue
            err = float(np.sum((sub @ coef - y) ** 2))
            if err < best_err - 1e-18:
                best_err = err
                best = np.zeros(k)
                best[list(cols)] = coef
    return best


def _fit(rows: list[list[float]], y: list[float]) -> list[float]:
    """Coefficients of y ~ rows (each row's features; the first feature is the constant 1)."""
    if not y:
        return [0.0] * (len(rows[0]) if rows else 1)
    a, t = np.asarray(rows, dtype=float), np.asarray(y, dtype=float)
    if len(y) < a.shape[1]:          # underdetermined: a constant
        return [float(np.mean(t))] + [0.0] * (a.shape[1] - 1)
    scale = np.maximum(np.abs(a).max(axis=0), 1e-30)   # condition the columns
    return [float(c) for c in nnls(a / scale, t) / scale]


def _prefill_features(n: float, cached: float) -> list[float]:
    return [1.0, n, n * (cached + n / 2.0)]


def _decode_features(batch: float, ctx: float) -> list[float]:
    return [1.0, batch, ctx]


def fit_prefill(points: list[dict]) -> list[float]:
    return _fit([_prefill_features(p["chunk_tokens"], p.get("cached_tokens", 0)) for p in points],
                [p["seconds"] for p in points])


def fit_decode(points: list[dict]) -> list[float]:
    return _fit([_decode_features(p["batch"], p["context_tokens"]) for p in points],
                [p["seconds"] for p in points])


def fit_handover(points: list[dict]) -> list[float]:
    return _fit([[1.0, p["prompt_tokens"]] for p in points], [p["seconds"] for p in points])


def _dot(coef: list[float], feats: list[float]) -> float:
    return max(0.0, float(sum(c * f for c, f in zip(coef, feats))))


@dataclass
class Profile:
    """One machine + model + engine options, measured (pdserve/profile.py writes it).

    machine   cpu, logical_cores, affinity, threads {"prefill": p, "decode": d} (the torch
              threads each role was measured with), load averages, torch/python versions
    model     path, id, architecture, layers, quantization, dtype, kv_dtype, max_model_len
    options   the engine options (block_size, max_num_seqs, max_num_batched_tokens, ...),
              prefill_threads / decode_threads, how each cost was measured ("methods"), and
              after a live refresh "live" (url, window, steps seen)
    prefill / decode / handover   the measured points (keys in _POINT_KEYS; a live point
              also has "steps", "bucket", "source": "live")
    threads   the prefill role's threads (the decode role's: machine["threads"]["decode"])
    fits      derived from the points (recomputed on load, written for people to read)
    """
    schema: str
    pdserve_version: str
    created_unix: float
    machine: dict
    model: dict
    options: dict
    prefill: list[dict]
    decode: list[dict]
    handover: list[dict]
    gateway_s: float
    kv: dict
    threads: int
    fits: dict = field(default_factory=dict, compare=False)   # derived, rewritten on load

    def __post_init__(self):
        self.refit()

    def refit(self) -> None:
        """Recompute the cost fits from the measured points (after editing them)."""
        self.fits = {"prefill": fit_prefill(self.prefill), "decode": fit_decode(self.decode),
                     "handover": fit_handover(self.handover)}

    def prefill_s(self, chunk_tokens: int, cached_tokens: int = 0) -> float:
        """Seconds of one prefill step computing `chunk_tokens` after `cached_tokens` already
        in the KV cache (a prefix-cache hit or an earlier chunk)."""
        if chunk_tokens <= 0:
            return 0.0
        return _dot(self.fits["prefill"], _prefill_features(chunk_tokens, cached_tokens))

    def decode_s(self, batch: int, context_tokens: int) -> float:
        """Seconds of one decode step of `batch` sequences holding `context_tokens` in all."""
        if batch <= 0:
            return 0.0
        return _dot(self.fits["decode"], _decode_features(batch, context_tokens))

    def handover_s(self, prompt_tokens: int) -> float:
        """Seconds the decode side waits for a prompt's KV after the prefill compute ended."""
        if prompt_tokens <= 0 or not self.handover:
            return 0.0
        return _dot(self.fits["handover"], [1.0, prompt_tokens])

    def to_json(self) -> dict:
        d = asdict(self)
        d["fits"] = dict(self.fits)      # informative; from_json recomputes them
        return d

    def save(self, path) -> None:
        Path(path).write_text(json.dumps(self.to_json(), indent=1) + "\n")

    @classmethod
    def from_json(cls, d: dict) -> "Profile":
        if not isinstance(d, dict):
            raise ValueError("a profile is a JSON object")
        major = _major(d.get("schema"))
        if major != _major(SCHEMA):
            raise ValueError(f"profile schema {d['schema']!r} is not supported by this pdserve "
                             f"(it reads {SCHEMA!r}): re-run `pdserve profile`")
        names = [f for f in cls.__dataclass_fields__ if f != "fits"]
        missing = [f for f in names if f not in d]
        if missing:
            raise ValueError(f"profile lacks {', '.join(missing)}")
        kw = {f: d[f] for f in names}
        _check_points(kw)
        return cls(**kw)

    @classmethod
    def load(cls, path) -> "Profile":
        try:
            d = json.loads(Path(path).read_text())
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}: not JSON ({e})") from None
        return cls.from_json(d)


_POINT_KEYS = {"prefill": ("chunk_tokens", "cached_tokens", "seconds"),
               "decode": ("batch", "context_tokens", "seconds"),
               "handover": ("prompt_tokens", "seconds")}


def _check_points(kw: dict) -> None:
    for table, keys in _POINT_KEYS.items():
        for i, p in enumerate(kw[table]):
            for k in keys:
                v = p.get(k) if isinstance(p, dict) else None
                if not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
                    raise ValueError(f"profile {table}[{i}].{k} = {v!r}: need a number >= 0")
    if not kw["prefill"] or not kw["decode"]:
        raise ValueError("a profile needs prefill and decode points")


def example() -> Profile:
    """A plausible profile (SmolLM2-135M-like on one CPU core), built in code for tests: the
    points follow the cost models exactly, so the fits reproduce them."""
    pre, dec, hand = (0.004, 0.006, 2e-6), (0.012, 0.004, 2e-6), (0.002, 1e-5)
    prefill = [{"chunk_tokens": n, "cached_tokens": c,
                "seconds": _dot(list(pre), _prefill_features(n, c))}
               for c in (0, 512, 1024) for n in (16, 64, 128, 256, 512)]
    decode = [{"batch": b, "context_tokens": b * ctx,
               "seconds": _dot(list(dec), _decode_features(b, b * ctx))}
              for b in (1, 2, 4, 8, 16) for ctx in (128, 1024)]
    handover = [{"prompt_tokens": n, "seconds": hand[0] + hand[1] * n} for n in (64, 512, 2048)]
    return Profile(schema=SCHEMA, pdserve_version="0.0.0", created_unix=0.0,
                   machine={"cpu": "example", "logical_cores": 2, "affinity": [0, 1]},
                   model={"id": "example", "architecture": "LlamaForCausalLM", "layers": 30},
                   options={"threads": 1, "block_size": 16, "max_num_seqs": 16,
                            "max_num_batched_tokens": 512},
                   prefill=prefill, decode=decode, handover=handover, gateway_s=0.002,
                   kv={"block_size": 16, "num_blocks": 4096}, threads=1)
