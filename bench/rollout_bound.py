"""How much a speculation controller could gain over the best static K on the decaying
rollout, at most, by the step costs and acceptance a controller measured.

The issue's rollout target is the controller at 1.10x the best static K. A controller
gains over a static K only where the best K changes with the batch size, and only by as
much as the throughput model allows. This replays the benchmark's rollout
(``bench/speculation_rounds.py``'s ``rollout_lengths``: every prompt at once, Pareto-tailed
lengths) in that model, from a saved controller state (``controller-*.json`` of
``bench/speculation.py --logs``):

- every running sequence emits ``E(K)`` tokens a step (``decision.expected_tokens``, from
  the state's acceptance), so all share one position and the longest run last;
- a step at batch size B costs ``c(K, B)`` of the state's cost table, fitted as the
  controller fits it (``cost.StepCostTable``);
- the oracle runs, at every B, the K of the highest ``B * E(K) / c(K, B)``: the
  controller's own choice, with nothing left to learn and no hysteresis.

Only the tail is priced: the steps whose batch size every K's costs cover (the table
holds no cost above its largest measured B, and there the graphs, the prefill and the
scheduler decide). The report says what share of the rollout's tokens that tail holds.
A model, not a measurement: prefill, the front end and the noise of real steps are not in
it; it bounds what the throughput model can promise.

    python -m bench.rollout_bound tests/data/controller-h100-1b-skip-rollout.json
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from rich.console import Console
from rich.table import Table

from bench.cost_fit import measured_costs, read_state
from bench.speculation_rounds import rollout_lengths
from rollout_service.protocol.speculation import SpeculationControlStatus
from rollout_service.speculation.cost import StepCostTable
from rollout_service.speculation.decision import best_k, expected_tokens

Policy = Callable[[int], int]
"""K at a batch size."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Replay:
    """One policy over the tail: its tokens, seconds and steps."""

    tokens: float
    seconds: float
    steps: int

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds


def covered_batch_size(costs: StepCostTable, k_max: int) -> int:
    """The largest batch size every K up to ``k_max`` has a measured cost at or above.

    Raises:
        ValueError: a K without any cost, or no batch size all K's cover.
    """
    points = costs.points()
    if missing := [k for k in range(k_max + 1) if not points.get(k)]:
        raise ValueError(f"no step cost for K = {missing}")
    low = max(points[k][0].batch_size for k in range(k_max + 1))
    high = min(points[k][-1].batch_size for k in range(k_max + 1))
    if low > 1 or high < low:
        raise ValueError(f"the costs of K = 0..{k_max} share no range from batch size 1")
    return high


def replay(lengths: Sequence[int], start: float, policy: Policy, costs: StepCostTable,
           rates: Sequence[float]) -> Replay:
    """The rollout from position ``start`` on: the sequences longer than it, each emitting
    ``E(K)`` tokens a step at the K ``policy`` gives their batch size."""
    remaining = sorted(length - start for length in lengths if length > start)
    position, seconds, steps, done = 0.0, 0.0, 0, 0
    while done < len(remaining):
        batch_size = len(remaining) - done
        k = policy(batch_size)
        position += expected_tokens(rates, k)
        seconds += costs.step_s(k, batch_size)
        steps += 1
        while done < len(remaining) and remaining[done] <= position:
            done += 1
    return Replay(tokens=sum(remaining), seconds=seconds, steps=steps)


def oracle(costs: StepCostTable, rates: Sequence[float], k_max: int) -> Policy:
    """The K of the highest modelled throughput at each batch size."""
    def choose(batch_size: int) -> int:
        return best_k({k: expected_tokens(rates, k) / costs.step_s(k, batch_size)
                       for k in range(k_max + 1)})
    return choose


def tail_start(lengths: Sequence[int], batch_size: int) -> int:
    """The position from which at most ``batch_size`` sequences still run: the length of
    the longest sequence beyond them (0: all of them fit)."""
    ordered = sorted(lengths, reverse=True)
    return ordered[batch_size] if batch_size < len(ordered) else 0


def report(state: SpeculationControlStatus, lengths: Sequence[int]) -> Table:
    costs = measured_costs(state)
    rates, k_max = state.acceptance, state.k_max
    covered = covered_batch_size(costs, k_max)
    start = tail_start(lengths, covered)
    modes: dict[str, Policy] = {f"K = {k}": (lambda _b, k=k: k) for k in range(k_max + 1)}
    modes["oracle"] = oracle(costs, rates, k_max)
    replays = {name: replay(lengths, start, policy, costs, rates)
               for name, policy in modes.items()}
    best_static = max((n for n in replays if n != "oracle"),
                      key=lambda n: replays[n].tokens_per_s)
    share = replays["oracle"].tokens / sum(lengths)
    table = Table("policy", "steps", "model tok/s", "/ best static", title=(
        f"the rollout's tail in the model: at most {covered} running (every K measured "
        f"there), from position {start}: {share:.3f} of {sum(lengths)} tokens"))
    for name, result in replays.items():
        table.add_row(name, str(result.steps), f"{result.tokens_per_s:.0f}",
                      f"{result.tokens_per_s / replays[best_static].tokens_per_s:.3f}")
    return table


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("state", type=Path, help="a controller-*.json of bench.speculation")
    parser.add_argument("--rollout-prompts", type=int, default=512)
    parser.add_argument("--rollout-max-tokens", type=int, default=1024)
    opts = parser.parse_args()
    state = read_state(parser, opts.state)
    console = Console()
    console.print(f"acceptance per position: {[round(p, 3) for p in state.acceptance]}")
    console.print(report(state, rollout_lengths(opts.rollout_prompts,
                                                opts.rollout_max_tokens)))


if __name__ == "__main__":
    main()
