"""The hysteresis of the speculation controller's decisions (``decision.Hysteresis``): the
K in force never slower than spec-off beyond the margin, and no flapping on marginal
differences (pure Python)."""

from __future__ import annotations

import itertools

from hypothesis import given
from hypothesis import strategies as st

from rollout_service.speculation.decision import Hysteresis, HysteresisConfig, Reason

K_MAX = 3

throughput_maps = st.builds(lambda off, on: {0: off, **on}, st.floats(0.1, 100),
                            st.dictionaries(st.integers(1, K_MAX), st.floats(0.1, 100)))


@given(st.lists(throughput_maps, min_size=1, max_size=40), st.floats(0, 0.5),
       st.integers(1, 5))
def test_the_k_in_force_is_never_slower_than_spec_off_beyond_the_margin(
        maps: list[dict[int, float]], margin: float, num_confirmations: int) -> None:
    hysteresis = Hysteresis(HysteresisConfig(margin=margin,
                                             num_confirmations=num_confirmations))
    for throughput in maps:
        hysteresis.decide(throughput)
        assert throughput[hysteresis.k] * (1 + margin) >= throughput[0]


def test_alternating_marginal_differences_do_not_flap() -> None:
    hysteresis = Hysteresis(HysteresisConfig(margin=0.05, num_confirmations=3))
    hysteresis.force(2)
    three_ahead = {0: 50.0, 1: 80.0, 2: 100.0, 3: 104.0}   # wins by 4% < 5%
    two_ahead = {0: 50.0, 1: 80.0, 2: 104.0, 3: 100.0}
    far_ahead = {0: 50.0, 1: 80.0, 2: 100.0, 3: 130.0}     # wins by 30%, not sustained
    for throughput in itertools.islice(itertools.cycle([three_ahead, two_ahead, far_ahead,
                                                        two_ahead]), 200):
        hysteresis.decide(throughput)
        assert hysteresis.k == 2
    reasons = [hysteresis.decide(far_ahead) for _ in range(3)]
    assert reasons == [Reason.HOLD, Reason.HOLD, Reason.BEST] and hysteresis.k == 3


@given(throughput_maps, st.lists(st.floats(-1, 1), min_size=K_MAX + 1, max_size=K_MAX + 1),
       st.floats(0.01, 0.3), st.integers(1, 4))
def test_marginal_alternation_switches_at_most_once(
        first: dict[int, float], jitter: list[float], margin: float,
        num_confirmations: int) -> None:
    """Two tables within ``(1 + d)`` of each other per K, ``(1 + d)**2 < 1 + margin``:
    after the first switch the other table never beats the K in force by the margin."""
    d = 0.9 * ((1 + margin) ** 0.5 - 1)
    second = {k: value * (1 + d) ** jitter[k] for k, value in first.items()}
    hysteresis = Hysteresis(HysteresisConfig(margin=margin,
                                             num_confirmations=num_confirmations))
    in_force = []
    for throughput in itertools.islice(itertools.cycle([first, second]), 60):
        hysteresis.decide(throughput)
        in_force.append(hysteresis.k)
    assert sum(a != b for a, b in itertools.pairwise([0, *in_force])) <= 1
