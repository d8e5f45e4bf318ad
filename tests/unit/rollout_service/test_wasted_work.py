"""Wasted work and the net speed-up of speculation: per sequence, per batch, exported."""

from __future__ import annotations

from dataclasses import replace

import pytest
from hypothesis import given
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry

from rollout_service.protocol.acceptance import SpecDecodeStats, summarize
from rollout_service.protocol.messages import SpecDecodeInfo
from rollout_service.service import to_spec_info
from rollout_service.telemetry.acceptance import SpecDecodeMetrics
from tests.support.spec_stats import vllm_chain, vllm_stats

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


def test_vllms_per_step_counts_say_how_many_drafts_ran_at_each_k() -> None:
    """The K of each verify step, which its cost depends on; vLLM's histogram alone has
    ``k_max + 1`` buckets whatever K ran and cannot say it."""
    steps = [(1, 1), (1, 0), (3, 2), (2, 2), (3, 0)]
    assert vllm_stats(steps, k_max=3, detailed=True).drafts_per_k == (0, 2, 1, 2)
    assert vllm_stats(steps, k_max=3).drafts_per_k == ()  # the summary level has no steps
    with pytest.raises(ValueError, match="drafts_per_k"):
        SpecDecodeStats(num_drafts=2, num_draft_tokens=3, num_accepted_tokens=1,
                        num_verify_steps=2, drafts_per_k=(0, 2, 0))  # 2 tokens, not 3


def test_exporter_weighs_each_verify_step_at_its_sequences_ratio() -> None:
    """The net speed-up's series: a sequence the controller ran at K = 1 (ratio 1.2) and
    one at K = 2 (ratio 1.6) divide as the batch summary does; one without a ratio, and
    one without drafts, count in neither side. A gauge of one ratio could not say this."""
    registry = CollectorRegistry()
    exporter = SpecDecodeMetrics(registry=registry, num_speculative_tokens=2,
                                 verify_cost_ratio=1.9, **LABELS)
    at_k1 = replace(vllm_chain(40, [0.5], k=1, k_max=2, detailed=True), verify_cost_ratio=1.2)
    at_k2 = replace(vllm_chain(10, [0.8, 0.5], k=2, k_max=2, detailed=True),
                    verify_cost_ratio=1.6)
    unknown = vllm_chain(30, [0.9], k=1, k_max=2, detailed=True)
    no_drafts = replace(vllm_chain(0, [], k=0, k_max=2), verify_cost_ratio=1.9)
    for seq in (at_k1, at_k2, unknown, no_drafts):
        exporter.observe(seq)

    def value(name: str) -> float | None:
        return registry.get_sample_value(name, {**LABELS, "category": "none"})

    assert value("rollout_spec_decode_costed_drafts_total") == 40 + 10
    assert value("rollout_spec_decode_costed_tokens_total") == (40 + 20) + (10 + 12)
    assert value("rollout_spec_decode_verify_cost_total") == pytest.approx(40 * 1.2 + 10 * 1.6)
    net = value("rollout_spec_decode_costed_tokens_total") / value(  # type: ignore[operator]
        "rollout_spec_decode_verify_cost_total")
    assert net == pytest.approx(summarize([at_k1, at_k2, unknown, no_drafts]).net_speedup)
