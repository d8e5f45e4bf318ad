"""The Ray Serve ingress's ``/metrics``: every live engine replica's series in one page.

Runs in the ingress replica. Each engine replica serves its own ``/metrics`` and
Prometheus is meant to find them through ``GET /metrics/targets`` (HTTP service
discovery: one ``instance`` per replica, restarts visible as new instances). A
user who points Prometheus at the Serve endpoint instead still gets every
``vllm:*`` and ``rollout_*`` series here, each labelled with its ``replica``, so
``sum(...)`` over them aggregates exactly as over the discovered targets. Scrape
one or the other, never both (every count would be doubled).
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable, Iterator, Mapping

import httpx
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import Collector
from prometheus_client.samples import Sample

POINTER = (b"# Aggregated from every engine replica's /metrics (label 'replica').\n"
           b"# For one Prometheus target per replica use GET /metrics/targets (http_sd).\n")


class _Families(Collector):
    def __init__(self, families: Iterable[Metric]) -> None:
        self._families = list(families)

    def collect(self) -> Iterator[Metric]:
        yield from self._families


def merge_pages(pages: Mapping[str, str], label: str = "replica") -> bytes:
    """One exposition page holding every page's samples, each with ``label`` set to
    its page's key; families of the same name are merged into one."""
    merged: dict[str, Metric] = {}
    for key, text in pages.items():
        for family in text_string_to_metric_families(text):
            target = merged.get(family.name)
            if target is None:
                target = merged[family.name] = Metric(family.name, family.documentation,
                                                      family.type, family.unit)
            target.samples += [Sample(s.name, {**s.labels, label: key}, s.value, s.timestamp,
                                      s.exemplar) for s in family.samples]
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Families(merged.values()))
    return POINTER + generate_latest(registry)


async def fetch_pages(targets: list[dict[str, object]], timeout_s: float = 10.0
                      ) -> dict[str, str]:
    """Each HTTP-SD target's ``/metrics`` text, by its ``replica`` label; a replica
    that does not answer is left out (it is also missing from ``/metrics/targets``
    once the coordinator declares it gone)."""
    async with httpx.AsyncClient(timeout=timeout_s) as http:

        async def one(group: dict[str, object]) -> tuple[str, str | None]:
            address = group["targets"][0]  # type: ignore[index]
            replica = str(group["labels"]["replica"])  # type: ignore[index]
            try:
                response = await http.get(f"http://{address}/metrics")
                return replica, response.text if response.is_success else None
            except httpx.TransportError:
                return replica, None

        found = await asyncio.gather(*(one(group) for group in targets))
    return {replica: text for replica, text in found if text is not None}
