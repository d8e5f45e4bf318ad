"""``bench/speculation_log.py``: a cut run's rounds read back from its log (wrapped lines
joined, logs of one drafter's workloads merged) into the report's input."""

from __future__ import annotations

import pytest

from bench.speculation_log import read_rounds

CUT_RUN = ("starting the off service ...\n"  # rich wraps after a space, keeping it
           "  noise 0.1 c=16 round 1: spec-off 6125, k=0 run 5097, controller \n"
           "run 5854 tok/s\n") + """\
  noise 0.1 c=16 round 2, controller run: the server was still busy
  noise 0.1 c=16 round 2: spec-off 5324, k=0 run 4893, controller run 7337
tok/s
  noise 0.1 after c=16: controller (run) K B<=1: 2 (best expected throughput)
  noise 0.1 c=64 round 1: spec-off 14817, k=0 run 13536, controller run
Traceback (most recent call last):
"""
SECOND_CALL = """  noise 0.1 c=64 round 1: spec-off 1.5, k=0 run 1.25, controller run 2 tok/s
  noise 0.1 rollout round 1: spec-off 6223, k=0 run 5717, controller run 6344 tok/s
  noise 0.1 stale c=1 round 1: spec-off 500, k=0 run 400, controller run 450 tok/s
"""


def test_rounds_of_a_cut_log_and_the_next_call_make_one_report() -> None:
    rates = read_rounds([CUT_RUN, SECOND_CALL])
    assert rates["noise 0.1"] == {
        "c=16": {"spec-off": [6125.0, 5324.0], "k=0 run": [5097.0, 4893.0],
                 "controller run": [5854.0, 7337.0]},
        "c=64": {"spec-off": [1.5], "k=0 run": [1.25], "controller run": [2.0]},
        "rollout": {"spec-off": [6223.0], "k=0 run": [5717.0], "controller run": [6344.0]}}
    assert rates["noise 0.1 stale"]["c=1"]["controller run"] == [450.0]


def test_a_workload_in_two_logs_keeps_the_first_logs_rounds() -> None:
    first = "  noise 0.6 c=1 round 1: spec-off 10, controller 12 tok/s\n"
    again = "  noise 0.6 c=1 round 1: spec-off 99, controller 99 tok/s\n"
    assert read_rounds([first, again]) == {
        "noise 0.6": {"c=1": {"spec-off": [10.0], "controller": [12.0]}}}


def test_rounds_of_two_runs_mixed_in_one_log_are_refused() -> None:
    mixed = ("  noise 0.1 c=1 round 1: spec-off 10, controller 12 tok/s\n"
             "  noise 0.1 c=1 round 1: spec-off 11, controller 13 tok/s\n")
    with pytest.raises(ValueError, match="round 1 of"):
        read_rounds([mixed])
