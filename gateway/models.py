"""Several models behind one gateway: a map from the model id clients send to its `Gateway`.

Each model is a whole `Gateway` (core.py) of its own: tokenizer, context length learned from
its workers' Stats, prefill and decode pools, router, metrics. Both fronts look the request's
`model` up here (`Models.get`) and hand the request to that model's gateway.

Without `--models-file` the gateway serves the one model of `--model`/`--prefill`/`--decode`.
A models file (JSON) lists the models, each with its own pools, static or by DNS:

    [{"name": "small", "model": "/models/small",
      "prefill": "10.0.0.1:50061,10.0.0.2:50061", "decode": "10.0.0.3:50071"},
     {"name": "large", "model": "/models/large",
      "prefill_dns": "large-prefill:50061", "decode_dns": "large-decode:50071"}]

("max_model_len" per model is allowed too.) Everything else (ports, keys, TLS, timeouts,
probe intervals) is the gateway's own configuration, shared by every model.

Metrics: `Models.registry` serves every model's gateway series, each sample labelled
`model_name` (vLLM's label), so one scrape tells the models apart, and with
`--worker-metrics` (what `pdserve up` passes) every worker's own, labelled `worker`;
`--metrics-prefix vllm` names them all `vllm:...` instead of `pdserve:...`.
"""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import grpc
from prometheus_client import CollectorRegistry
from prometheus_client.metrics_core import Metric

from services.metrics import merge_families, scrape_workers

from .config import GatewayConfig
from .core import Gateway
from .request import GatewayError

MODEL_KEYS = {"name", "model", "prefill", "decode", "prefill_dns", "decode_dns", "max_model_len"}


def model_configs(cfg: GatewayConfig) -> list[GatewayConfig]:
    """One GatewayConfig per model: `cfg` itself, or one per entry of cfg.models_file."""
    if not cfg.models_file:
        return [cfg]
    path = Path(cfg.models_file)
    try:
        entries = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"models file {str(path)!r}: {e}") from None
    if not isinstance(entries, list) or not entries:
        raise ValueError(f"models file {str(path)!r}: expected a non-empty JSON list of models")
    out = []
    for i, e in enumerate(entries):
        if not isinstance(e, dict) or not {"name", "model"} <= set(e) or set(e) - MODEL_KEYS:
            raise ValueError(f"models file {str(path)!r}, entry {i}: expected an object with "
                             f"'name' and 'model' and only the keys {sorted(MODEL_KEYS)}")
        out.append(dataclasses.replace(
            cfg, models_file="", model=str(e["model"]), served_model_name=str(e["name"]),
            prefill=e.get("prefill", ""), decode=e.get("decode", ""),
            prefill_dns=e.get("prefill_dns", ""), decode_dns=e.get("decode_dns", ""),
            max_model_len=int(e.get("max_model_len", 0))))
    return out


class Models:
    """The models this gateway serves, by id, in the configured order."""

    def __init__(self, gateways: list[Gateway], worker_metrics=None,
                 metrics_prefix: str = "pdserve"):
        """`worker_metrics`: {worker id: /metrics URL}, or a function returning it at each
        scrape (--worker-metrics-file)."""
        self.by_name: dict[str, Gateway] = {}
        for gw in gateways:
            if gw.model_name in self.by_name:
                raise ValueError(f"model {gw.model_name!r} is configured twice")
            self.by_name[gw.model_name] = gw
        self.registry = CollectorRegistry()
        self.registry.register(_ModelLabelled(self.by_name, worker_metrics or {},
                                              metrics_prefix + ":"))

    @classmethod
    def from_config(cls, cfg: GatewayConfig) -> "Models":
        workers = cfg.worker_metrics_urls if cfg.worker_metrics_file else cfg.worker_metrics_urls()
        return cls([Gateway(c) for c in model_configs(cfg)], workers, cfg.metrics_prefix)

    def __iter__(self):
        return iter(self.by_name.values())

    def __len__(self) -> int:
        return len(self.by_name)

    @property
    def names(self) -> list[str]:
        return list(self.by_name)

    def get(self, model: str) -> Gateway:
        """The gateway of `model`; "" means the only model (several: INVALID_ARGUMENT).
        An unknown model is NOT_FOUND."""
        if not model:
            if len(self.by_name) == 1:
                return next(iter(self.by_name.values()))
            raise GatewayError(grpc.StatusCode.INVALID_ARGUMENT,
                               f"the request names no model; this gateway serves {self.names}")
        gw = self.by_name.get(model)
        if gw is None:
            raise GatewayError(grpc.StatusCode.NOT_FOUND,
                               f"the model {model!r} does not exist; this gateway serves "
                               f"{', '.join(map(repr, self.by_name))}")
        return gw

    async def start(self) -> None:
        for gw in self:
            await gw.start()

    async def stop(self) -> None:
        for gw in self:
            await gw.stop()

    def worker_addresses(self) -> list[str]:
        return [a for gw in self for a in gw.worker_addresses()]


class _ModelLabelled:
    """A collector: every model's gateway registry, each sample labelled model_name=ID, and
    the workers' own metrics (`--worker-metrics`, each labelled worker=ID), families of the
    same name merged (an exposition may name each family once), under `prefix`."""

    def __init__(self, by_name: dict[str, Gateway], workers: dict[str, str], prefix: str):
        self.by_name, self.workers, self.prefix = by_name, workers, prefix

    def collect(self):
        families = []
        for name, gw in self.by_name.items():
            for fam in gw.metrics.registry.collect():
                out = Metric(fam.name, fam.documentation, fam.type, fam.unit)
                out.samples = [s._replace(labels={**s.labels, "model_name": name})
                               for s in fam.samples]
                families.append(out)
        workers = self.workers() if callable(self.workers) else self.workers
        if workers:
            families += scrape_workers(workers)
        return merge_families(families, self.prefix)
