"""The front end's /metrics: its own routing counters, then every replica's metrics with a
`replica` label (one family per metric name, the replicas' samples side by side).

Only replicas that registered (a local child with its secret, any other with the cluster secret)
are asked. What one sends is read defensively: at most MAX_METRICS_BYTES of text and MAX_SAMPLES
samples, parsed as Prometheus text, its own `replica` label overwritten, no family under the front
end's own `deepinfer_dp_` names; an answer that breaks any of this is skipped whole and counted
(`deepinfer_dp_replica_metrics_rejected_total{replica, reason}`), and the other replicas' metrics
are served as usual.
"""

from __future__ import annotations

import logging

from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

MAX_METRICS_BYTES = 4 << 20  # one replica's /metrics text (a replica's own is ~100 KiB)
MAX_SAMPLES = 50_000  # samples of one replica
OWN_PREFIX = "deepinfer_dp_"

logger = logging.getLogger("deepinfer.server")


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
        self.metrics_rejected = Counter("deepinfer_dp_replica_metrics_rejected", "Replica /metrics answers "
                                        "left out (too large, too many samples, not Prometheus text)",
                                        ["replica", "reason"], registry=r)
        self.health_rounds = Counter("deepinfer_dp_health_check_rounds", "Rounds of replica health checks",
                                     registry=r)
        self.health_task_restarts = Counter("deepinfer_dp_health_task_restarts", "Times the health-check task "
                                            "failed (its traceback logged) and was started again", registry=r)


class Rejected(ValueError):
    """A replica's metrics text left out; `reason` is the label it is counted under."""

    def __init__(self, reason: str, detail: str):
        super().__init__(detail)
        self.reason = reason


def relabeled(text: str, rank: int | str, label: str = "replica") -> list[Metric]:
    """A replica's Prometheus text as metric families whose samples carry replica="rank" (a model host's
    children: model="name"; see the module docstring). Rejected when the text is not acceptable."""
    families, num_samples = [], 0
    try:
        for family in text_string_to_metric_families(text):
            num_samples += len(family.samples)
            if num_samples > MAX_SAMPLES:
                raise Rejected("too_many_samples", f"more than {MAX_SAMPLES} samples")
            if family.name.startswith(OWN_PREFIX):
                continue  # the front end's own names are its own
            copy = Metric(family.name, family.documentation, family.type, family.unit)
            copy.samples = [Sample(s.name, {**s.labels, label: str(rank)}, s.value, s.timestamp, s.exemplar)
                            for s in family.samples]
            families.append(copy)
        generate_latest(_registry(families))  # what cannot be written out again is refused here
    except Rejected:
        raise
    except Exception as exc:  # the parser's and the writer's errors alike: garbage is garbage
        raise Rejected("unreadable", f"not Prometheus text ({type(exc).__name__}: {exc})"[:200]) from None
    return families


def replica_families(replica_texts: dict, label: str = "replica") -> tuple[list[Metric], dict]:
    """The replicas' families merged by name (rank order), and the replicas whose text was left out,
    with why."""
    by_name: dict[str, Metric] = {}
    rejected: dict[int, Rejected] = {}
    for rank in sorted(replica_texts):
        try:
            families = relabeled(replica_texts[rank], rank, label)
        except Rejected as exc:
            rejected[rank] = exc
            continue
        for family in families:
            if family.name in by_name:
                by_name[family.name].samples.extend(family.samples)
            else:
                by_name[family.name] = family
    return list(by_name.values()), rejected


def merged_text(own: CollectorRegistry, families: list[Metric]) -> bytes:
    """The front end's metrics, then the replicas' `families` (`replica_families`)."""
    try:
        merged = generate_latest(_registry(families))
    except Exception:  # families that were fine alone but not together (unexpected): serve our own
        logger.exception("the replicas' metrics could not be merged; serving the front end's own")
        merged = b""
    return generate_latest(own) + merged


def _registry(families: list[Metric]) -> CollectorRegistry:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Families(families))
    return registry


class _Families:
    def __init__(self, families: list[Metric]):
        self.families = families

    def collect(self):
        return iter(self.families)
