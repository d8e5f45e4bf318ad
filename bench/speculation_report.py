"""The tables ``bench/speculation.py`` prints per drafter: tokens per second per workload
and mode (median and spread over rounds), and the ratios the issue targets, per round:
the controller over spec-off (>= 0.98), the controller over the best static K on the
decaying rollout (>= 1.10), and K = 0 over spec-off (the drafter's floor, no target);
and per fixed concurrency, the controller's model against the pinned modes
(:func:`model_check`).
"""

from __future__ import annotations

import bisect
import statistics

from rich.console import Console
from rich.table import Table

from bench.spread import min_max
from rollout_service.protocol.speculation import SpeculationControlStatus

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
        ratios.add_row(label, name, f"{median:.3f}", min_max(per_round),
                       "" if target is None else f">= {target}", met)

    for label, rates in results.items():
        for mode, values in rates.items():
            table.add_row(label, mode, f"{statistics.median(values):.0f}", min_max(values))
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
            if f"frozen{suffix}" in rates:  # its K pinned: what its deciding costs
                ratio(label, f"{controller} / frozen{suffix}", rates[controller],
                      rates[f"frozen{suffix}"], None)
            if f"k=0{suffix}" in rates:  # the floor: what the drafter costs at K = 0
                ratio(label, f"k=0{suffix} / spec-off (floor)", rates[f"k=0{suffix}"],
                      rates["spec-off"], None)
        # drafter_at_k0 skip against run, paired per round (the same round's load); a
        # pinned K >= 1 is the control: skip changes nothing there, so its ratio is the
        # two engines' own difference
        statics = sorted(m.removesuffix(" skip") for m in rates
                         if m.startswith("k=") and m.endswith(" skip") and m != "k=0 skip")
        for mode in ("k=0", "controller", *statics):
            if f"{mode} skip" in rates and f"{mode} run" in rates:
                ratio(label, f"{mode} skip / {mode} run" + (" (control)" if mode in statics
                                                             else ""),
                      rates[f"{mode} skip"], rates[f"{mode} run"], None)
    console.print(table)
    console.print(ratios)


def model_check(label: str, concurrency: int, control: SpeculationControlStatus,
                rates: dict[str, list[float]], suffix: str = "") -> Table:
    """The controller's expected tokens/s per K at the bucket that holds ``concurrency``
    (its upper edge) beside the pinned modes' measured medians, each also over its own
    K = 0: where the two orders of K disagree, the model (its cost table or its
    acceptance, both in the state JSON) is what misled the controller. Absolute figures
    differ (the model counts decode steps only, the rounds also prefill and the front
    end); the ratios are what to compare."""
    edges = [b.batch_size for b in control.buckets]
    bucket = control.buckets[min(bisect.bisect_left(edges, concurrency), len(edges) - 1)]
    table = Table("K", "model tok/s", "model / K=0", "pinned tok/s", "pinned / K=0",
                  title=f"{label}: the controller's model at B={bucket.batch_size} "
                        f"(chose K={bucket.controller_k}, {bucket.reason}) vs the pinned modes")
    expected = bucket.tokens_per_s
    pinned = {k: statistics.median(rates[f"k={k}{suffix}"]) for k in range(len(expected))
              if f"k={k}{suffix}" in rates}

    def over_k0(values: dict[int, float], k: int) -> str:
        return f"{values[k] / values[0]:.2f}" if k in values and values.get(0) else "-"

    model = {k: v for k, v in enumerate(expected) if v is not None}
    for k in range(len(expected)):
        table.add_row(str(k), f"{model[k]:.0f}" if k in model else "no cost data",
                      over_k0(model, k), f"{pinned[k]:.0f}" if k in pinned else "-",
                      over_k0(pinned, k))
    return table
