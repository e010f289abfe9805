"""The front end's /metrics: its own routing counters, then every replica's metrics with a
`replica` label (one family per metric name, the replicas' samples side by side)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample


class FrontendMetrics:
    """Routing metrics, in a registry of the front end's own."""

    def __init__(self):
        self.registry = r = CollectorRegistry()
        self.up = Gauge("deepinfer_dp_replica_up", "1 while a data-parallel replica is routed requests",
                        ["replica"], registry=r)
        self.in_flight = Gauge("deepinfer_dp_requests_in_flight", "Requests proxied to a replica, not yet done",
                               ["replica"], registry=r)
        self.routed = Counter("deepinfer_dp_requests_routed", "Requests routed to a replica, by why it was "
                              "chosen (prefix, least-load, random)", ["replica", "reason"], registry=r)
        self.matched_blocks = Counter("deepinfer_dp_routing_matched_blocks", "Prompt blocks whose prefix was "
                                      "routed to the chosen replica before", registry=r)
        self.failed = Counter("deepinfer_dp_requests_failed", "Requests whose replica failed before answering "
                              "in full", ["replica"], registry=r)


def relabeled(text: str, rank: int) -> list[Metric]:
    """A replica's Prometheus text as metric families whose samples carry replica="rank"."""
    families = []
    for family in text_string_to_metric_families(text):
        copy = Metric(family.name, family.documentation, family.type, family.unit)
        copy.samples = [Sample(s.name, {"replica": str(rank), **s.labels}, s.value, s.timestamp, s.exemplar)
                        for s in family.samples]
        families.append(copy)
    return families


class _Families:
    def __init__(self, families: list[Metric]):
        self.families = families

    def collect(self):
        return iter(self.families)


def merged_text(own: CollectorRegistry, replica_texts: dict[int, str]) -> bytes:
    """The front end's metrics, then the replicas' families merged by name (rank order)."""
    by_name: dict[str, Metric] = {}
    for rank in sorted(replica_texts):
        for family in relabeled(replica_texts[rank], rank):
            if family.name in by_name:
                by_name[family.name].samples.extend(family.samples)
            else:
                by_name[family.name] = family
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Families(list(by_name.values())))
    return generate_latest(own) + generate_latest(registry)
