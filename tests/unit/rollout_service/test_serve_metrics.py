"""The Ray Serve ingress's merged ``/metrics`` (``serve/metrics.py``), without Ray."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from rollout_service.serve.metrics import merge_pages
from rollout_service.tools.scrape import sample_sum


def page(requests: int, rates: list[float]) -> str:
    registry = CollectorRegistry()
    counter = Counter("rollout_requests", "Finished sequences.", ["model"], registry=registry)
    counter.labels(model="m").inc(requests)
    histogram = Histogram("rollout_spec_decode_request_accept_rate", "Per-request rate.",
                          ["model"], buckets=(0.5, 1.0), registry=registry)
    for rate in rates:
        histogram.labels(model="m").observe(rate)
    return generate_latest(registry).decode()


def test_merged_page_keeps_every_replica_apart_and_sums_exactly() -> None:
    merged = merge_pages({"r1": page(3, [0.2, 0.4]), "r2": page(5, [0.9])}).decode()
    families = {f.name: f for f in text_string_to_metric_families(merged)}
    assert families["rollout_requests"].type == "counter"  # one family, two samples
    assert {s.labels["replica"] for s in families["rollout_requests"].samples} == {"r1", "r2"}
    assert sample_sum(merged, "rollout_requests_total") == 8
    assert sample_sum(merged, "rollout_requests_total", replica="r2") == 5
    assert sample_sum(merged, "rollout_spec_decode_request_accept_rate_count") == 3
    assert sample_sum(merged, "rollout_spec_decode_request_accept_rate_sum") == \
        sample_sum(merged, "rollout_spec_decode_request_accept_rate_sum", replica="r1") + 0.9
    assert merged.count("# TYPE rollout_requests_total counter") == 1
    assert "/metrics/targets" in merged  # the pointer to per-replica scraping


def test_no_replica_is_an_empty_but_valid_page() -> None:
    merged = merge_pages({}).decode()
    assert list(text_string_to_metric_families(merged)) == []
