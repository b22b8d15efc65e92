"""The KV offload tiers' metrics of a worker (engine/kv_offload.py), read from the engine at
each scrape (a collector: nothing is counted twice, nothing needs a timer):

    pdserve:kv_tier_blocks{role,tier}                     blocks held: device (cached
                                                          blocks), host, disk
    pdserve:kv_tier_hits_total{role,tier}                 blocks revived from host / disk
    pdserve:kv_tier_bytes_total{role,tier,direction}      bytes written to the tier ("out")
                                                          and loaded back from it ("in")
    pdserve:kv_tier_seconds_total{role,tier,direction}    the time those copies took
    pdserve:kv_tier_dropped_total{role}                   copies dropped (a full queue)

Every series exists from the start (0 with the tiers off), so a dashboard's rate() has a
baseline. `bind(engine)` once the engine exists; its `kv.tier_stats()` is a snapshot taken
under the tiers' own locks, safe from the scrape thread.
"""
from __future__ import annotations

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

PREFIX = "pdserve:"
TIERS = ("device", "host", "disk")
LOWER = ("host", "disk")
DIRECTIONS = ("in", "out")


class KvTierMetrics:
    def __init__(self, role: str, registry: CollectorRegistry):
        self.role = role
        self._source = None
        registry.register(self)

    def bind(self, engine) -> None:
        self._source = getattr(getattr(engine, "kv", None), "tier_stats", None)

    def describe(self):
        return []

    def collect(self):
        s = self._source() if self._source is not None else None
        blocks = GaugeMetricFamily(PREFIX + "kv_tier_blocks", "KV blocks held per tier",
                                   labels=("role", "tier"))
        hits = CounterMetricFamily(PREFIX + "kv_tier_hits", "KV blocks revived from a lower "
                                   "tier instead of recomputed", labels=("role", "tier"))
        nbytes = CounterMetricFamily(PREFIX + "kv_tier_bytes", "KV bytes copied to (out) and "
                                     "from (in) a tier", labels=("role", "tier", "direction"))
        secs = CounterMetricFamily(PREFIX + "kv_tier_seconds", "Seconds spent copying KV to "
                                   "(out) and from (in) a tier", labels=("role", "tier", "direction"))
        dropped = CounterMetricFamily(PREFIX + "kv_tier_dropped", "KV block copies to a tier "
                                      "dropped (a full queue or a pinned host tier)", labels=("role",))
        for t in TIERS:
            blocks.add_metric((self.role, t), s.blocks.get(t, 0) if s else 0)
        for t in LOWER:
            hits.add_metric((self.role, t), s.hits.get(t, 0) if s else 0)
            for d in DIRECTIONS:
                nbytes.add_metric((self.role, t, d), s.bytes.get((t, d), 0) if s else 0)
                secs.add_metric((self.role, t, d), s.seconds.get((t, d), 0.0) if s else 0.0)
        dropped.add_metric((self.role,), s.dropped if s else 0)
        return [blocks, hits, nbytes, secs, dropped]
