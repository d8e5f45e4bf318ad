"""The speculation controller's choice per bucket from a saved state: as it chose live,
and as its cost table prices the same points now (fitted non-decreasing in B, each K > 0
against K = 0 from the measured pairs nearby; ``rollout_service/speculation/cost.py``).

``bench/speculation.py --logs DIR`` writes the controller's whole state after each
workload (``controller-<run>-after-<workload>.json``, the ``/speculation`` body). This
reads one, rebuilds the cost table from its measured points and the decision's model from
its acceptance, and prints, per bucket edge, the K chosen and expected tokens/s per K both
ways, then the cost points as measured with their sample counts. No engine; the
acceptance and costs are the state's own.

    python -m bench.cost_fit tests/data/controller-h100-1b-rollout.json
"""

from __future__ import annotations

import argparse
from pathlib import Path

from pydantic import ValidationError
from rich.console import Console
from rich.table import Table

from rollout_service.protocol.speculation import SpeculationControlStatus
from rollout_service.speculation.controller import extrapolation_reach
from rollout_service.speculation.cost import CostConfig, StepCostSample, StepCostTable
from rollout_service.speculation.decision import best_k, throughputs


def read_state(parser: argparse.ArgumentParser, path: Path) -> SpeculationControlStatus:
    """A saved controller state, or the parser's error naming the file."""
    try:
        return SpeculationControlStatus.model_validate_json(path.read_text())
    except (OSError, ValidationError) as exc:
        parser.error(f"state: {path} is not a controller state: {exc}")


def measured_costs(state: SpeculationControlStatus) -> StepCostTable:
    """The state's measured step costs, in a table that fits and prices them as the
    controller's does now."""
    return StepCostTable(CostConfig(), (StepCostSample(k=p.k, batch_size=p.batch_size,
                                                       step_s=p.step_s)
                                        for p in state.cost_table))


def fitted_choices(state: SpeculationControlStatus) -> dict[int, dict[int, float]]:
    """Expected tokens/s per K at each bucket edge, from the state's measured costs as
    the table prices them now (K's beyond the calibration extrapolated as live, from the
    bucket below)."""
    costs = measured_costs(state)
    reach = extrapolation_reach([b.batch_size for b in state.buckets])
    return {edge: throughputs(state.acceptance, costs, batch_size=edge, k_max=state.k_max,
                              reach_from=from_size) for edge, from_size in reach.items()}


def best(rates: dict[int, float] | list[float | None]) -> int | None:
    """The decision's best K (``decision.best_k``) among the rates known; None without
    any (a bucket's ``tokens_per_s`` has None where K has no cost data)."""
    known = rates if isinstance(rates, dict) else {
        k: rate for k, rate in enumerate(rates) if rate is not None}
    return best_k(known) if known else None


def report(state: SpeculationControlStatus) -> Table:
    table = Table("B <=", "live K (reason)", "live tok/s per K", "K now",
                  "tok/s per K now", title="the controller's K per bucket, live and priced now")
    fitted = fitted_choices(state)
    for bucket in state.buckets:
        now = fitted[bucket.batch_size]
        table.add_row(
            str(bucket.batch_size), f"{bucket.k} ({bucket.reason})",
            " ".join("-" if r is None else f"{r:.0f}" for r in bucket.tokens_per_s),
            "-" if best(now) is None else str(best(now)),
            " ".join(f"{now[k]:.0f}" if k in now else "-" for k in range(state.k_max + 1)))
    return table


def points_report(state: SpeculationControlStatus) -> Table:
    """The state's cost points as measured: a point of many samples is settled, one whose
    latest sample lies far from it is moving (states saved before the counts read 1, -)."""
    table = Table("K", "B", "ms per step (blended)", "samples", "latest ms",
                  title="the cost table as measured")
    for p in sorted(state.cost_table, key=lambda p: (p.k, p.batch_size)):
        table.add_row(str(p.k), str(p.batch_size), f"{1e3 * p.step_s:.3f}",
                      str(p.num_samples),
                      "-" if p.last_step_s is None else f"{1e3 * p.last_step_s:.3f}")
    return table


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("state", type=Path, help="a controller-*.json of bench.speculation")
    opts = parser.parse_args()
    state = read_state(parser, opts.state)
    console = Console()
    console.print(f"acceptance per position: {[round(p, 3) for p in state.acceptance]}")
    console.print(report(state))
    console.print(points_report(state))


if __name__ == "__main__":
    main()
