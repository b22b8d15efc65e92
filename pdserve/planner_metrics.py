"""The planner's signals on Kubernetes: the gateway's /metrics plus every ready worker's.

`pdserve up` hands its gateway the workers' metrics URLs (`--worker-metrics`), so one
gateway scrape holds the whole system (services/metrics_merge.py `scrape_workers`). On
Kubernetes the gateway is given none, and the autoscaler (pdserve/autoscale_signals.py)
holds while a pool's metrics are missing ("unknown", never zero load). So the planner
finds the workers the way the gateway finds them, through the headless Services' DNS (one
record per *ready* pod), and adds their /metrics to the gateway's, labelled the same way
(worker=IP:PORT, plus worker_metrics_up):

    scrape()  GET  --gateway-url/metrics                                 (text, as served)
              DNS  --prefill-metrics-dns, --decode-metrics-dns  -> pod IPs (ready pods)
              GET  http://POD_IP:9090/metrics for each, in parallel      (scrape_workers)
           -> the gateway's text + the workers' families as text

A gateway scrape that fails raises (the autoscaler holds: "metrics unknown"); a worker that
does not answer is worker_metrics_up 0 (the autoscaler names it and holds); a DNS name
with no ready pod adds nothing (a pool scaled to zero, or none ready yet).
"""
from __future__ import annotations

import socket
import ssl
import urllib.request

from prometheus_client import CollectorRegistry

from services.metrics import render_metrics
from services.metrics_merge import merge_families, scrape_workers


def resolve(host_port: str) -> list[str]:
    """`host:port` -> ["ip:port", ...] (sorted, distinct), [] if the name has no records."""
    host, _, port = host_port.rpartition(":")
    try:
        infos = socket.getaddrinfo(host, int(port), type=socket.SOCK_STREAM)
    except socket.gaierror:
        return []
    return sorted({f"{i[4][0]}:{i[4][1]}" for i in infos})


class _Families:
    def __init__(self, families):
        self.families = families

    def collect(self):
        return self.families


class ClusterMetrics:
    def __init__(self, gateway_url: str, worker_dns: list[str], timeout_s: float = 5.0,
                 context: ssl.SSLContext | None = None):
        url = gateway_url.rstrip("/")
        self.url = url if url.endswith("/metrics") else url + "/metrics"
        self.worker_dns = [d for d in worker_dns if d]
        self.timeout_s, self.context = timeout_s, context

    def worker_urls(self) -> dict[str, str]:
        return {addr: f"http://{addr}/metrics" for dns in self.worker_dns for addr in resolve(dns)}

    def scrape(self) -> str:
        with urllib.request.urlopen(self.url, timeout=self.timeout_s, context=self.context) as r:
            text = r.read().decode()
        urls = self.worker_urls()
        if not urls:
            return text
        registry = CollectorRegistry(auto_describe=False)
        registry.register(_Families(merge_families(scrape_workers(urls, self.timeout_s))))
        return text.rstrip("\n") + "\n" + render_metrics(registry).decode()
