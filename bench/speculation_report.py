"""The tables ``bench/speculation.py`` prints per drafter: tokens per second per workload
and mode (median and spread over rounds), and the ratios the issue targets, per round:
the controller over spec-off (>= 0.98), the controller over the best static K on the
decaying rollout (>= 1.10), and K = 0 over spec-off (the drafter's floor, no target).
"""

from __future__ import annotations

import statistics

from rich.console import Console
from rich.table import Table

from bench.serving import spread

CONTROLLER_OVER_OFF = 0.98
CONTROLLER_OVER_BEST_STATIC = 1.10


def mode_name(name: str, drafter_at_k0: str, all_values: list[str]) -> str:
    """``k=0`` with one spec engine; ``k=0 skip`` when several ``drafter_at_k0`` run."""
    return name if len(all_values) == 1 else f"{name} {drafter_at_k0}"


def print_report(console: Console, drafter: str,
                 results: dict[str, dict[str, list[float]]]) -> None:
    table = Table("workload", "mode", "median tok/s", "range", title=drafter)
    ratios = Table("workload", "ratio", "median", "range", "target", "met",
                   title=f"{drafter}: ratios (per round)")

    def ratio(label: str, name: str, num: list[float], den: list[float],
              target: float | None) -> None:
        per_round = [a / b for a, b in zip(num, den)]
        median = statistics.median(per_round)
        met = "" if target is None else "yes" if median >= target else "NO"
        ratios.add_row(label, name, f"{median:.3f}", spread(per_round),
                       "" if target is None else f">= {target}", met)

    for label, rates in results.items():
        for mode, values in rates.items():
            table.add_row(label, mode, f"{statistics.median(values):.0f}", spread(values))
        # One spec engine per drafter_at_k0: "controller" alone, or "controller run" ...
        for controller in (m for m in rates if m.startswith("controller")):
            suffix = controller.removeprefix("controller")
            ratio(label, f"{controller} / spec-off", rates[controller], rates["spec-off"],
                  CONTROLLER_OVER_OFF)
            static = {m: v for m, v in rates.items() if m.startswith("k=") and
                      m.endswith(suffix) and not m.startswith("k=0")}
            if label.startswith("rollout") and static:
                best = max(static, key=lambda m: statistics.median(static[m]))
                ratio(label, f"{controller} / best static ({best})", rates[controller],
                      static[best], CONTROLLER_OVER_BEST_STATIC)
            if f"k=0{suffix}" in rates:  # the floor: what the drafter costs at K = 0
                ratio(label, f"k=0{suffix} / spec-off (floor)", rates[f"k=0{suffix}"],
                      rates["spec-off"], None)
    console.print(table)
    console.print(ratios)
