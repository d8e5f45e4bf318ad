"""``bench/cost_fit.py`` on a real controller state: the H100 rollout of
``tests/data/controller-h100-1b-rollout.json`` (``bench.speculation --logs``, embedded 1B,
draft noise 0.1, ``k_max`` 3), whose measured step costs scatter by a fifth between
neighbouring batch sizes."""

from __future__ import annotations

from pathlib import Path

from bench.cost_fit import best, fitted_choices, points_report, report
from rollout_service.protocol.speculation import SpeculationControlStatus

STATE = Path(__file__).parents[1] / "data" / "controller-h100-1b-rollout.json"


def state() -> SpeculationControlStatus:
    return SpeculationControlStatus.model_validate_json(STATE.read_text())


def test_the_fitted_costs_choose_one_k_band_where_the_measured_points_flipped() -> None:
    h100 = state()
    live = {b.batch_size: best(b.tokens_per_s) for b in h100.buckets}
    fitted = {edge: best(rates) for edge, rates in fitted_choices(h100).items()}
    calibrated = [1, 2, 4, 8, 16, 32]
    # As measured, K = 0 looked best at B = 4 and K = 1 at B = 16, beside K = 3 at 8 and 32
    assert [live[b] for b in calibrated] == [3, 2, 0, 3, 1, 3]
    assert all(fitted[b] in (2, 3) for b in calibrated), fitted
    assert fitted[64] is None  # beyond the costs measured: still no guess


def test_the_report_has_a_row_per_bucket() -> None:
    assert report(state()).row_count == len(state().buckets)


def test_the_points_report_has_a_row_per_point_with_its_sample_count() -> None:
    h100 = state()
    table = points_report(h100)
    assert table.row_count == len(h100.cost_table)
    # saved before the counts: every point reads one sample and no latest one
    assert list(table.columns[3].cells) == ["1"] * len(h100.cost_table)
    assert set(table.columns[4].cells) == {"-"}
    settled = h100.model_copy(update={"cost_table": [
        p.model_copy(update={"num_samples": 5, "last_step_s": 0.0042})
        for p in h100.cost_table]})
    assert set(points_report(settled).columns[4].cells) == {"4.200"}
