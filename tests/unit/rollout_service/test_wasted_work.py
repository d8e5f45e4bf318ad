"""Wasted work and the net speed-up of speculation: per sequence, per batch, exported."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry

from rollout_service.protocol.acceptance import SpecDecodeStats, summarize
from rollout_service.protocol.messages import SpecDecodeInfo
from rollout_service.service import to_spec_info
from rollout_service.telemetry.acceptance import SpecDecodeMetrics

LABELS = {"model": "m", "engine": "vllm"}


def stats(histogram: list[int], k: int, ratio: float | None) -> SpecDecodeStats:
    return SpecDecodeStats.from_histogram(histogram, num_draft_tokens=k * sum(histogram),
                                          verify_cost_ratio=ratio)


def test_rejected_tokens_and_net_speedup_of_one_sequence() -> None:
    # 4 steps of 2 drafts accepting 0, 1, 2, 2: 5 of 8 accepted, 9 tokens in 4 steps
    seq = stats([1, 1, 2], k=2, ratio=1.5)
    assert seq.num_rejected_tokens == 3
    assert seq.accept_length == pytest.approx(9 / 4)
    assert seq.net_speedup == pytest.approx(9 / 4 / 1.5)


def test_net_speedup_is_unknown_without_drafts_or_cost() -> None:
    assert stats([0, 0], k=1, ratio=2.0).net_speedup is None
    assert stats([1, 3], k=1, ratio=None).net_speedup is None


def test_a_cost_ratio_must_be_positive() -> None:
    with pytest.raises(ValueError, match="verify_cost_ratio"):
        stats([1, 1], k=1, ratio=0.0)


def test_batch_net_speedup_weighs_steps_at_their_own_cost() -> None:
    fast = stats([0, 4], k=1, ratio=1.0)  # 8 tokens in 4 steps at cost 1
    slow = stats([4, 0], k=1, ratio=2.0)  # 4 tokens in 4 steps at cost 2
    unknown = stats([0, 9], k=1, ratio=None)
    summary = summarize([fast, slow, unknown, None])
    assert summary.net_speedup == pytest.approx((8 + 4) / (4 * 1.0 + 4 * 2.0))
    assert summary.num_rejected_tokens == 0 + 4 + 0
    assert summarize([unknown]).net_speedup is None


@given(st.lists(st.lists(st.integers(0, 30), min_size=3, max_size=3), min_size=1,
                max_size=10), st.floats(0.5, 4.0))
def test_one_ratio_gives_micro_accept_length_over_it(histos: list[list[int]],
                                                     ratio: float) -> None:
    summary = summarize([stats(h, k=2, ratio=ratio) for h in histos])
    if summary.net_speedup is not None:
        assert summary.net_speedup == pytest.approx(summary.micro_accept_length / ratio)


def test_the_wire_carries_the_figures_and_gives_them_back() -> None:
    seq = stats([1, 2, 1], k=2, ratio=1.25)
    info = to_spec_info(seq)
    assert info is not None
    assert (info.num_rejected_tokens, info.net_speedup, info.verify_cost_ratio) == \
        (seq.num_rejected_tokens, seq.net_speedup, 1.25)
    again = SpecDecodeInfo.model_validate_json(info.model_dump_json()).to_stats()
    assert again == seq


def test_exporter_counts_rejected_tokens_and_exports_the_measured_ratio() -> None:
    registry = CollectorRegistry()
    exporter = SpecDecodeMetrics(registry=registry, num_speculative_tokens=2,
                                 verify_cost_ratio=1.75, **LABELS)
    for seq in (stats([1, 1, 2], k=2, ratio=1.75), stats([3, 0, 0], k=2, ratio=1.75)):
        exporter.observe(seq)
    assert registry.get_sample_value("rollout_spec_decode_rejected_tokens_total",
                                     {**LABELS, "category": "none"}) == 3 + 6
    assert registry.get_sample_value("rollout_spec_decode_verify_cost_ratio", LABELS) == 1.75


def test_exporter_without_a_measured_ratio_has_no_ratio_series() -> None:
    registry = CollectorRegistry()
    SpecDecodeMetrics(registry=registry, num_speculative_tokens=1, **LABELS)
    assert registry.get_sample_value("rollout_spec_decode_verify_cost_ratio", LABELS) is None
