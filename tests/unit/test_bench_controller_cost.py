"""``bench/controller_cost.py``: what it times is the controller deciding on a filled cost
table (not its "no cost data" shortcut), every sequence counted; and the command line
measures this tree against a baseline commit's in the same rounds."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from bench import controller_cost

REPO = Path(controller_cost.__file__).resolve().parents[1]


async def test_the_timed_sequences_are_decided_on_a_filled_cost_table() -> None:
    control = await controller_cost.loaded_control()
    for result in controller_cost.finished(50):
        control.observe(result)
    await control.settle()
    status = control.status()
    assert status.num_observations == 50  # none skipped as inconsistent
    assert all(b.reason != "no cost data" for b in status.buckets)
    assert all(b.tokens_per_s[0] is not None for b in status.buckets)
    assert status.acceptance[0] > 0.3


def test_a_run_against_a_baseline_prints_both_and_their_ratio() -> None:
    out = subprocess.run([sys.executable, "-m", "bench.controller_cost", "--rounds", "2",
                          "--sequences", "100", "--baseline", "HEAD"], cwd=REPO,
                         capture_output=True, text=True, check=True, timeout=600).stdout
    assert sum(line.startswith("  round ") for line in out.splitlines()) == 2
    assert "this tree" in out and "baseline HEAD" in out
    row = next(line for line in out.splitlines() if "this tree" in line and "│" in line)
    ratio = row.split("│")[-2].split()[0]
    assert float(ratio) > 0
