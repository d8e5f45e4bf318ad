"""How the decision prices a K > 0 against K = 0: the median of measured pairs nearby
(``speculation/cost.py``, relative cost), on a table from the H100 and on built ones."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from bench.cost_fit import measured_costs
from rollout_service.protocol.speculation import SpeculationControlStatus
from rollout_service.speculation.cost import CostConfig, StepCostSample, StepCostTable
from rollout_service.speculation.decision import (
    Hysteresis,
    HysteresisConfig,
    expected_tokens,
    throughputs,
)

H100_LOW_ACCEPTANCE = (Path(__file__).parents[2] / "data"
                       / "controller-h100-1b-noise0.6-after-c16.json")
"""The controller's state on one H100 after `bash tools/gpu/batch.sh spec-bench` with
``NOISE=0.6`` had run c = 1 and c = 16 (commit 816e4aa): a drafter accepting 0.18 at
position 0, its cost table calibrated up to 256 and refreshed by live steps. At c = 16 the
controller ran K = 1 at 0.93x pinned K = 0 (5763 against 6215 tok/s); at c = 1 K = 3 at
1.13x (504 against 444)."""

RATIO = 1.2
"""K = 1's cost over K = 0's in the built tables, at every batch size."""


def k0_cost(batch_size: int) -> float:
    return 0.002 + 0.00001 * batch_size


def consistent_table(*, at: int, k0_factor: float, k1_factor: float,
                     config: CostConfig | None = None) -> StepCostTable:
    """K = 0 and K = 1 measured in pairs at 1..256, K = 1 at ``RATIO`` times K = 0, but for
    the pair at ``at``, each scaled by its factor (one noisy measurement of each)."""
    samples = []
    for batch_size in (1, 2, 4, 8, 16, 32, 64, 128, 256):
        k0, k1 = k0_cost(batch_size), RATIO * k0_cost(batch_size)
        if batch_size == at:
            k0, k1 = k0 * k0_factor, k1 * k1_factor
        samples += [StepCostSample(k=0, batch_size=batch_size, step_s=k0),
                    StepCostSample(k=1, batch_size=batch_size, step_s=k1)]
    return StepCostTable(config or CostConfig(), samples)


def h100_state() -> tuple[SpeculationControlStatus, StepCostTable]:
    state = SpeculationControlStatus.model_validate_json(H100_LOW_ACCEPTANCE.read_text())
    return state, measured_costs(state)


def settled_k(throughput: dict[int, float]) -> int:
    """The K a bucket holds after many decisions on ``throughput``, starting at K = 0."""
    hysteresis = Hysteresis(HysteresisConfig())
    for _ in range(20):
        hysteresis.decide(throughput)
    return hysteresis.k


def test_on_the_h100_table_the_bucket_of_16_holds_k0_where_k1_lost_to_it() -> None:
    state, costs = h100_state()
    throughput = throughputs(state.acceptance, costs, batch_size=16, k_max=state.k_max)
    assert settled_k(throughput) == 0, throughput
    assert throughput[1] < throughput[0], throughput


def test_on_the_h100_table_a_k_above_0_still_wins_at_1_where_k3_did() -> None:
    state, costs = h100_state()
    throughput = throughputs(state.acceptance, costs, batch_size=1, k_max=state.k_max)
    assert settled_k(throughput) > 0, throughput


def test_the_fitted_curves_at_16_alone_had_k1_win_on_the_h100_table() -> None:
    """What the controller ran before: each K priced from the fitted curves at B alone."""
    state, costs = h100_state()
    throughput = {k: 16 * expected_tokens(state.acceptance, k) / costs.step_s(k, 16)
                  for k in range(state.k_max + 1)}
    assert settled_k(throughput) == 1, throughput


@given(k0_factor=st.floats(0.5, 2.0), k1_factor=st.floats(0.5, 2.0),
       at=st.sampled_from([2, 4, 8, 16, 32, 64, 128]))
def test_one_noisy_pair_does_not_move_the_ratio(k0_factor: float, k1_factor: float,
                                                at: int) -> None:
    """Wherever the window holds three pairs (not at the grid's ends, 1 and 256, where a
    median of two is their mean)."""
    costs = consistent_table(at=at, k0_factor=k0_factor, k1_factor=k1_factor)
    for batch_size in (b for b in (at // 2, at, at * 2) if 2 <= b <= 128):
        assert costs.cost_ratio(1, batch_size) == pytest.approx(RATIO)
        assert costs.estimate_s(1, batch_size) == pytest.approx(
            RATIO * costs.step_s(0, batch_size))


def test_a_window_of_1_reads_the_pair_at_the_batch_size() -> None:
    costs = consistent_table(at=16, k0_factor=1.3, k1_factor=0.9,
                             config=CostConfig(ratio_window=1.0))
    assert costs.cost_ratio(1, 16) == pytest.approx(RATIO * 0.9 / 1.3)
    # no pair at 24: the fitted curves' ratio there
    assert costs.cost_ratio(1, 24) == pytest.approx(costs.step_s(1, 24) / costs.step_s(0, 24))


def test_a_ratio_that_moves_with_the_batch_size_is_followed() -> None:
    """Drafting costs relatively less as steps grow: the median over neighbours keeps it."""
    samples = [StepCostSample(k=k, batch_size=b, step_s=k0_cost(b) * (1 + k * 0.5 / b))
               for b in (1, 2, 4, 8, 16, 32) for k in (0, 1)]
    costs = StepCostTable(CostConfig(), samples)
    assert costs.cost_ratio(1, 1) > costs.cost_ratio(1, 4) > costs.cost_ratio(1, 32)


def test_a_sequences_verify_cost_reads_the_same_ratios() -> None:
    """The net speed-up's verify cost prices K as the decision does: one noisy pair at 16
    moves neither."""
    costs = consistent_table(at=16, k0_factor=1.3, k1_factor=0.9)
    assert costs.verify_cost_ratio([0, 10], 16) == pytest.approx(RATIO)
    assert costs.verify_cost_ratio([10, 10], 16) == pytest.approx((1 + RATIO) / 2)


def test_beyond_its_batch_sizes_a_k_is_priced_from_the_pairs_near_its_last() -> None:
    """Extrapolation reads K's ratio at its nearest measured batch size as the decision
    does there: the noisy pair at 64, K = 1's last, does not set it."""
    sizes = (16, 24, 32, 48, 64)
    samples = [StepCostSample(k=0, batch_size=b, step_s=k0_cost(b)) for b in (*sizes, 128)]
    samples += [StepCostSample(k=1, batch_size=b, step_s=RATIO * k0_cost(b) * (0.7 if b == 64
                                                                             else 1.0))
                for b in sizes]
    costs = StepCostTable(CostConfig(), samples)
    assert costs.estimate_s(1, 128) == pytest.approx(RATIO * costs.step_s(0, 128))


def test_a_window_below_1_is_refused() -> None:
    with pytest.raises(ValueError, match="ratio_window"):
        CostConfig(ratio_window=0.5)


@given(st.lists(st.tuples(st.integers(0, 2), st.sampled_from([1, 2, 8, 16, 64, 256]),
                          st.floats(0.001, 0.1)), min_size=1, max_size=30))
def test_the_estimates_follow_every_record(samples: list[tuple[int, int, float]]) -> None:
    """The decision's estimates are kept between records (they are read for every bucket
    and K at each finished sequence): after each record they are those of a table built
    afresh from the same samples."""
    table = StepCostTable(CostConfig())
    for at, (k, batch_size, step_s) in enumerate(samples):
        for kk in range(3):  # read before the record: what a stale table would keep
            table.estimate_s(kk, 16, reach_from=2)
        table.record(StepCostSample(k=k, batch_size=batch_size, step_s=step_s))
        fresh = StepCostTable(CostConfig(), [StepCostSample(k=k_, batch_size=b_, step_s=s_)
                                             for k_, b_, s_ in samples[:at + 1]])
        for kk in range(3):
            for b in (1, 16, 100, 512):
                assert table.estimate_s(kk, b, reach_from=2) == fresh.estimate_s(
                    kk, b, reach_from=2)
