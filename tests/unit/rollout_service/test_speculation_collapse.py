"""The speculation controller's collapse and recovery: a drafter whose acceptance falls
below the threshold over a window of drafts runs K = 0 everywhere until a push or a
re-probe (pure Python, no engine)."""

from __future__ import annotations

import itertools
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rollout_service.speculation.acceptance import WeightVersions
from rollout_service.speculation.decision import CollapseConfig, Reason
from tests.support.spec_controller import (
    BROKEN,
    COLLAPSE_BOUND,
    CONFIRMATIONS,
    DEFAULTS,
    GOOD,
    K_MAX,
    WINDOW,
    bucket,
    chain_stats,
    controller,
    feed,
    observations_until,
)


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
