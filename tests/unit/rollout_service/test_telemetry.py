"""Telemetry definitions, the batch summary and the Prometheus exporters (no engine)."""

from __future__ import annotations

import dataclasses
import itertools
import logging
import math
from statistics import fmean

import pytest
from hypothesis import given
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry

from rollout_service.protocol.acceptance import (
    InvalidSpecDecodeStats,
    SpecDecodeStats,
    summarize,
)
from rollout_service.telemetry.acceptance import SpecDecodeMetrics
from rollout_service.telemetry.weights import PUSH_OUTCOMES, ROLES, WeightMetrics

LABELS = {"model": "m", "engine": "vllm"}


def stats_from(histogram: list[int], k: int) -> SpecDecodeStats:
    return SpecDecodeStats.from_histogram(histogram, num_draft_tokens=k * sum(histogram))


histograms = st.integers(1, 4).flatmap(
    lambda k: st.tuples(st.just(k), st.lists(st.integers(0, 50), min_size=k + 1,
                                             max_size=k + 1)))


def test_from_histogram_counts() -> None:
    # 3 steps accepting 0, 1 and 2 of 2 drafted tokens
    stats = stats_from([1, 1, 1], k=2)
    assert stats.num_drafts == stats.num_verify_steps == 3
    assert stats.num_draft_tokens == 6
    assert stats.num_accepted_tokens == 3
    assert stats.accepted_per_position == (2, 1)
    assert stats.accept_rate == pytest.approx(0.5)
    assert stats.accept_length == pytest.approx(2.0)


def test_no_speculation_has_length_one_and_no_rate() -> None:
    stats = stats_from([0, 0], k=1)
    assert stats.accept_rate is None
    assert stats.accept_length == 1.0  # verl would report 0


def test_inconsistent_counts_rejected() -> None:
    with pytest.raises(ValueError, match="num_accepted_tokens"):
        SpecDecodeStats(num_drafts=1, num_draft_tokens=1, num_accepted_tokens=2,
                        num_verify_steps=1)
    with pytest.raises(ValueError, match=">= 0"):
        SpecDecodeStats(num_drafts=-1, num_draft_tokens=0, num_accepted_tokens=0,
                        num_verify_steps=0)


def test_summary_macro_differs_from_micro() -> None:
    long_good = stats_from([0, 90], k=1)   # rate 1.0 over 90 tokens
    short_bad = stats_from([10, 0], k=1)   # rate 0.0 over 10 tokens
    summary = summarize([long_good, short_bad])
    assert summary.macro_accept_rate == pytest.approx(0.5)
    assert summary.micro_accept_rate == pytest.approx(0.9)
    assert summary.macro_accept_length == pytest.approx(1.5)
    assert summary.micro_accept_length == pytest.approx(1.9)


def test_summary_excludes_no_spec_from_rate_and_counts_missing() -> None:
    summary = summarize([stats_from([0, 4], k=1), stats_from([0, 0], k=1), None])
    assert summary.num_sequences == 3
    assert summary.num_with_speculation == 1
    assert summary.num_without_speculation == 1
    assert summary.num_missing_stats == 1
    assert summary.macro_accept_rate == pytest.approx(1.0)
    assert summary.macro_accept_length == pytest.approx((2.0 + 1.0) / 2)


def test_summary_of_nothing() -> None:
    summary = summarize([None])
    assert summary.macro_accept_rate is None and summary.macro_accept_length is None
    assert summary.micro_accept_rate is None and summary.micro_accept_length is None


@given(st.lists(histograms, min_size=1, max_size=20))
def test_summary_matches_plain_means(items: list[tuple[int, list[int]]]) -> None:
    stats = [stats_from(h, k) for k, h in items]
    summary = summarize(stats)
    rates = [sum(j * c for j, c in enumerate(h)) / (k * sum(h)) for k, h in items if sum(h)]
    lengths = [1 + sum(j * c for j, c in enumerate(h)) / sum(h) if sum(h) else 1.0
               for _, h in items]
    if rates:
        assert summary.macro_accept_rate == pytest.approx(sum(rates) / len(rates))
    else:
        assert summary.macro_accept_rate is None
    assert summary.macro_accept_length == pytest.approx(sum(lengths) / len(lengths))
    assert all(0.0 <= r <= 1.0 for r in summary.micro_accept_rate_per_position)
    # acceptance is a prefix: later positions are never accepted more often
    per_pos = summary.micro_accept_rate_per_position
    assert all(a >= b for a, b in itertools.pairwise(per_pos))


def metric(registry: CollectorRegistry, name: str, **labels: str) -> float:
    """A sample; acceptance series of requests without a category (label ``none``)."""
    category = {} if name.startswith("rollout_weight") else {"category": "none"}
    value = registry.get_sample_value(name, {**LABELS, **category, **labels})
    assert value is not None, name
    return value


@given(st.lists(st.lists(st.integers(0, 50), min_size=3, max_size=3), min_size=1,
                max_size=15))
def test_exporter_macro_equals_summary(histos: list[list[int]]) -> None:
    registry = CollectorRegistry()
    exporter = SpecDecodeMetrics(registry=registry, num_speculative_tokens=2, **LABELS)
    stats = [stats_from(h, k=2) for h in histos]
    for s in stats:
        exporter.observe(s)
    summary = summarize(stats)
    n_rate = metric(registry, "rollout_spec_decode_request_accept_rate_count")
    assert n_rate == summary.num_with_speculation
    if n_rate:
        macro = metric(registry, "rollout_spec_decode_request_accept_rate_sum") / n_rate
        assert macro == pytest.approx(summary.macro_accept_rate)
    length = (metric(registry, "rollout_spec_decode_request_accept_length_sum")
              / metric(registry, "rollout_spec_decode_request_accept_length_count"))
    assert length == pytest.approx(summary.macro_accept_length)
    accepted = metric(registry, "rollout_spec_decode_accepted_tokens_total")
    drafted = metric(registry, "rollout_spec_decode_draft_tokens_total")
    if drafted:
        assert accepted / drafted == pytest.approx(summary.micro_accept_rate)
    drafts = metric(registry, "rollout_spec_decode_drafts_total")
    for pos, rate in enumerate(summary.micro_accept_rate_per_position):
        per_pos = metric(registry, "rollout_spec_decode_accepted_per_position_total",
                         position=str(pos))
        assert per_pos / drafts == pytest.approx(rate)
    assert metric(registry, "rollout_spec_decode_no_spec_requests_total") == \
        summary.num_without_speculation


def test_exporter_series_exist_before_traffic() -> None:
    registry = CollectorRegistry()
    SpecDecodeMetrics(registry=registry, num_speculative_tokens=3, **LABELS)
    assert metric(registry, "rollout_requests_total") == 0
    for pos in range(3):
        assert metric(registry, "rollout_spec_decode_accepted_per_position_total",
                      position=str(pos)) == 0


def test_missing_stats_counted_and_warned_once(caplog: pytest.LogCaptureFixture) -> None:
    registry = CollectorRegistry()
    exporter = SpecDecodeMetrics(registry=registry, num_speculative_tokens=1, **LABELS)
    with caplog.at_level(logging.WARNING, logger="rollout_service.telemetry.acceptance"):
        exporter.observe(None)
        exporter.observe(None)
    assert metric(registry, "rollout_spec_decode_missing_stats_requests_total") == 2
    assert metric(registry, "rollout_requests_total") == 2
    assert metric(registry, "rollout_spec_decode_request_accept_length_count") == 0
    assert sum("no spec-decode stats" in r.message for r in caplog.records) == 1


def test_accept_length_buckets_cover_range() -> None:
    registry = CollectorRegistry()
    exporter = SpecDecodeMetrics(registry=registry, num_speculative_tokens=2, **LABELS)
    exporter.observe(stats_from([0, 0, 5], k=2))  # length 3.0 = k + 1
    le3 = metric(registry, "rollout_spec_decode_request_accept_length_bucket", le="3.0")
    assert le3 == 1
    assert math.isclose(metric(registry, "rollout_spec_decode_request_accept_length_sum"), 3.0)


def test_stats_with_more_positions_than_k_are_refused_whole() -> None:
    registry = CollectorRegistry()
    exporter = SpecDecodeMetrics(registry=registry, num_speculative_tokens=1, **LABELS)
    with pytest.raises(ValueError, match="draft positions"):
        exporter.observe(stats_from([0, 0, 5], k=2))
    assert metric(registry, "rollout_requests_total") == 0


def test_invalid_stats_counted_warned_once_and_left_out(
        caplog: pytest.LogCaptureFixture) -> None:
    registry = CollectorRegistry()
    exporter = SpecDecodeMetrics(registry=registry, num_speculative_tokens=1, **LABELS)
    with caplog.at_level(logging.WARNING, logger="rollout_service.telemetry.acceptance"):
        exporter.observe(InvalidSpecDecodeStats(detail="accepted 5 > drafted 3"))
        exporter.observe(InvalidSpecDecodeStats(detail="accepted 9 > drafted 1"))
        exporter.observe(stats_from([1, 1], k=1))
    assert metric(registry, "rollout_spec_decode_invalid_stats_requests_total") == 2
    assert metric(registry, "rollout_requests_total") == 3
    assert metric(registry, "rollout_spec_decode_missing_stats_requests_total") == 0
    assert metric(registry, "rollout_spec_decode_drafts_total") == 2
    assert metric(registry, "rollout_spec_decode_request_accept_length_count") == 1
    warnings = [r.getMessage() for r in caplog.records if "contradict" in r.getMessage()]
    assert len(warnings) == 1 and "accepted 5 > drafted 3" in warnings[0]


def test_speculation_off_counts_requests_not_missing_stats(
        caplog: pytest.LogCaptureFixture) -> None:
    registry = CollectorRegistry()
    exporter = SpecDecodeMetrics(registry=registry, num_speculative_tokens=0, **LABELS)
    with caplog.at_level(logging.WARNING, logger="rollout_service.telemetry.acceptance"):
        exporter.observe(None)
    assert metric(registry, "rollout_requests_total") == 1
    assert metric(registry, "rollout_spec_decode_missing_stats_requests_total") == 0
    assert not caplog.records


def test_per_position_divides_by_the_drafts_that_have_positions() -> None:
    """The audit's batch: with every draft as denominator it read 0.57 / 0.36."""
    with_positions = stats_from([2, 3, 5], k=2)  # 10 drafts, positions (8, 5)
    without = SpecDecodeStats(num_drafts=4, num_draft_tokens=8, num_accepted_tokens=3,
                              num_verify_steps=4)  # e.g. SGLang's inconsistent histogram
    assert with_positions.accepted_per_position == (8, 5)
    summary = summarize([with_positions, without])
    assert summary.micro_accept_rate_per_position == pytest.approx((0.8, 0.5))
    registry = CollectorRegistry()
    exporter = SpecDecodeMetrics(registry=registry, num_speculative_tokens=2, **LABELS)
    exporter.observe(with_positions)
    exporter.observe(without)
    assert metric(registry, "rollout_spec_decode_drafts_total") == 14
    position_drafts = metric(registry, "rollout_spec_decode_drafts_with_positions_total")
    assert position_drafts == 10
    for position, share in enumerate((0.8, 0.5)):
        assert metric(registry, "rollout_spec_decode_accepted_per_position_total",
                      position=str(position)) / position_drafts == pytest.approx(share)


@given(st.lists(st.tuples(st.lists(st.integers(0, 30), min_size=3, max_size=3), st.booleans()),
                min_size=1, max_size=15))
def test_per_position_over_requests_with_positions(items: list[tuple[list[int], bool]]) -> None:
    """Requests without per-position counts change no share: summary and exporter agree
    with the summary of the requests that have them."""
    stats = [stats_from(h, k=2) if keep else
             dataclasses.replace(stats_from(h, k=2), accepted_per_position=())
             for h, keep in items]
    summary = summarize(stats)
    alone = summarize([s for s in stats if s.has_per_position])
    assert summary.micro_accept_rate_per_position == \
        pytest.approx(alone.micro_accept_rate_per_position)
    registry = CollectorRegistry()
    exporter = SpecDecodeMetrics(registry=registry, num_speculative_tokens=2, **LABELS)
    for s in stats:
        exporter.observe(s)
    position_drafts = metric(registry, "rollout_spec_decode_drafts_with_positions_total")
    assert position_drafts == sum(s.num_drafts for s in stats if s.has_per_position)
    for position, share in enumerate(summary.micro_accept_rate_per_position):
        assert metric(registry, "rollout_spec_decode_accepted_per_position_total",
                      position=str(position)) / position_drafts == pytest.approx(share)


@given(st.lists(st.lists(st.integers(0, 20), min_size=2, max_size=2), min_size=1,
                max_size=15))
def test_verl_accept_rate_counts_requests_without_drafts_as_zero(
        histos: list[list[int]]) -> None:
    """verl's convention from the exported series: accept-rate _sum over every request
    with stats (the accept-length _count, = rate _count + requests without drafts)."""
    registry = CollectorRegistry()
    exporter = SpecDecodeMetrics(registry=registry, num_speculative_tokens=1, **LABELS)
    stats = [stats_from(h, k=1) for h in histos]
    for s in stats:
        exporter.observe(s)
    with_stats = metric(registry, "rollout_spec_decode_request_accept_length_count")
    assert with_stats == metric(registry, "rollout_spec_decode_request_accept_rate_count") + \
        metric(registry, "rollout_spec_decode_no_spec_requests_total")
    verl = metric(registry, "rollout_spec_decode_request_accept_rate_sum") / with_stats
    assert verl == pytest.approx(fmean(s.accept_rate or 0.0 for s in stats))


def test_weight_series_exist_before_the_first_push() -> None:
    registry = CollectorRegistry()
    WeightMetrics(registry=registry, **LABELS)
    for role in ROLES:
        assert metric(registry, "rollout_weight_version", role=role) == -1
    for outcome in PUSH_OUTCOMES:
        assert metric(registry, "rollout_weight_pushes_total", outcome=outcome) == 0
    assert metric(registry, "rollout_weight_push_bytes_total") == 0
    assert metric(registry, "rollout_weight_push_duration_seconds_count") == 0


def test_weight_metrics_record_versions_outcomes_and_pushes() -> None:
    registry = CollectorRegistry()
    weights = WeightMetrics(registry=registry, **LABELS)
    weights.set_version("main", 3)
    weights.set_version("draft", 2)
    weights.count_outcome("loaded")
    weights.count_outcome("loaded")
    weights.count_outcome("failed")
    weights.observe_push(1024, 0.3)
    assert metric(registry, "rollout_weight_version", role="main") == 3
    assert metric(registry, "rollout_weight_version", role="draft") == 2
    assert metric(registry, "rollout_weight_pushes_total", outcome="loaded") == 2
    assert metric(registry, "rollout_weight_pushes_total", outcome="failed") == 1
    assert metric(registry, "rollout_weight_push_bytes_total") == 1024
    assert metric(registry, "rollout_weight_push_duration_seconds_sum") == pytest.approx(0.3)
    assert metric(registry, "rollout_weight_push_duration_seconds_bucket", le="0.5") == 1


def test_weight_metrics_refuse_unknown_roles_and_outcomes() -> None:
    weights = WeightMetrics(registry=CollectorRegistry(), **LABELS)
    with pytest.raises(ValueError, match="role"):
        weights.set_version("drafter", 1)
    with pytest.raises(ValueError, match="outcome"):
        weights.count_outcome("timeout")
