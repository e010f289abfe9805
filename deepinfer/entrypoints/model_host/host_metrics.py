"""A model host's own Prometheus metrics, read from its runner pool when scraped."""

from __future__ import annotations

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

PREFIX = "deepinfer_host_"


class HostMetrics:
    """`registry()`: loaded models, their memory, loads and evictions, as the pool counts them."""

    content_type = CONTENT_TYPE_LATEST

    def __init__(self, pool):
        self.pool = pool
        self._registry = CollectorRegistry(auto_describe=False)
        self._registry.register(self)

    def registry(self) -> CollectorRegistry:
        return self._registry

    def collect(self):
        runners = [r for r in self.pool.loaded() if r.ready.is_set()]
        loaded = GaugeMetricFamily(PREFIX + "models_loaded", "Models loaded and answering")
        loaded.add_metric([], len(runners))
        memory = GaugeMetricFamily(PREFIX + "model_memory_bytes", "Resident bytes of each loaded model's process",
                                   labels=["model"])
        for runner in runners:
            memory.add_metric([runner.name], runner.memory())
        loads = CounterMetricFamily(PREFIX + "model_loads", "Models started on a request")
        loads.add_metric([], self.pool.loads)
        evictions = CounterMetricFamily(PREFIX + "model_evictions", "Idle models unloaded to make room")
        evictions.add_metric([], self.pool.evictions)
        return iter([loaded, memory, loads, evictions])
