"""The schedule's Prometheus series (``telemetry/speculation.py``): whatever sequence of
states the controller shows, the gauges hold the last one (the exporter writes only what
changed), and unknown buckets or reasons are refused with the gauges as they were."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry

from rollout_service.telemetry.speculation import SpeculationMetrics

BUCKETS = (1, 8, 64)
REASONS = ("best", "hold", "pinned")
LABELS = {"model": "m", "engine": "fake"}


def metrics() -> tuple[SpeculationMetrics, CollectorRegistry]:
    registry = CollectorRegistry()
    return SpeculationMetrics(registry=registry, model="m", engine="fake", buckets=BUCKETS,
                              reasons=REASONS), registry


def shown(registry: CollectorRegistry) -> tuple[dict[int, float | None], dict[int, set[str]]]:
    """Per bucket, the K gauge and the reasons whose gauge reads 1."""
    k = {b: registry.get_sample_value("rollout_speculation_k", {**LABELS, "bucket": str(b)})
         for b in BUCKETS}
    on = {b: {r for r in REASONS if registry.get_sample_value(
        "rollout_speculation_reason", {**LABELS, "bucket": str(b), "reason": r}) == 1}
        for b in BUCKETS}
    return k, on


states = st.lists(st.tuples(st.dictionaries(st.sampled_from(BUCKETS), st.integers(0, 3)),
                            st.dictionaries(st.sampled_from(BUCKETS), st.sampled_from(REASONS))),
                  min_size=1, max_size=12)


@given(states)
def test_the_gauges_hold_the_last_state_shown_per_bucket(
        sequence: list[tuple[dict[int, int], dict[int, str]]]) -> None:
    exporter, registry = metrics()
    last_k: dict[int, int] = {}
    last_reason: dict[int, str] = {}
    for k, reasons in sequence:
        exporter.set_buckets(k, reasons)
        last_k |= k
        last_reason |= reasons
        gauges, on = shown(registry)
        for bucket in BUCKETS:
            assert gauges[bucket] == last_k.get(bucket, 0)
            assert on[bucket] == ({last_reason[bucket]} if bucket in last_reason else set())


@pytest.mark.parametrize(("k", "reasons", "message"), [
    ({1: 3, 3: 1}, {}, "bucket 3"), ({8: 0}, {1: "best", 8: "guess"}, "reason 'guess'")])
def test_an_unknown_bucket_or_reason_is_refused(k: dict[int, int], reasons: dict[int, str],
                                                message: str) -> None:
    exporter, registry = metrics()
    exporter.set_buckets({1: 2}, {1: "hold"})
    before = shown(registry)
    with pytest.raises(ValueError, match=message):
        exporter.set_buckets(k, reasons)
    assert shown(registry) == before
