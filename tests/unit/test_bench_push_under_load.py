"""``bench/push_under_load.py``: when to stop, and a run stopped by its time limit still
reports the rounds it finished (the H100's Ray Serve run lost its whole table to the step's
limit, 9 pushes short of the end)."""

from __future__ import annotations

import argparse
import sys

import pytest

from bench import push_under_load
from bench.push_under_load import Round, wants_another_pair


def pushing(num_pushes: int, num_failed: int = 0) -> Round:
    return Round(kind="pushing", tokens_per_s=100.0, num_failed=num_failed,
                 drain_s=[0.1] * num_pushes, frozen_s=[0.2] * num_pushes,
                 push_s=[0.5] * num_pushes, num_replicas_loaded=[2] * num_pushes)


def quiet() -> Round:
    return Round(kind="quiet", tokens_per_s=200.0, num_failed=0)


def test_pushes_count_timed_rounds_failed_ones_included() -> None:
    opts = argparse.Namespace(pushes=10, rounds=3)
    failed = pushing(4)
    failed.push_errors = ["refused"] * 2
    assert wants_another_pair(opts, 0, [pushing(50)])  # the warm-up pair always runs
    assert wants_another_pair(opts, 1, [failed, quiet()])  # 6 of 10
    assert not wants_another_pair(opts, 2, [failed, quiet(), pushing(4), quiet()])


def test_a_stopped_run_reports_what_it_finished(monkeypatch: pytest.MonkeyPatch,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    async def stopped(opts: argparse.Namespace, console: object,
                      rounds: list[Round]) -> None:
        assert opts.warmup_s == 5.0
        rounds.extend([pushing(18), quiet(), pushing(17, num_failed=1)])
        raise KeyboardInterrupt("signal 15")

    monkeypatch.setattr(push_under_load, "run", stopped)
    monkeypatch.setenv("COLUMNS", "200")  # the table's cells in full
    monkeypatch.setattr(sys, "argv", ["push_under_load", "--device", "cpu", "--pushes",
                                      "100", "--warmup-s", "5"])
    push_under_load.main()
    out = capsys.readouterr().out
    assert "stopped (signal 15) after 3 timed rounds" in out
    pushing_row = next(line for line in out.splitlines() if line.startswith("│ pushing"))
    cells = [cell.strip() for cell in pushing_row.split("│")[1:-1]]
    assert cells[3] == "35"  # pushes, both pushing rounds
    assert cells[-1] == "1"  # failed requests
    assert "replicas each push loaded on" not in out  # not a Ray Serve run


def test_nothing_finished_says_so(monkeypatch: pytest.MonkeyPatch,
                                  capsys: pytest.CaptureFixture[str]) -> None:
    async def stopped_at_start(opts: argparse.Namespace, console: object,
                               rounds: list[Round]) -> None:
        raise KeyboardInterrupt  # Ctrl-C during the engine's start

    monkeypatch.setattr(push_under_load, "run", stopped_at_start)
    monkeypatch.setattr(sys, "argv", ["push_under_load", "--device", "cpu"])
    push_under_load.main()
    out = capsys.readouterr().out
    assert "stopped (Ctrl-C) after 0 timed rounds" in out
    assert "no timed round finished" in out


@pytest.mark.parametrize("flag", ["--round-s", "--warmup-s"])
def test_round_lengths_must_be_positive(flag: str, monkeypatch: pytest.MonkeyPatch,
                                        capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(sys, "argv", ["push_under_load", "--device", "cpu", flag, "0"])
    with pytest.raises(SystemExit) as exit_:
        push_under_load.main()
    assert exit_.value.code == 2
    assert "--round-s and --warmup-s must be > 0" in capsys.readouterr().err


def test_each_round_prints_its_frozen_time_and_replicas() -> None:
    """A run cut before its table still shows what each pushing round froze and where
    each push loaded."""
    ray = argparse.Namespace(ray_replicas=2)
    round_ = pushing(3)
    round_.frozen_s = [0.3, 0.1, 0.2]
    round_.num_replicas_loaded = [2, 1, 2]
    assert push_under_load.round_line(round_, ray) == (
        "100 tok/s, 3 pushes, 0 failed pushes, 0 failed requests, frozen p50 0.200 s, "
        "each loaded on 1-2 of 2 replicas")
    standalone = argparse.Namespace(ray_replicas=0)
    assert push_under_load.round_line(quiet(), standalone) == (
        "200 tok/s, 0 pushes, 0 failed pushes, 0 failed requests")
