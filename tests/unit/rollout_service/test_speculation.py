"""The speculation controller's decisions: the throughput model, collapse, probes and
recovery (pure Python, no engine; the hysteresis: ``test_speculation_hysteresis.py``)."""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rollout_service.protocol.acceptance import SpecDecodeStats
from rollout_service.speculation.acceptance import WeightVersions
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
from tests.support.spec_stats import vllm_chain

K_MAX = 3
BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
GOOD = (0.7, 0.7, 0.7)
BROKEN = (0.0, 0.0, 0.0)
DEFAULTS = ControllerConfig(k_max=K_MAX, batch_size_buckets=BUCKETS)
WINDOW = DEFAULTS.collapse.window_drafts
DRAFTS = 200
"""Drafts of one fed sequence (:func:`feed`'s default)."""
COLLAPSE_BOUND = -(-WINDOW // DRAFTS)
"""Sequences of :data:`DRAFTS` a broken drafter drafts before K = 0 everywhere."""
CONFIRMATIONS = DEFAULTS.hysteresis.num_confirmations
MARGIN = DEFAULTS.hysteresis.margin


def chain_stats(num_drafts: int, rates: Sequence[float]) -> SpecDecodeStats:
    """A sequence drafting ``len(rates)`` tokens per step, position ``i`` accepted at
    (at most) ``rates[i]`` among the drafts that accepted every earlier position."""
    per_position, reached = [], num_drafts
    for rate in rates:
        reached = int(reached * rate)
        per_position.append(reached)
    return SpecDecodeStats(num_drafts=num_drafts, num_draft_tokens=len(rates) * num_drafts,
                           num_accepted_tokens=sum(per_position), num_verify_steps=num_drafts,
                           accepted_per_position=tuple(per_position))


def roofline_s(k: int, batch_size: int) -> float:
    """A decode step's seconds: reading the weights (20 ms) until verifying ``B * (K + 1)``
    tokens takes longer (0.2 ms each), plus one drafter pass (1 ms) per draft token."""
    return max(0.02, 2e-4 * batch_size * (k + 1)) + 0.001 * k


def roofline_table(max_batch_size: int = 512) -> StepCostTable:
    grid = [2 ** i for i in range(max_batch_size.bit_length()) if 2 ** i <= max_batch_size]
    return StepCostTable(CostConfig(), [
        StepCostSample(k=k, batch_size=b, step_s=roofline_s(k, b))
        for k in range(K_MAX + 1) for b in grid])


def controller(costs: StepCostTable | None = None, **fields: object) -> SpeculationController:
    config = ControllerConfig(k_max=K_MAX, batch_size_buckets=BUCKETS, **fields)
    return SpeculationController(config, roofline_table() if costs is None else costs)


def feed(ctl: SpeculationController, rates: Sequence[float], *, draft_version: int = 0,
         main_version: int | None = None, batch_size: int = 1, num_drafts: int = DRAFTS,
         now: float = 0.0) -> None:
    """One finished sequence that ran with the K the controller has in force, its stats in
    vLLM's shape (``k_max + 1`` histogram buckets whatever K ran)."""
    k = ctl.k_for(batch_size)
    versions = WeightVersions(main_version=draft_version if main_version is None
                              else main_version, draft_version=draft_version)
    ctl.observe(vllm_chain(num_drafts, rates, k=k, k_max=K_MAX), versions, batch_size, now)


def observations_until(ctl: SpeculationController, is_done, rates: Sequence[float],
                       limit: int = 100, **feed_args: object) -> int:
    """Sequences fed until ``is_done(ctl)``."""
    for count in range(1, limit + 1):
        feed(ctl, rates, **feed_args)
        if is_done(ctl):
            return count
    raise AssertionError(f"not done after {limit} observations: {ctl.state()}")


def bucket(ctl: SpeculationController, batch_size: int):
    return next(b for b in ctl.state().buckets if b.batch_size == batch_size)


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


def test_a_stale_drafter_is_switched_off_and_a_push_brings_speculation_back() -> None:
    ctl = controller()
    for _ in range(20):
        feed(ctl, GOOD)
    assert ctl.k_for(1) == K_MAX
    # The drafter is left behind: acceptance falls from 0.7 to 0.
    num_stale = observations_until(ctl, lambda c: not any(c.schedule().values()), BROKEN)
    assert num_stale <= COLLAPSE_BOUND
    state = ctl.state()
    assert state.is_collapsed and {b.reason for b in state.buckets} == {Reason.COLLAPSED}
    # Pushes of the main model alone do not end the collapse.
    for main_version in range(1, 5):
        feed(ctl, GOOD, main_version=main_version)
    assert ctl.state().is_collapsed and not any(ctl.schedule().values())
    # A new drafter: probed from its first observation, then chosen by the model.
    assert observations_until(ctl, lambda c: c.k_for(1) > 0, GOOD, draft_version=1) == 1
    assert bucket(ctl, 1).reason is Reason.PROBING
    num_recovery = observations_until(
        ctl, lambda c: bucket(c, 1).reason is Reason.BEST and c.k_for(1) > 0, GOOD,
        draft_version=1)
    assert num_recovery <= 1 + CONFIRMATIONS
    assert ctl.k_for(256) == 0


@pytest.mark.parametrize("is_repaired", [True, False])
def test_a_collapsed_drafter_is_probed_again_after_a_while(is_repaired: bool) -> None:
    ctl = controller(collapse=CollapseConfig(reprobe_after_s=300.0))
    for _ in range(20):
        feed(ctl, GOOD)
    observations_until(ctl, lambda c: c.state().is_collapsed, BROKEN, now=1000.0)
    feed(ctl, GOOD, now=1299.0)
    assert ctl.state().is_collapsed
    feed(ctl, GOOD, now=1300.0)
    assert ctl.state().is_probing and ctl.k_for(1) == 1
    if is_repaired:  # the collapse was transient: back to the model's K
        assert observations_until(ctl, lambda c: c.k_for(1) == K_MAX, GOOD,
                                  now=1301.0) <= 2 + CONFIRMATIONS
    else:  # still broken: off again once the probe has measured it
        assert observations_until(ctl, lambda c: not any(c.schedule().values()), BROKEN,
                                  now=1301.0) <= COLLAPSE_BOUND


def test_observations_of_an_older_drafter_are_ignored() -> None:
    ctl = controller()
    feed(ctl, GOOD, draft_version=2)
    before = ctl.state()
    for _ in range(2 * WINDOW):
        feed(ctl, BROKEN, draft_version=1)
    assert ctl.state() == before


@settings(max_examples=60, deadline=None)
@given(num_good=st.integers(0, 30), good_rate=st.floats(0.3, 0.95),
       num_drafts=st.lists(st.integers(1, 400), min_size=1, max_size=20),
       bad_rate=st.floats(0, 0.099))
def test_collapse_within_the_window_whatever_came_before(
        num_good: int, good_rate: float, num_drafts: list[int], bad_rate: float) -> None:
    ctl = controller()
    versions = WeightVersions(main_version=0, draft_version=0)
    for _ in range(num_good):
        ctl.observe(chain_stats(200, (good_rate,) * K_MAX), versions, 1, 0.0)
    num_bad = 0
    for drafts in itertools.cycle(num_drafts):  # whatever K is in force, these drafted
        ctl.observe(chain_stats(drafts, (bad_rate,) * K_MAX), versions, 1, 0.0)
        num_bad += drafts
        if num_bad >= WINDOW:
            break
    assert ctl.state().is_collapsed and not any(ctl.schedule().values())


@pytest.mark.parametrize("num_sequences", [8, WINDOW - 1])
def test_a_few_rejected_drafts_do_not_collapse_a_working_drafter(num_sequences: int) -> None:
    """A rollout's tail: sequences that ran at K = 0 draft a few times before they end.
    On an H100 a window of 8 such sequences pooled 0.0 and switched off a drafter
    estimated at 0.33-0.39; fewer drafts than the window pool with the sequences before."""
    ctl = controller()
    for _ in range(20):
        feed(ctl, GOOD)
    for _ in range(num_sequences):
        feed(ctl, BROKEN, num_drafts=1)
    state = ctl.state()
    assert not state.is_collapsed and ctl.k_for(1) > 0
    assert state.collapse_rate is not None and state.collapse_rate > 0.1


def test_the_default_window_does_not_collapse_a_weak_drafter_by_chance() -> None:
    """The chance that ``window_drafts`` drafts of a drafter accepted 3 times in 10 at
    position 0 pool below the threshold (a binomial tail): one window in 10^4 at most."""
    config = DEFAULTS.collapse
    n, p = config.window_drafts, 0.3
    tail = sum(math.comb(n, k) * p ** k * (1 - p) ** (n - k)
               for k in range(n + 1) if k < config.threshold_rate * n)
    assert tail < 1e-4


def test_a_collapse_window_of_no_drafts_is_refused() -> None:
    with pytest.raises(ValueError, match="window_drafts"):
        CollapseConfig(window_drafts=0)


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
