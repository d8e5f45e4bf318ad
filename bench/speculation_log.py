"""The report of ``bench/speculation.py`` again, from the round lines of its log.

A run cut by a time limit (a device call of at most 600 s) prints every round it
finished, ``  noise 0.1 c=16 round 2: spec-off 5324, k=0 run 4893, ... tok/s``, but not
the tables that follow a drafter's last workload. This reads those lines back, from one
log or several (a drafter's workloads split over calls), and prints the same tables and
per-round ratios (``speculation_report.print_report``)::

    python -m bench.speculation_log run1/spec-bench-0.1.log run2/spec-bench-0.1.log

The console may wrap a long round line; the pieces are joined before they are read. A
workload whose rounds appear in two logs keeps the first log's.
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path

from rich.console import Console

from bench.speculation_report import print_report

START = re.compile(r"^\s*noise \S+(?: stale)? (?:c=\d+|rollout) round \d+: ")
ROUND = re.compile(r"^\s*(?P<drafter>noise \S+(?: stale)?) (?P<workload>c=\d+|rollout) "
                   r"round (?P<round>\d+): (?P<rates>.+) tok/s$")
MODE_RATE = re.compile(r"(?P<mode>.+) (?P<rate>\d+(?:\.\d+)?)")

MAX_PIECES = 4
"""Lines a wrapped round line may span (two at the widths seen); more: not a round line."""

Rates = dict[str, dict[str, dict[str, list[float]]]]
"""``{drafter: {workload: {mode: tok/s per round}}}``, as ``print_report`` takes a
drafter's."""


def round_lines(text: str) -> list[str]:
    """The round lines of a log, each joined back where the console wrapped it (at a
    space, so the pieces join with one)."""
    lines, pieces = [], []
    for line in text.splitlines():
        if START.match(line):
            pieces = [line]  # a piece that never ended (a cut log) is dropped
        elif pieces:
            pieces = pieces + [line] if len(pieces) < MAX_PIECES else []
        if pieces and line.rstrip().endswith("tok/s"):
            lines.append(" ".join(" ".join(pieces).split()))
            pieces = []
    return lines


def read_rounds(texts: list[str]) -> Rates:
    """Tokens/s per drafter, workload and mode, in round order.

    Raises:
        ValueError: a round of a workload missing a mode of its first round, or out of
            order (the log is not one run's).
    """
    rates: Rates = {}
    taken: set[tuple[str, str]] = set()
    for text in texts:
        seen: set[tuple[str, str]] = set()
        for line in round_lines(text):
            match = ROUND.match(line)
            if match is None:
                continue
            key = (match["drafter"], match["workload"])
            if key in taken:
                continue
            seen.add(key)
            per_mode = {m["mode"]: float(m["rate"]) for m in (
                MODE_RATE.fullmatch(part.strip()) for part in match["rates"].split(","))
                if m is not None}
            workload = rates.setdefault(match["drafter"], {}).setdefault(match["workload"], {})
            number = int(match["round"])
            if workload and (set(per_mode) != set(workload)
                             or number != len(next(iter(workload.values()))) + 1):
                raise ValueError(f"round {number} of {key} does not follow the rounds before "
                                 f"it: {line!r}")
            for mode, rate in per_mode.items():
                workload.setdefault(mode, []).append(rate)
        taken |= seen
    return rates


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("logs", nargs="+", type=Path, help="bench.speculation logs")
    opts = parser.parse_args()
    rates = read_rounds([log.read_text() for log in opts.logs])
    if not rates:
        parser.error(f"no round lines in {[str(log) for log in opts.logs]}")
    console = Console(width=160)
    for drafter, workloads in rates.items():
        print_report(console, f"{drafter} (from the logs' rounds)", workloads)


if __name__ == "__main__":
    main()
