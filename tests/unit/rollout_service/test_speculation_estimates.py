"""The speculation controller's inputs: the acceptance estimator and the step-cost table."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
from hypothesis import given
from hypothesis import strategies as st

from rollout_service.protocol.acceptance import SpecDecodeStats
from rollout_service.speculation.acceptance import (
    AcceptanceConfig,
    AcceptanceEstimator,
    Observed,
    WeightVersions,
)
from rollout_service.speculation.cost import (
    CostConfig,
    StepCostMedians,
    StepCostSample,
    StepCostTable,
    batch_size_band,
    nondecreasing_fit,
)
from tests.support.spec_controller import chain_stats as rounded_chain
from tests.support.spec_stats import chain_steps, vllm_chain, vllm_stats

CONFIG = AcceptanceConfig()


def chain_stats(num_drafts: int, rates: Sequence[float]) -> SpecDecodeStats:
    """:func:`tests.support.spec_controller.chain_stats`, each count rounded to nearest."""
    return rounded_chain(num_drafts, rates, rounding=round)


def versions(draft: int, main: int | None = None) -> WeightVersions:
    return WeightVersions(main_version=draft if main is None else main, draft_version=draft)


def fed(rates: Sequence[float], *, num_sequences: int = 30, num_drafts: int = 200,
        num_positions: int = 3) -> AcceptanceEstimator:
    estimator = AcceptanceEstimator(CONFIG, num_positions=num_positions)
    for _ in range(num_sequences):
        estimator.observe(chain_stats(num_drafts, rates), versions(0))
    return estimator


# ---- acceptance ------------------------------------------------------------------------


def test_conditional_rates_are_recovered() -> None:
    rates = fed((0.8, 0.5, 0.25)).rates()
    assert rates == pytest.approx((0.8, 0.5, 0.25), abs=0.01)


def test_nothing_observed_means_no_acceptance() -> None:
    assert AcceptanceEstimator(CONFIG, num_positions=3).rates() == (0.0, 0.0, 0.0)


def test_unobserved_positions_extrapolate_downward() -> None:
    """Only K = 1 ran: deeper positions decay geometrically from the last observed one."""
    p0, p1, p2 = fed((0.7,)).rates()
    assert p0 == pytest.approx(0.7, abs=0.01)
    assert p1 == pytest.approx(p0 * CONFIG.extrapolation_factor)
    assert p2 == pytest.approx(p1 * CONFIG.extrapolation_factor)


def test_positions_a_smaller_k_never_drafted_are_not_counted_as_rejected() -> None:
    """vLLM reports k_max + 1 histogram buckets whatever K ran: a sequence at K = 1 of a
    drafter accepted at 0.9 everywhere must not teach ``[0.9, 0, 0]`` (the controller
    would never choose K >= 2); positions 1 and 2 stay extrapolated from position 0."""
    estimator = AcceptanceEstimator(CONFIG, num_positions=3)
    for _ in range(20):
        stats = vllm_chain(200, (0.9, 0.9, 0.9), k=1, k_max=3)
        assert stats.accepted_per_position == (180, 0, 0)  # vLLM's shape
        estimator.observe(stats, versions(0))
    p0, p1, p2 = estimator.rates()
    assert p0 == pytest.approx(0.9, abs=0.01)
    assert (p1, p2) == pytest.approx((p0 * 0.8, p0 * 0.8 ** 2), abs=0.01)
    assert estimator.estimate().evidence_drafts[1:] == (0.0, 0.0)


def test_each_steps_counts_measure_every_position_whatever_k_each_step_ran() -> None:
    """Under the controller K changes within a sequence: with vLLM's per-step counts
    (``detailed``) every position is measured exactly; from the histogram alone a
    sequence of mixed K is counted at position 0 only, never biased."""
    steps = [(3, j) for j in chain_steps(300, (0.9, 0.8, 0.7))] + \
            [(1, j) for j in chain_steps(200, (0.9,))]
    detailed = AcceptanceEstimator(CONFIG, num_positions=3)
    summary = AcceptanceEstimator(CONFIG, num_positions=3)
    for _ in range(20):
        detailed.observe(vllm_stats(steps, k_max=3, detailed=True), versions(0))
        summary.observe(vllm_stats(steps, k_max=3), versions(0))
    assert detailed.rates() == pytest.approx((0.9, 0.8, 0.7), abs=0.01)
    assert summary.rates()[0] == pytest.approx(0.9, abs=0.01)
    assert summary.estimate().evidence_drafts[1:] == (0.0, 0.0)


def test_per_step_counts_that_disagree_with_the_histogram_are_refused() -> None:
    with pytest.raises(ValueError, match="per-step counts disagree"):
        SpecDecodeStats.from_histogram([1, 1, 0, 0], 2, steps=[(1, 1), (1, 1)])
    with pytest.raises(ValueError, match="reached_per_position"):
        SpecDecodeStats(num_drafts=2, num_draft_tokens=4, num_accepted_tokens=2,
                        num_verify_steps=2, accepted_per_position=(1, 1),
                        reached_per_position=(2, 2))


def test_a_draft_whose_every_token_a_grammar_invalidated_reaches_no_position() -> None:
    """vLLM subtracts grammar-invalidated drafts from a step's proposed count and still
    counts the step: one left with none proposed 0 and accepted 0 (structured outputs)."""
    steps = [(0, 0)] + [(3, j) for j in chain_steps(20, (1.0, 0.5, 0.0))]
    stats = vllm_stats(steps, k_max=3, detailed=True)
    assert (stats.num_drafts, stats.drafts_per_k, stats.reached_per_position) == (
        21, (1, 0, 0, 20), (20, 20, 10))
    with_it, without = (AcceptanceEstimator(CONFIG, num_positions=3) for _ in range(2))
    with_it.observe(stats, versions(0))
    without.observe(vllm_stats(steps[1:], k_max=3, detailed=True), versions(0))
    assert with_it.estimate().evidence_drafts == (20.0, 20.0, 10.0)
    assert with_it.rates() == pytest.approx(without.rates(), rel=0.01)  # no evidence in it


def test_a_short_list_is_padded_with_rejections() -> None:
    """K = 3 drafted, nothing accepted past position 0: positions 1 and 2 were reached
    by the drafts accepting position 0 and rejected."""
    estimator = AcceptanceEstimator(CONFIG, num_positions=3)
    stats = SpecDecodeStats(num_drafts=100, num_draft_tokens=300, num_accepted_tokens=60,
                            num_verify_steps=100, accepted_per_position=(60,))
    estimator.observe(stats, versions(0))
    assert estimator.estimate().evidence_drafts == (100.0, 60.0, 0.0)
    assert estimator.rates()[1] < 0.05  # 0 accepted of 60 reached, shrunk toward 0.8 * p0


def test_from_histogram_stats_are_counted() -> None:
    estimator = AcceptanceEstimator(CONFIG, num_positions=2)
    estimator.observe(SpecDecodeStats.from_histogram([25, 25, 50], num_draft_tokens=200),
                      versions(0))
    assert estimator.estimate().evidence_drafts == (100.0, 75.0)


def test_sequences_without_per_position_counts_are_not_counted() -> None:
    estimator = AcceptanceEstimator(CONFIG, num_positions=2)
    stats = SpecDecodeStats(num_drafts=10, num_draft_tokens=20, num_accepted_tokens=5,
                            num_verify_steps=10)
    assert estimator.observe(stats, versions(0)) is Observed.NEW_DRAFTER
    assert estimator.observe(None, versions(0)) is Observed.COUNTED
    assert estimator.num_epoch_drafts == 0


def test_counts_that_are_not_a_prefix_are_refused() -> None:
    estimator = AcceptanceEstimator(CONFIG, num_positions=2)
    growing = SpecDecodeStats(num_drafts=10, num_draft_tokens=20, num_accepted_tokens=9,
                              num_verify_steps=10, accepted_per_position=(3, 6))
    with pytest.raises(ValueError, match="prefix|grow"):
        estimator.observe(growing, versions(0))


def test_a_refused_first_sequence_of_a_new_drafter_leaves_its_epoch_to_the_next() -> None:
    """The caller learns of the new drafter (and restarts its probe) from the sequence that
    is counted, not from one that raised."""
    estimator = fed((0.7,), num_positions=2)
    before = estimator.estimate()
    growing = SpecDecodeStats(num_drafts=2, num_draft_tokens=4, num_accepted_tokens=3,
                              num_verify_steps=2, accepted_per_position=(3, 0))
    with pytest.raises(ValueError, match="grow"):
        estimator.observe(growing, versions(1))
    assert estimator.estimate() == before
    assert estimator.observe(chain_stats(8, (0.3, 0.3)), versions(1)) is Observed.NEW_DRAFTER


def test_a_new_drafter_starts_from_the_old_estimate_and_converges() -> None:
    """After a push the estimate starts near the old rate and reaches the new one within
    prior_drafts * (1/f - 1) drafts (f: remaining share of the gap; 1/8 here: 448)."""
    estimator = fed((0.7,), num_positions=1)
    assert estimator.observe(chain_stats(8, (0.3,)), versions(1)) is Observed.NEW_DRAFTER
    assert estimator.rates()[0] == pytest.approx(0.7, abs=0.1)
    num_drafts = 8
    while num_drafts < CONFIG.prior_drafts * (8 - 1):
        estimator.observe(chain_stats(50, (0.3,)), versions(1))
        num_drafts += 50
    assert abs(estimator.rates()[0] - 0.3) <= 0.4 / 8 + 0.01


@given(st.floats(0.05, 0.95), st.floats(0.05, 0.95))
def test_the_prior_fades_within_the_documented_drafts(old: float, new: float) -> None:
    estimator = fed((old,), num_positions=1, num_sequences=20)
    for _ in range(12):  # 600 drafts > 64 * (8 - 1)
        estimator.observe(chain_stats(50, (new,)), versions(1))
    assert abs(estimator.rates()[0] - new) <= abs(old - new) / 8 + 0.02


def test_a_main_model_push_keeps_the_epoch() -> None:
    estimator = fed((0.7,))
    before = estimator.estimate()
    assert estimator.observe(None, versions(0, main=5)) is Observed.COUNTED
    assert estimator.estimate() == before


def test_observations_of_an_older_drafter_are_ignored() -> None:
    estimator = fed((0.7,))
    estimator.observe(None, versions(1))
    before = estimator.estimate()
    assert estimator.observe(chain_stats(200, (0.0,)), versions(0)) is Observed.STALE
    assert estimator.estimate() == before


@given(st.lists(st.tuples(st.integers(1, 300), st.lists(st.floats(0, 1), max_size=4),
                          st.integers(0, 3)), max_size=30))
def test_rates_stay_probabilities(stream: list[tuple[int, list[float], int]]) -> None:
    estimator = AcceptanceEstimator(CONFIG, num_positions=3)
    for num_drafts, rates, draft_version in sorted(stream, key=lambda item: item[2]):
        estimator.observe(chain_stats(num_drafts, rates), versions(draft_version))
        assert all(0 <= p <= 1 for p in estimator.rates())


# ---- step cost -------------------------------------------------------------------------


def table(*samples: tuple[int, int, float]) -> StepCostTable:
    return StepCostTable(CostConfig(), [StepCostSample(k=k, batch_size=b, step_s=s)
                                        for k, b, s in samples])


def test_costs_interpolate_linearly_in_log_batch_size() -> None:
    costs = table((0, 1, 1.0), (0, 4, 3.0), (0, 16, 5.0))
    assert costs.step_s(0, 4) == 3.0
    assert costs.step_s(0, 2) == pytest.approx(2.0)
    assert costs.step_s(0, 8) == pytest.approx(4.0)


def test_no_cost_is_guessed_outside_the_measurements() -> None:
    costs = table((0, 2, 1.0), (0, 8, 2.0))
    with pytest.raises(ValueError, match="K=1"):
        costs.step_s(1, 4)
    with pytest.raises(ValueError, match="outside"):
        costs.step_s(0, 16)
    assert not costs.covers(0, 1) and costs.covers(0, 5)


def test_beyond_its_measurements_a_k_is_priced_at_its_nearest_ratio_to_k0() -> None:
    """Where K = 0 is measured and K is not, c(K, B) = c(0, B) * c(K, B') / c(0, B') at
    the nearest batch size B' measured for both; nothing where K = 0 is not measured."""
    costs = table((0, 1, 0.010), (0, 32, 0.020), (0, 64, 0.040),
                  (2, 1, 0.012), (2, 32, 0.030), (3, 128, 0.1))
    assert costs.estimate_s(2, 32) == costs.step_s(2, 32) == 0.030  # measured
    assert costs.estimate_s(2, 64) == pytest.approx(0.040 * 0.030 / 0.020)  # held from 32
    assert costs.estimate_s(0, 64) == 0.040
    assert costs.estimate_s(2, 128) is None  # K = 0 not measured there
    assert costs.estimate_s(3, 64) is None  # K = 3 and K = 0 share no measured range
    assert costs.estimate_s(1, 32) is None  # K = 1 never measured
    assert costs.estimate_s(2, 64, reach_from=32) == costs.estimate_s(2, 64)
    assert costs.estimate_s(2, 64, reach_from=33) is None  # 32 is too far below
    with pytest.raises(ValueError, match="outside"):
        costs.step_s(2, 64)  # the table itself still guesses nothing


def test_a_sequences_verify_steps_are_priced_at_the_k_each_ran() -> None:
    """c(K, B) / c(0, B) per verify step, at the K vLLM's per-step counts say it ran;
    nothing is guessed where the table has no measurement."""
    costs = table((0, 1, 0.010), (0, 4, 0.020), (1, 1, 0.012), (1, 4, 0.026),
                  (2, 1, 0.016), (2, 4, 0.030))
    mixed = vllm_stats([(1, 1)] * 10 + [(2, 1)] * 30, k_max=2, detailed=True)
    assert costs.verify_cost_ratio(mixed.drafts_per_k, 1) == pytest.approx(
        (10 * 1.2 + 30 * 1.6) / 40)
    assert costs.verify_cost_ratio(mixed.drafts_per_k, 2) == pytest.approx(
        (10 * (1.2 + 1.3) / 2 + 30 * (1.6 + 1.5) / 2) / 40)  # the pairs at 1 and 4, within 2x
    assert costs.verify_cost_ratio(mixed.drafts_per_k, 8) is None  # beyond B = 4
    at_k1 = vllm_chain(20, [0.5], k=1, k_max=2, detailed=True)
    assert table((0, 1, 0.01), (1, 1, 0.012)).verify_cost_ratio(
        at_k1.drafts_per_k, 1) == pytest.approx(1.2)
    assert table((1, 1, 0.012), (2, 1, 0.016)).verify_cost_ratio(
        at_k1.drafts_per_k, 1) is None  # no K = 0 to compare with
    assert table((0, 1, 0.01)).verify_cost_ratio(at_k1.drafts_per_k, 1) is None
    assert costs.verify_cost_ratio((), 1) is None  # no per-step counts
    assert costs.verify_cost_ratio((0, 0, 0), 1) is None  # no drafts


def test_new_samples_blend_in() -> None:
    costs = table((1, 8, 1.0))
    costs.record(StepCostSample(k=1, batch_size=8, step_s=2.0))
    assert costs.step_s(1, 8) == pytest.approx(1.25)
    costs.record(StepCostSample(k=1, batch_size=4, step_s=0.5))
    assert [(p.batch_size, p.step_s, p.num_samples, p.last_step_s)
            for p in costs.points()[1]] == [(4, 0.5, 1, 0.5), (8, 1.25, 2, 2.0)]


def test_bad_samples_are_refused() -> None:
    with pytest.raises(ValueError, match="step_s"):
        StepCostSample(k=0, batch_size=1, step_s=0.0)


@given(st.lists(st.tuples(st.integers(1, 1024), st.floats(0.001, 10)), min_size=2,
                max_size=8, unique_by=lambda p: p[0]),
       st.integers(1, 1024), st.integers(1, 1024))
def test_interpolation_keeps_a_monotone_curve_monotone(
        points: list[tuple[int, float]], b1: int, b2: int) -> None:
    batch_sizes = sorted(b for b, _ in points)
    step_s = sorted(s for _, s in points)
    costs = table(*((0, b, s) for b, s in zip(batch_sizes, step_s)))
    low, high = sorted((b1, b2))
    if costs.covers(0, low) and costs.covers(0, high):
        assert costs.step_s(0, low) <= costs.step_s(0, high) * (1 + 1e-12)
        assert step_s[0] * (1 - 1e-12) <= costs.step_s(0, low) <= step_s[-1] * (1 + 1e-12)


def test_a_cost_that_falls_as_the_batch_grows_is_pooled_with_its_neighbour() -> None:
    """More sequences cannot make a step cheaper: a falling point is noise, and the table
    prices both points at their mean (the H100 measured c(0, 2) = 3.7 ms, c(0, 3) = 2.4)."""
    costs = table((0, 1, 3.0), (0, 2, 3.7), (0, 3, 2.4), (0, 8, 4.0))
    assert costs.step_s(0, 1) == 3.0 and costs.step_s(0, 8) == 4.0
    assert costs.step_s(0, 2) == costs.step_s(0, 3) == pytest.approx(3.05)
    assert [p.step_s for p in costs.points()[0]] == [3.0, 3.7, 2.4, 4.0]  # as measured
    costs.record(StepCostSample(k=0, batch_size=3, step_s=4.6))  # blends to 2.95: still low
    assert costs.step_s(0, 2) == pytest.approx((3.7 + 0.75 * 2.4 + 0.25 * 4.6) / 2)


@given(st.lists(st.floats(0.001, 10), min_size=1, max_size=12))
def test_the_fit_is_nondecreasing_keeps_the_mean_and_leaves_a_rising_curve(
        values: list[float]) -> None:
    fitted = nondecreasing_fit(values)
    assert len(fitted) == len(values)
    assert all(a <= b * (1 + 1e-12) for a, b in zip(fitted, fitted[1:]))
    assert sum(fitted) == pytest.approx(sum(values))
    assert nondecreasing_fit(sorted(values)) == sorted(values)


@given(st.lists(st.tuples(st.integers(1, 1024), st.floats(0.001, 10)), min_size=2,
                max_size=8, unique_by=lambda p: p[0]),
       st.integers(1, 1024), st.integers(1, 1024))
def test_any_measured_points_price_steps_nondecreasing_in_the_batch_size(
        points: list[tuple[int, float]], b1: int, b2: int) -> None:
    costs = table(*((0, b, s) for b, s in points))
    low, high = sorted((b1, b2))
    if costs.covers(0, low) and costs.covers(0, high):
        assert costs.step_s(0, low) <= costs.step_s(0, high) * (1 + 1e-12)


def test_steps_fold_into_one_median_sample_per_run_of_each_k_and_batch_size() -> None:
    """Single steps are noisy (one hiccup, one pause between steps): a run's median is not."""
    medians = StepCostMedians(num_steps=3)
    folded = [medians.add(StepCostSample(k=k, batch_size=b, step_s=s)) for k, b, s in [
        (1, 4, 0.020), (2, 4, 0.030), (1, 4, 5.0), (1, 4, 0.022),  # 5 s: a pause
        (1, 4, 0.021)]]
    assert folded[:3] == [None, None, None]
    assert folded[3] == StepCostSample(k=1, batch_size=4, step_s=0.022)
    assert folded[4] is None  # a new run of (1, 4) has begun
    with pytest.raises(ValueError, match="num_steps"):
        StepCostMedians(num_steps=0)


def test_a_decaying_batch_folds_by_band_at_its_median_batch_size() -> None:
    """A rollout loses requests nearly every step: steps at 103, 100 and 97 requests fold
    into one sample; the small batch sizes keep a band each."""
    medians = StepCostMedians(num_steps=3)
    folded = [medians.add(StepCostSample(k=0, batch_size=b, step_s=s)) for b, s in [
        (103, 0.031), (4, 0.010), (100, 0.030), (5, 0.011), (97, 0.029), (4, 0.010),
        (5, 0.011), (4, 0.010)]]
    assert folded[4] == StepCostSample(k=0, batch_size=100, step_s=0.030)
    assert folded[7] == StepCostSample(k=0, batch_size=4, step_s=0.010)
    assert [f for i, f in enumerate(folded) if i not in (4, 7)] == [None] * 6
    assert [batch_size_band(b) for b in (1, 2, 3, 4, 5)] == [0, 4, 6, 8, 9]


def test_the_engine_adapter_passes_vllms_per_step_counts_on() -> None:
    """What the service receives from vLLM at the ``detailed`` level (the controlled
    engine's): the drafts that reached each position, whatever K each step ran."""
    from vllm.v1.metrics.stats import RequestSpecDecodeMetrics

    from rollout_service.engines.vllm.outputs import to_stats

    metrics = RequestSpecDecodeMetrics.new(3)
    for proposed, accepted in [(3, 3), (3, 1), (1, 1), (1, 0), (2, 2)]:
        metrics.observe(num_draft_tokens=proposed, num_accepted=accepted, detailed=True)
    stats = to_stats(metrics)
    assert isinstance(stats, SpecDecodeStats)
    assert stats.accepted_per_position == (4, 2, 1)
    assert stats.reached_per_position == (5, 3, 1)
    assert stats.drafts_per_k == (0, 2, 1, 2)  # the K of each step: what it cost
    summary = RequestSpecDecodeMetrics.new(3)
    summary.observe(num_draft_tokens=1, num_accepted=1)
    assert to_stats(summary).reached_per_position == ()  # type: ignore[union-attr]
