"""The speculation controller's decisions: the throughput model, probes and buckets beyond
the calibration (pure Python, no engine; collapse and recovery:
``test_speculation_collapse.py``; the hysteresis: ``test_speculation_hysteresis.py``)."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rollout_service.speculation.controller import (
    ControllerConfig,
    SpeculationController,
    k_at,
)
from rollout_service.speculation.cost import CostConfig, StepCostSample, StepCostTable
from rollout_service.speculation.decision import (
    CollapseConfig,
    ProbeConfig,
    Reason,
    best_k,
    expected_tokens,
    throughputs,
)
from tests.support.spec_controller import (
    BROKEN,
    BUCKETS,
    CONFIRMATIONS,
    DEFAULTS,
    GOOD,
    K_MAX,
    MARGIN,
    bucket,
    controller,
    feed,
    observations_until,
    roofline_s,
    roofline_table,
)

# ---- the throughput model --------------------------------------------------------------


@given(st.lists(st.floats(0, 1), min_size=1, max_size=8))
def test_expected_tokens_start_at_one_and_grow_with_k(rates: list[float]) -> None:
    values = [expected_tokens(rates, k) for k in range(len(rates) + 1)]
    assert values[0] == 1.0
    assert all(later >= earlier for earlier, later in itertools.pairwise(values))
    assert all(value <= k + 1 for k, value in enumerate(values))


@given(st.integers(0, 8))
def test_perfect_acceptance_emits_k_plus_one_tokens(k: int) -> None:
    assert expected_tokens([1.0] * k, k) == k + 1


def test_k_beyond_the_estimated_positions_is_refused() -> None:
    with pytest.raises(ValueError, match="K=3"):
        expected_tokens([0.5, 0.5], 3)


@given(st.lists(st.floats(0.01, 1), min_size=1, max_size=6),
       st.lists(st.floats(0.001, 1), min_size=1, max_size=5))
def test_free_speculation_runs_k_max(rates: list[float], step_s: list[float]) -> None:
    k_max = len(rates)
    grid = [2 ** i for i in range(len(step_s))]
    costs = StepCostTable(CostConfig(), [StepCostSample(k=k, batch_size=b, step_s=s)
                                         for k in range(k_max + 1)
                                         for b, s in zip(grid, step_s)])
    for batch_size in grid:
        assert best_k(throughputs(rates, costs, batch_size=batch_size, k_max=k_max)) == k_max


@given(st.lists(st.floats(0.1, 0.99), min_size=K_MAX, max_size=K_MAX))
def test_speculation_wins_alone_and_loses_in_a_crowd(rates: list[float]) -> None:
    costs = roofline_table()
    assert best_k(throughputs(rates, costs, batch_size=1, k_max=K_MAX)) > 0
    assert best_k(throughputs(rates, costs, batch_size=512, k_max=K_MAX)) == 0


# ---- the controller --------------------------------------------------------------------


def test_configs_are_checked() -> None:
    with pytest.raises(ValueError, match="increasing"):
        ControllerConfig(k_max=2, batch_size_buckets=(4, 2))
    with pytest.raises(ValueError, match="probe.k"):
        ControllerConfig(k_max=2, batch_size_buckets=(1,), probe=ProbeConfig(k=3))
    with pytest.raises(ValueError, match="threshold_rate"):
        CollapseConfig(threshold_rate=1.5)


def test_the_controller_starts_by_probing_small_batches() -> None:
    ctl = controller()
    assert ctl.schedule() == {1: 1, 2: 1, 4: 1, 8: 0, 16: 0, 32: 0, 64: 0, 128: 0, 256: 0}
    assert bucket(ctl, 1).reason is Reason.PROBING and ctl.state().is_probing
    assert bucket(ctl, 8).reason is Reason.BEST


def test_a_good_drafter_speculates_alone_and_not_in_a_crowd() -> None:
    ctl = controller()
    for _ in range(20):
        feed(ctl, GOOD)
    state = ctl.state()
    assert not state.is_probing and state.acceptance.rates == pytest.approx(GOOD, abs=0.02)
    assert ctl.k_for(1) == K_MAX and bucket(ctl, 1).reason is Reason.BEST
    assert ctl.k_for(256) == 0 and ctl.k_for(1000) == 0
    assert len(bucket(ctl, 1).tokens_per_s) == K_MAX + 1


def test_costs_measured_before_any_sequence_count_at_once_with_a_refresh() -> None:
    """The service calibrates before serving: the schedule must not wait for a sequence."""
    ctl = controller(StepCostTable(CostConfig()))
    assert ctl.schedule() == dict.fromkeys(BUCKETS, 0)
    assert bucket(ctl, 1).reason is Reason.NO_COST_DATA
    for sample in roofline_table().points().values():
        for point in sample:
            ctl.record_cost(point)
    assert bucket(ctl, 1).reason is Reason.NO_COST_DATA  # recorded, not yet decided
    ctl.refresh()
    assert bucket(ctl, 1).reason is Reason.PROBING and ctl.k_for(1) == 1
    assert {p.k for points in ctl.cost_points().values() for p in points} == \
        set(range(K_MAX + 1))


def test_a_schedule_gives_each_batch_size_its_buckets_k() -> None:
    schedule = {2: 3, 8: 1, 64: 0}
    assert [k_at(schedule, b) for b in (1, 2, 3, 8, 9, 64, 65, 10_000)] == \
        [3, 3, 1, 1, 0, 0, 0, 0]
    ctl = controller()
    assert all(ctl.k_for(b) == k_at(ctl.schedule(), b) for b in range(1, 600))


def test_buckets_without_cost_data_run_without_speculation() -> None:
    ctl = controller(roofline_table(max_batch_size=64))
    for _ in range(20):
        feed(ctl, GOOD)
    assert bucket(ctl, 128).reason is Reason.NO_COST_DATA and ctl.k_for(128) == 0
    assert bucket(ctl, 128).tokens_per_s == (None,) * (K_MAX + 1)
    assert ctl.k_for(64) > 0


def test_a_bucket_beyond_the_calibration_tries_k_until_its_own_steps_price_it() -> None:
    """Calibrated up to 32, then K = 0's live steps at 64 and 128: at 64 each K > 0 is
    priced from its ratio to K = 0 at 32 ("step cost extrapolated") and the best one runs;
    once its own steps at 64 cost more than it pays, the bucket moves on, and it settles on
    a measured K. 128 extrapolates only from the bucket below (33..64): nothing until a
    K > 0 has run there. Without the extrapolation 64 stayed at K = 0 for good."""
    costs = roofline_table(max_batch_size=32)
    ctl = controller(costs)
    for _ in range(20):  # the small buckets learn the drafter's acceptance
        feed(ctl, GOOD)
    assert bucket(ctl, 64).reason is Reason.NO_COST_DATA
    for b in (64, 128):
        costs.record(StepCostSample(k=0, batch_size=b, step_s=roofline_s(0, b)))
    assert observations_until(ctl, lambda c: c.k_for(64) > 0, GOOD,
                              batch_size=64) == CONFIRMATIONS  # through the hysteresis
    assert bucket(ctl, 64).reason is Reason.EXTRAPOLATED
    assert bucket(ctl, 128).tokens_per_s[1:] == (None,) * K_MAX  # not from 32
    tried = {0, ctl.k_for(64)}
    for _ in range(K_MAX + 1):  # each K > 0 tried turns out four times as dear at 64
        k = ctl.k_for(64)
        if k == 0 or costs.covers(k, 64):
            break
        costs.record(StepCostSample(k=k, batch_size=64, step_s=4 * roofline_s(k, 64)))
        feed(ctl, GOOD, batch_size=64)
        tried.add(ctl.k_for(64))
    assert bucket(ctl, 64).reason is Reason.BEST and ctl.k_for(64) == 0
    assert tried == set(range(K_MAX + 1))  # every K > 0 was tried before K = 0 won
    assert None not in bucket(ctl, 128).tokens_per_s  # each K > 0 has run at 64 now


grid_costs = st.lists(st.floats(0.005, 1), min_size=(K_MAX + 1) * 5, max_size=(K_MAX + 1) * 5)
stream = st.lists(st.tuples(st.integers(1, 300), st.lists(st.floats(0, 1), min_size=K_MAX,
                                                          max_size=K_MAX),
                            st.sampled_from((1, 4, 16, 64, 256)), st.integers(0, 2)),
                  max_size=30)


@settings(max_examples=60, deadline=None)
@given(grid_costs, stream, st.sampled_from((1, 4, 16, 64, 256)))
def test_the_controller_is_never_slower_than_spec_off_beyond_the_margin(
        step_s: list[float], observations: list[tuple[int, list[float], int, int]],
        k_measured_up_to: int) -> None:
    """For any cost table and acceptance stream, a bucket decided by the model runs a K
    within the margin of K = 0 (probing and collapse are the documented exceptions), also
    where its K > 0 are measured only up to ``k_measured_up_to`` (extrapolated beyond)."""
    grid = (1, 4, 16, 64, 256)
    costs = StepCostTable(CostConfig(), [
        StepCostSample(k=k, batch_size=b, step_s=s)
        for (k, b), s in zip(itertools.product(range(K_MAX + 1), grid), step_s)
        if k == 0 or b <= k_measured_up_to])
    ctl = SpeculationController(ControllerConfig(k_max=K_MAX, batch_size_buckets=grid), costs)
    for drafts, rates, batch_size, draft_version in sorted(observations, key=lambda o: o[3]):
        feed(ctl, rates, draft_version=draft_version, batch_size=batch_size,
             num_drafts=drafts)
        for state in ctl.state().buckets:
            tokens_per_s = state.tokens_per_s
            if state.reason in (Reason.BEST, Reason.HOLD, Reason.EXTRAPOLATED):
                assert tokens_per_s[state.k] * (1 + MARGIN) >= tokens_per_s[0]
            if state.reason is Reason.BEST:
                assert tokens_per_s[state.k] == max(t for t in tokens_per_s if t is not None)


def test_a_load_that_never_reaches_the_small_buckets_is_probed_where_it_runs() -> None:
    """16 requests of one length finish together: nothing drafts in buckets up to 4, so
    after a few sequences without a draft the probe takes the load's bucket; it ends, as
    any probe, once the drafter has its drafts, and the model decides there again."""
    ctl = controller()
    widen = DEFAULTS.probe.widen_after_observations
    for _ in range(widen - 1):
        feed(ctl, GOOD, batch_size=16)  # at K = 0: no drafts
    assert ctl.k_for(16) == 0 and ctl.k_for(8) == 0
    feed(ctl, GOOD, batch_size=16)
    assert ctl.k_for(16) == 1 and bucket(ctl, 16).reason is Reason.PROBING
    assert ctl.k_for(8) == 1 and ctl.k_for(32) == 0, "up to the load's bucket"
    feed(ctl, GOOD, batch_size=16, num_drafts=DEFAULTS.probe.num_drafts)
    state = ctl.state()
    assert not state.is_probing and state.acceptance.rates[0] == pytest.approx(0.7, abs=0.05)
    assert bucket(ctl, 16).reason is not Reason.PROBING


def test_a_pushed_drafter_is_probed_in_the_small_buckets_only() -> None:
    """After a drafter that drafted, a push (every RL step) starts from its estimate: the
    large buckets at a step's start keep the model's K = 0, as before any widening."""
    ctl = controller()
    feed(ctl, BROKEN, batch_size=1, num_drafts=DEFAULTS.probe.num_drafts)  # evidence
    for _ in range(2 * DEFAULTS.probe.widen_after_observations):
        feed(ctl, GOOD, batch_size=256, draft_version=1)  # the pushed one, at K = 0
    assert ctl.state().is_probing and ctl.k_for(1) == 1 and ctl.k_for(256) == 0


def test_a_probe_that_drafts_in_the_small_buckets_stays_there() -> None:
    ctl = controller()
    feed(ctl, BROKEN, batch_size=1, num_drafts=10)  # drafted (at K = 1), none accepted
    for _ in range(2 * DEFAULTS.probe.widen_after_observations):
        feed(ctl, GOOD, batch_size=16)  # at K = 0: no drafts
    assert ctl.state().is_probing and ctl.k_for(1) == 1
    assert ctl.k_for(16) == 0 and bucket(ctl, 16).reason is not Reason.PROBING
