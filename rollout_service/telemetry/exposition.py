"""One ``/metrics`` page per process: the engine's series beside the service's.

vLLM registers its ``vllm:*`` series in prometheus_client's process-wide
registry; this service registers its ``rollout_*`` series in a registry of its
own (one per engine, so tests can build several). :func:`combined_registry` is
the one place the two meet: the standalone ``GET /metrics`` and each Ray Serve
replica's metrics server both expose it, with names unchanged.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import REGISTRY, CollectorRegistry, start_http_server
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector


class _Registries(Collector):
    """Collects several registries as one."""

    def __init__(self, *registries: CollectorRegistry) -> None:
        self._registries = registries

    def collect(self) -> Iterator[Metric]:
        for registry in self._registries:
            yield from registry.collect()


def combined_registry(service_registry: CollectorRegistry) -> CollectorRegistry:
    """A registry collecting the process-wide one (the engine's series) and
    ``service_registry`` (this service's)."""
    combined = CollectorRegistry(auto_describe=False)
    combined.register(_Registries(REGISTRY, service_registry))
    return combined


def serve_metrics(service_registry: CollectorRegistry, host: str) -> int:
    """Serve the combined registry at ``http://host:<port>/metrics`` on a free port
    (a daemon thread); returns the port."""
    server, _ = start_http_server(0, addr=host, registry=combined_registry(service_registry))
    return server.server_port
