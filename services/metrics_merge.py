"""One exposition out of several processes' metrics: a gateway's /metrics that holds its
workers' too (`pdserve up` passes the workers' URLs, gateway/models.py), and the Kubernetes
planner's scrape of the worker pods (pdserve/planner_metrics.py). Split from
services/metrics.py, which keeps one process's own metrics."""
from __future__ import annotations

import logging
import urllib.request
from concurrent.futures import ThreadPoolExecutor

from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families

from .metrics import PREFIX

log = logging.getLogger(__name__)


def scrape_workers(urls: dict[str, str], timeout_s: float = 1.0) -> list[Metric]:
    """The /metrics of each worker (worker id -> URL), fetched in parallel, every sample
    labelled worker=ID, so one gateway scrape holds the whole `pdserve up` system. A worker
    that does not answer within timeout_s is left out and counted in worker_metrics_up 0."""
    def one(item):
        worker, url = item
        try:
            with urllib.request.urlopen(url, timeout=timeout_s) as r:
                text = r.read().decode()
            return worker, list(text_string_to_metric_families(text))
        except (OSError, ValueError) as e:
            log.debug("metrics of %s at %s: %r", worker, url, e)
            return worker, None
    up = Metric(PREFIX + "worker_metrics_up", "1 if the worker's /metrics answered this "
                "scrape, else 0", "gauge")
    out = [up]
    with ThreadPoolExecutor(max(1, min(16, len(urls)))) as pool:
        for worker, families in pool.map(one, urls.items()):
            up.add_sample(up.name, {"worker": worker}, 0.0 if families is None else 1.0)
            for fam in families or ():
                fam.samples = [x._replace(labels={**x.labels, "worker": worker})
                               for x in fam.samples]
                out.append(fam)
    return out


def merge_families(families, prefix: str = PREFIX) -> list[Metric]:
    """Families of the same name as one (an exposition may name each family once), renamed
    from PREFIX to `prefix` (e.g. "vllm:", the names vLLM's dashboards query)."""
    merged: dict[str, Metric] = {}
    for fam in families:
        name = prefix + fam.name.removeprefix(PREFIX) if fam.name.startswith(PREFIX) else fam.name
        out = merged.setdefault(name, Metric(name, fam.documentation, fam.type, fam.unit))
        out.samples += [x._replace(name=prefix + x.name.removeprefix(PREFIX))
                        if x.name.startswith(PREFIX) else x for x in fam.samples]
    return list(merged.values())
